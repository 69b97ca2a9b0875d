"""`python -m console.cli …` is `dsv4 …` (worker processes and rank processes start it this way)."""

import sys

from console.cli import main

sys.exit(main())
