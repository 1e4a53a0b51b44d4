"""Benchmark name -> BenchmarkSpec (data/spec.py), one per loader module.

    benchmark_spec("locomo").categories     # what every part of memfit asks of a benchmark
    register_benchmark(MY_SPEC)             # a new benchmark: one loader module with its SPEC, one call

(config.register_choice lets data.benchmark take the name; config.BENCHMARKS lists the built-in names,
and tests/test_seams.py checks that they are this registry's keys.)
"""

from __future__ import annotations

from memfit_gpu.config import ConfigError
from memfit_gpu.data import beam, jsonl, locomo, longmemeval, memgallery
from memfit_gpu.data.spec import BenchmarkSpec
from memfit_gpu.registries import Registry

REGISTRY: dict[str, BenchmarkSpec] = {
    spec.name: spec for spec in (locomo.SPEC, longmemeval.SPEC, memgallery.SPEC, jsonl.SPEC, beam.SPEC)
}


BENCHMARKS: Registry[BenchmarkSpec] = Registry(
    "data.benchmark", REGISTRY, lambda name, known: ConfigError(f"unknown benchmark {name!r}: choose one of {', '.join(known)}"))


def register_benchmark(spec: BenchmarkSpec) -> None:
    """Add a benchmark: data.benchmark=spec.name then loads it, and every table and prompt asks its spec."""
    BENCHMARKS.register(spec.name, spec)


def benchmark_spec(name: str) -> BenchmarkSpec:
    """The spec of `name` (any case); ConfigError naming the registered benchmarks otherwise."""
    return BENCHMARKS.get(name.lower())


def find_spec(name: str | None) -> BenchmarkSpec | None:
    """The spec of `name` when it is registered (tables of a run another setup wrote may name another)."""
    return REGISTRY.get((name or "").lower())


def split_benchmarks() -> list[str]:
    """The benchmarks whose files come in splits (data.split)."""
    return [name for name, spec in REGISTRY.items() if spec.splits]
