"""The paper's tables from finished run and sweep directories: the same program as `memfit tables`.

    python experiments/paper_tables.py --out tables --ablation runs/paper/ablations_locomo_gemma3_27b ...
    python experiments/paper_tables.py --out tables/lightmem --lightmem runs/paper/lightmem_locomo_qwen3_8b

See `memfit tables --help` and memfit_gpu/evaluate/paper_tables.py for every table option and where each
number comes from.
"""

from __future__ import annotations

import sys

from memfit_gpu.cli import main

if __name__ == "__main__":
    sys.exit(main(["tables", *sys.argv[1:]]))
