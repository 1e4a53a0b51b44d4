"""A finished run directory as the report reads it: every file `memfit run` wrote that the report shows.

Nothing is recomputed that a run wrote: metrics.json's tables and intervals, packs.jsonl's ranked candidates
and packs, predictions.jsonl's scores and verdicts (read by `memfit compare`'s reader), provenance.json,
ledger.json and timings.json (through `memfit efficiency`'s row), depths.json. A directory without them is
refused, naming the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit_gpu import provenance
from memfit_gpu.data.schema import DataError
from memfit_gpu.evaluate.compare import read_predictions
from memfit_gpu.evaluate.efficiency import efficiency_values
from memfit_gpu.files import read_json_object, read_jsonl, read_yaml_mapping
from memfit_gpu.readers.ledger import read_ledger


class ReportError(ValueError):
    """A run directory the report cannot read, or a report that cannot keep to its size limit (one line)."""


@dataclass
class RunFiles:
    path: Path
    label: str
    config: dict[str, Any]  # config.yaml as written (a plugin's method name needs no registry here)
    metrics: dict[str, Any]
    provenance: dict[str, Any] | None
    ledger: dict[str, Any]
    timings: dict[str, float]
    packs: dict[str, dict[str, Any]]  # packs.jsonl rows by question id
    predictions: list[dict[str, Any]]  # predictions.jsonl's evaluated rows (the later line of a repeated question)
    depths: dict[str, Any] | None  # depths.json (eval.pack_cutoffs)
    warnings: list[str]

    @property
    def variant(self) -> str:
        return str(self.metrics.get("metric_variant") or "paper")

    @property
    def benchmark(self) -> str | None:
        return self.metrics.get("benchmark")

    @property
    def method(self) -> str:
        return str(self.config.get("method", "memfit"))

    def efficiency(self, price: dict[str, float] | None) -> dict[str, Any]:
        """`memfit efficiency`'s row of this run."""
        return efficiency_values(self.label, self.config, self.ledger, self.timings, int(self.metrics["questions"]),
                                 price)


def _json(path: Path, fields: dict[str, type | tuple[type, ...]] | None = None, numbers: bool = False,
          read: Callable[[Path], dict[str, Any]] | None = None) -> dict[str, Any]:
    """read_json_object of a file a scored run has (or `read`: read_ledger), ReportError naming it otherwise."""
    if not path.is_file():
        raise ReportError(f"{path} does not exist: {path.parent} is not a scored memfit run (memfit run writes it)")
    try:
        return read(path) if read is not None else read_json_object(path, fields, numbers)
    except DataError as exc:  # damaged, or (read_ledger) not a ledger: named with its field
        raise ReportError(str(exc)) from None


def read_run(path: str | Path, label: str) -> RunFiles:
    """One scored run directory (metrics.json written: DONE follows it)."""
    run = Path(path)
    if not run.is_dir():
        raise ReportError(f"{run} is not a directory (give memfit run's --out directories)")
    config_path = run / "config.yaml"
    if not config_path.is_file():
        raise ReportError(f"{config_path} is missing: {run} is not a memfit run directory")
    try:
        config = read_yaml_mapping(config_path)
    except DataError as exc:
        raise ReportError(str(exc)) from None
    metrics = _json(run / "metrics.json", {"questions": int, "average": dict})
    packs_path = run / "packs.jsonl"
    if not packs_path.is_file():
        raise ReportError(f"{packs_path} does not exist: {run} is not a memfit run directory")
    packs = {row["question_id"]: row for row in read_jsonl(packs_path, repair=False)}
    try:
        _, by_id, warnings = read_predictions(run)
    except (ValueError, FileNotFoundError) as exc:
        raise ReportError(str(exc)) from None
    predictions = [{k: v for k, v in row.items() if k != "_line"} for row in by_id.values()]
    missing = [row["question_id"] for row in predictions if row["question_id"] not in packs]
    if missing:
        raise ReportError(f"{packs_path}: {len(missing)} predicted questions have no row (first: {missing[0]})")
    try:
        record = provenance.read(run)
    except provenance.ProvenanceError as exc:
        raise ReportError(str(exc)) from None
    timings = _json(run / "timings.json", numbers=True) if (run / "timings.json").is_file() else dict(metrics.get("timings") or {})
    depths = _json(run / "depths.json") if (run / "depths.json").is_file() else None
    return RunFiles(run, label, config, metrics, record, _json(run / "ledger.json", read=read_ledger),
                    {k: float(v) for k, v in timings.items()}, packs, predictions, depths, warnings)


def labels_for(paths: list[Path]) -> list[str]:
    """Short distinct labels: each directory's name, with as many parent folders as it takes to tell them apart
    (a sweep's `points/k=5` of two sweeps), and a number where even the whole paths are alike."""
    parts = [p.resolve().parts for p in paths]
    depth = 1
    while True:
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels) or depth >= max(len(p) for p in parts):
            break
        depth += 1
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return out
