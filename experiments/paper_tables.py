"""The paper's tables from finished run and sweep directories (memfit_gpu.evaluate.paper_tables).

    python experiments/paper_tables.py --out tables --ablation runs/paper/ablations_locomo_gemma3_27b ...
    python experiments/paper_tables.py --out tables/lightmem --lightmem runs/paper/lightmem_locomo_qwen3_8b

See `--help` and the module's docstring for every table option and where each number comes from.
"""

from __future__ import annotations

import sys

from memfit_gpu.evaluate import lightmem_tables
from memfit_gpu.evaluate.paper_tables import main

if __name__ == "__main__":
    sys.exit(main(extensions=[lightmem_tables]))  # --lightmem: the LightMem-SLM paper's tables (issue 24)
