"""The paper's tables from finished run and sweep directories (memfit_gpu.evaluate.paper_tables).

    python experiments/paper_tables.py --out tables --ablation runs/paper/ablations_locomo_gemma3_27b ...

See `--help` and the module's docstring for every table option and where each number comes from.
"""

from __future__ import annotations

import sys

from memfit_gpu.evaluate.paper_tables import main

if __name__ == "__main__":
    sys.exit(main())
