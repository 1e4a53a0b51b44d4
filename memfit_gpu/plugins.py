"""Extensions in your own code: `MEMFIT_PLUGINS=module[,module...]` names modules every `memfit` command
imports before it runs.

A method, a reader backend or a benchmark is one module of yours with one registry call at its top level
(docs/how-to/extending.md):

    # my_lab/recency.py
    from memfit_gpu.methods.registry import MethodEntry, register_method
    class Recency: ...                                   # write / read / close (methods/base.py Method)
    register_method("recency", MethodEntry(Recency))

    MEMFIT_PLUGINS=my_lab.recency memfit run --config configs/memfit.yaml --out runs/r method=recency

The variable reaches every process a command starts (sweep points, SLURM tasks inherit the environment),
so `memfit sweep` runs registered names too. The module must be importable (installed, or on PYTHONPATH).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping

from memfit_gpu.config import ConfigError

PLUGINS_ENV = "MEMFIT_PLUGINS"


def load_plugins(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Import every module $MEMFIT_PLUGINS names (comma-separated), in order; returns their names.

    Raises:
        ConfigError: a named module cannot be imported (the message names it and why).
    """
    names = [name.strip() for name in environ.get(PLUGINS_ENV, "").split(",") if name.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"${PLUGINS_ENV} names {name!r}, which cannot be imported ({exc}); install it or "
                              "put its folder on PYTHONPATH") from None
    return names
