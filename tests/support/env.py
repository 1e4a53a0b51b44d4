"""The environment of a `python -m memfit_gpu.cli` process that a test starts: the one helper for it."""

from __future__ import annotations

import os
from pathlib import Path

from memfit_gpu.faults import FAULT_ENV, IO_FAULT_ENV, TRACE_ENV
from memfit_gpu.plugins import PLUGINS_ENV

TESTS = Path(__file__).resolve().parents[1]
# Every variable memfit_gpu/faults.py reads: a kill point, its trace, an I/O fault. None leaks from the test
# process (or an earlier test) into a run; a test that means one passes it in `extra`.
FAULT_VARS = (FAULT_ENV, TRACE_ENV, IO_FAULT_ENV)


def memfit_env(shared_data: Path | None = None, *, threads: int | None = None, plugins: str | None = None,
               **extra: str) -> dict[str, str]:
    """This process's environment less `FAULT_VARS`, with the hubs offline (HF_HUB_OFFLINE=1) and:
    MEMFIT_DATA_DIR=`shared_data` when given; OMP_NUM_THREADS=`threads` when given (one torch thread per run:
    quick on a shared box, and every run computes the same floats); MEMFIT_PLUGINS=`plugins` with tests/
    first on PYTHONPATH when given (the seam_*.py modules, `support.audit_judges`); then `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in FAULT_VARS}
    env["HF_HUB_OFFLINE"] = "1"
    if shared_data is not None:
        env["MEMFIT_DATA_DIR"] = str(shared_data)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if plugins is not None:
        env[PLUGINS_ENV] = plugins
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    return {**env, **extra}
