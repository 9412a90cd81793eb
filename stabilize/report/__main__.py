import sys

from stabilize.report import main

sys.exit(main())
