"""`python -m attnres_hf.cli ...` (what `accelerate launch -m attnres_hf.cli train ...` runs)."""

import sys

from . import main

sys.exit(main())
