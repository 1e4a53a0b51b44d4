"""`python -m memfit_gpu.cli ...`: the same as the `memfit` console script (sweeps launch points this way)."""

import sys

from memfit_gpu.cli import main

sys.exit(main())
