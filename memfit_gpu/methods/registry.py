"""Method name -> implementation, capabilities, settings, LLM roles and prompts (the `method` key).

Every method, MemFit included, is a `Method` (methods/base.py) with a write and a read step; `memfit run`
(run/pipeline.py) and `memfit retrieve` (run/offline.py) both build it from here. A new method is one
module and one call, its settings and LLM roles included:

    register_method("my_method", MethodEntry(MyMethod, reader_free=False, settings=MySettings,
                                             roles={"my_note": "write"}, prompts=lambda cfg: MY_PROMPTS))

(`method=my_method` then loads, `plugins.my_method.*` sets MySettings' fields, requests may take role
my_note, and provenance.json hashes the prompt folder's files; config.METHODS lists the built-in names.)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from memfit_gpu.config import (
    ConfigError,
    FullContextConfig,
    LightMemConfig,
    Mem0Config,
    MemFitConfig,
    NaiveRAGConfig,
    register_section,
    section,
)
from memfit_gpu.methods.base import LIVE_MEMBERS, Method
from memfit_gpu.methods.full_context import FullContext
from memfit_gpu.methods.lightmem import LightMem, prompt_folder
from memfit_gpu.methods.memfit import MemFit
from memfit_gpu.methods.naive_rag import NaiveRAG
from memfit_gpu.methods.peers.mem0 import Mem0Method
from memfit_gpu.methods.plain import Plain
from memfit_gpu.readers.types import ROLE_PHASES, register_role
from memfit_gpu.registries import Registry


@dataclass(frozen=True)
class MethodEntry:
    make: Callable[[], Method]  # a fresh instance (it holds its write-time state until read)
    # its read path calls no LLM, so `memfit retrieve` runs it (lightmem_slm's small models are calls
    # that only `memfit run` makes and accounts for)
    reader_free: bool = True
    # a second write with more memories adds them to what a persistent store holds (memfit, plain: the
    # episode store; lightmem_slm: the store and its log); the others rebuild in memory every time
    incremental: bool = False
    # a LiveMethod (methods/base.py): memfit_gpu.Memory and memfit serve run it on a store that grows turn
    # by turn (LIVE_MEMBERS: attach, changed, hits, consolidate, unconsolidated, compact)
    live: bool = False
    # a GrowthMethod (methods/base.py) with `read_at`: it reads its memory as it stood at a point of the
    # trajectory, from its one write of the whole of it (eval.growth_points, memfit_gpu/run/growth.py)
    growth: bool = False
    # a DepthMethod (methods/base.py) with `read_depth`: its pack is the top pack.k of a ranking pack.k does not
    # change, so the same ranking is packed at other depths (eval.pack_cutoffs, memfit_gpu/run/depths.py)
    depths: bool = False
    # another memory system run from its own package (methods/peers/): measured beside MemFit with the same
    # reader and encoder, never held to MemFit's own targets (experiments/bench_online.py, bench_peers.py)
    peer: bool = False
    # its own settings: a dataclass. A built-in section of MemFitConfig (naive_rag, lightmem, ...) is found by
    # its type; any other is registered as `plugins.<method name>` (config.register_section). None: it reads
    # only the shared stages' settings (index, retrieve, pack, reader)
    settings: type | None = None
    # the LLM roles its own calls take beyond answer (and summary), each with its ledger phase (write, read,
    # eval, embed): registered when the entry is (readers.types.register_role)
    roles: Mapping[str, str] = field(default_factory=dict)
    # the folder of the prompt files its own calls are made from, for the run's configuration: provenance.json
    # records the sha256 of each *.txt in it under the method's name; None: it has no prompt files of its own
    prompts: Callable[[MemFitConfig], Path] | None = None


def _built_in_roles(*roles: str) -> dict[str, str]:
    """A built-in method's roles with the phase readers/types.py ROLE_PHASES gives each: that table decides
    the built-in roles' phases, so a ledger.json is totalled the same with or without this registry loaded."""
    return {role: ROLE_PHASES[role] for role in roles}


_LIGHTMEM_ROLES = _built_in_roles("mtm_summary", "consolidate", "rewrite", "rerank_slm")
_MEM0_ROLES = _built_in_roles("mem0_write", "mem0_read", "mem0_embed_write", "mem0_embed_read")

REGISTRY: dict[str, MethodEntry] = {
    "memfit": MethodEntry(MemFit, incremental=True, live=True, depths=True),
    "plain": MethodEntry(Plain, incremental=True, live=True, depths=True),
    "naive_rag": MethodEntry(NaiveRAG, live=True, growth=True, settings=NaiveRAGConfig),
    "full_context": MethodEntry(FullContext, settings=FullContextConfig),
    "lightmem_slm": MethodEntry(LightMem, reader_free=False, incremental=True, live=True, growth=True,
                                settings=LightMemConfig, roles=_LIGHTMEM_ROLES, prompts=prompt_folder),
    # the peer systems, from their own packages (methods/peers/): the `peers` extra
    "mem0": MethodEntry(Mem0Method, reader_free=False, incremental=True, live=True, peer=True,
                        settings=Mem0Config, roles=_MEM0_ROLES),
}

# MemFitConfig's own sections, by their dataclass: a built-in entry's settings is one of them
_BUILT_IN_SECTIONS: dict[type, str] = {type(value): f.name for f in fields(MemFitConfig)
                                       if is_dataclass(value := getattr(MemFitConfig(), f.name))}


METHODS: Registry[MethodEntry] = Registry(
    "method", REGISTRY, lambda name, known: ConfigError(f"method={name!r} is not registered (methods: {', '.join(known)})"))


def register_method(name: str, entry: MethodEntry) -> None:
    """Add a method: `method=name` then runs it in `memfit run` (and `memfit retrieve` when reader_free); its
    settings become `plugins.<name>.*` and its roles are taken by requests."""
    if entry.live and isinstance(entry.make, type):
        missing = [m for m in LIVE_MEMBERS if not callable(getattr(entry.make, m, None))]
        if missing:
            raise ValueError(f"method {name!r}: live=True asks for a LiveMethod (methods/base.py); "
                             f"{entry.make.__name__} lacks {', '.join(missing)}")
        try:  # refused here, not at a compaction that has already rewritten the store (and at every open after it)
            inspect.signature(entry.make.compact).bind(None, None, None, None)
        except TypeError:
            raise ValueError(f"method {name!r}: {entry.make.__name__}.compact must take (run, store, purged): the "
                             "memories that had deleted turns come third (methods/base.py LiveMethod)") from None
    for role, phase in entry.roles.items():
        register_role(role, phase)
    if entry.settings is not None and entry.settings not in _BUILT_IN_SECTIONS:
        register_section(name, entry.settings)
    METHODS.register(name, entry)


def method_settings(cfg: MemFitConfig, name: str) -> Any:
    """The settings of method `name` in `cfg` (its entry's `settings`: MemFitConfig's own section, or
    plugins.<name>); None when the method has none."""
    entry = method_entry(name)
    if entry.settings is None:
        return None
    built_in = _BUILT_IN_SECTIONS.get(entry.settings)
    return getattr(cfg, built_in) if built_in else section(cfg, name)


def method_entry(name: str) -> MethodEntry:
    """The registered entry of `name`; ConfigError naming the registered methods otherwise."""
    return METHODS.get(name)


def methods_with(capability: str) -> list[str]:
    """The registered method names whose entry has `capability` (a MethodEntry flag: growth, live, ...)."""
    return [name for name, entry in METHODS.entries.items() if getattr(entry, capability)]


def make_method(name: str) -> Method:
    """A fresh instance of the method `name`."""
    return method_entry(name).make()
