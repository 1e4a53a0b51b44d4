"""Method name -> implementation and capabilities (the `method` key).

Every method, MemFit included, is a `Method` (methods/base.py) with a write and a read step; `memfit run`
(pipeline.py) and `memfit retrieve` (methods/offline.py) both build it from here. A new method is one
module and one call:

    register_method("my_method", MethodEntry(MyMethod, reader_free=True))

(config.register_choice lets `method=my_method` load; config.METHODS lists the built-in names.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memfit_gpu.config import ConfigError
from memfit_gpu.methods.base import Method
from memfit_gpu.methods.full_context import FullContext
from memfit_gpu.methods.lightmem import LightMem
from memfit_gpu.methods.memfit import MemFit
from memfit_gpu.methods.naive_rag import NaiveRAG
from memfit_gpu.methods.peers.mem0 import Mem0Method
from memfit_gpu.methods.plain import Plain
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
    # by turn (attach, changed, hits, consolidate, compact)
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


REGISTRY: dict[str, MethodEntry] = {
    "memfit": MethodEntry(MemFit, incremental=True, live=True, depths=True),
    "plain": MethodEntry(Plain, incremental=True, live=True, depths=True),
    "naive_rag": MethodEntry(NaiveRAG, live=True, growth=True),
    "full_context": MethodEntry(FullContext),
    "lightmem_slm": MethodEntry(LightMem, reader_free=False, incremental=True, live=True, growth=True),
    # the peer systems, from their own packages (methods/peers/): the `peers` extra
    "mem0": MethodEntry(Mem0Method, reader_free=False, incremental=True, live=True, peer=True),
}


METHODS: Registry[MethodEntry] = Registry(
    "method", REGISTRY, lambda name, known: ConfigError(f"method={name!r} is not registered (methods: {', '.join(known)})"))


def register_method(name: str, entry: MethodEntry) -> None:
    """Add a method: `method=name` then runs it in `memfit run` (and `memfit retrieve` when reader_free)."""
    METHODS.register(name, entry)


def method_entry(name: str) -> MethodEntry:
    """The registered entry of `name`; ConfigError naming the registered methods otherwise."""
    return METHODS.get(name)


def methods_with(capability: str) -> list[str]:
    """The registered method names whose entry has `capability` (a MethodEntry flag: growth, live, ...)."""
    return [name for name, entry in METHODS.entries.items() if getattr(entry, capability)]


def make_method(name: str) -> Method:
    """A fresh instance of the method `name`."""
    return method_entry(name).make()
