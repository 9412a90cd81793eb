import sys

from stabilize.replay.cli import main

sys.exit(main())
