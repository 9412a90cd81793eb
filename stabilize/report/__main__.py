import sys

from stabilize.report.cli import main

sys.exit(main())
