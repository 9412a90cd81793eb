"""``python -m stabilize.plan`` = ``stabilize-plan``."""

import sys

from stabilize.plan.cli import main

sys.exit(main())
