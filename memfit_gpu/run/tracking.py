"""Experiment tracking: one Weights & Biases run per run directory, or nothing at all.

```python
tracker = Tracker.start(cfg, run_dir)      # no-op object unless tracking.wandb.enabled
tracker.log_provenance(record)           # provenance.json's record, under `provenance` in the run's config
tracker.log_timings({"build": 12.3, "retrieve": 4.5})
tracker.log_metrics(metrics_json)        # nested: logged as `overall/paper/f1`, ...
tracker.log_predictions(rows, run_dir / "predictions.jsonl")
tracker.log_table("questions", columns, rows)   # a table of the caller's (memfit report's per-question table)
tracker.log_files("report", [run_dir / "report.html"])
tracker.finish()
```

The W&B run id is fixed per run directory (stored in `RUN_DIR/wandb_run_id`, made when the directory is
first tracked: its name and random digits), and runs start with `resume="allow"`: a resumed `memfit run`
continues the same W&B run instead of opening a second one, and a directory deleted and made again starts
a new one. A W&B run that cannot start (online without a login, W&B unreachable) stops the command with a
one-line TrackingError (exit code 2) saying what to set. A sweep passes `tracking.wandb.group=<sweep name>`, so its
points show up together. W&B's own files go to `$WANDB_DIR` when set, else into the run directory.
(tests/support/wandb_offline.py reads back what an offline run recorded, without a server.)
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from memfit_gpu.config import ConfigError, MemFitConfig, to_dict
from memfit_gpu.files import atomic_write_text
from memfit_gpu.mappings import flatten

log = logging.getLogger(__name__)


class TrackingError(ConfigError):
    """W&B could not start a run: the environment's to fix (a login, the network) or the config's (mode)."""


RUN_ID_FILE = "wandb_run_id"
# per-question table: these fields of a predictions.jsonl row, then the table variant's scores
TABLE_FIELDS = ("question_id", "memory_id", "category", "question", "gold", "prediction", "abstained")


def summary_values(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """{"overall": {"paper": {"f1": .5}, "judge": None}} -> {"overall/paper/f1": .5}: the leaves a W&B
    summary holds (numbers, booleans and strings) under slash-joined names; None and lists are dropped."""
    return {k: v for k, v in flatten(metrics, sep="/").items() if isinstance(v, (bool, int, float, str))}


def run_id_for(run_dir: str | Path) -> str:
    """The W&B id of a run directory: kept in RUN_DIR/wandb_run_id, made the first time.

    W&B ids allow letters, digits, `-` and `_` (64 characters at most); the directory name keeps it
    readable, random digits keep two `points/k=5` directories of different sweeps apart, and a directory
    deleted and made again from a W&B run it would otherwise append to (resume="allow").
    """
    run_dir = Path(run_dir)
    stored = run_dir / RUN_ID_FILE
    if stored.exists():
        text = stored.read_text().strip()
        if text:
            return text
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", run_dir.resolve().name).strip("-")[:40] or "run"
    run_id = f"{slug}-{secrets.token_hex(6)}"
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(stored, run_id + "\n")
    return run_id


class Tracker:
    """The no-op tracker: what every run gets when tracking is off. WandbTracker overrides each method."""

    enabled = False
    run_id: str | None = None

    @classmethod
    def start(cls, cfg: MemFitConfig, run_dir: str | Path) -> Tracker:
        settings = cfg.tracking.wandb
        if not settings.enabled or settings.mode == "disabled":
            return Tracker()
        try:
            import wandb  # noqa: F401
        except ImportError:
            log.warning(
                "tracking.wandb.enabled is true but wandb is not installed (pip install 'memfit-gpu[track]'); "
                "this run is not tracked"
            )
            return Tracker()
        return WandbTracker(cfg, Path(run_dir))

    def log_provenance(self, record: Mapping[str, Any]) -> None:
        pass

    def log_timings(self, timings: Mapping[str, float]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, Any]) -> None:
        pass

    def log_predictions(self, rows: Sequence[Mapping[str, Any]], path: str | Path | None = None) -> None:
        pass

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        pass

    def log_files(self, name: str, paths: Sequence[str | Path], images: Sequence[str | Path] = ()) -> None:
        pass

    def finish(self) -> None:
        pass

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


class WandbTracker(Tracker):
    enabled = True

    def __init__(self, cfg: MemFitConfig, run_dir: Path):
        import wandb

        settings = cfg.tracking.wandb
        self.run_dir = run_dir
        self.run_id = run_id_for(run_dir)
        self.table_metric = cfg.eval.table_metric
        wandb_dir = Path(os.environ.get("WANDB_DIR") or run_dir)
        wandb_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=settings.project,
                entity=settings.entity,
                group=settings.group,
                id=self.run_id,
                name=run_dir.resolve().name,
                resume="allow",
                mode=settings.mode,
                dir=str(wandb_dir),
                config=to_dict(cfg),
                job_type="memfit-run",
                tags=[cfg.name],
                reinit="create_new",
            )
        except Exception as exc:  # noqa: BLE001  (no key, no network, a refused id: W&B's own error types)
            raise TrackingError(f"W&B could not start the run's tracking ({settings.mode} mode: "
                                f"{type(exc).__name__}: {str(exc).strip()[:300]}); log in with `wandb login` (or set "
                                "WANDB_API_KEY), set tracking.wandb.mode=offline to log locally and `wandb sync` "
                                "later, or tracking.wandb.enabled=false") from None
        log.info("W&B run %s (%s mode, project %s, group %s)", self.run_id, settings.mode, settings.project,
                 settings.group)

    def log_provenance(self, record: Mapping[str, Any]) -> None:
        # allow_val_change: a resume that --allow-provenance-change let through records the new values
        self.run.config.update({"provenance": dict(record)}, allow_val_change=True)

    def log_timings(self, timings: Mapping[str, float]) -> None:
        flat = {f"timings/{stage}": float(seconds) for stage, seconds in timings.items()}
        self.run.log(flat)
        self.run.summary.update(flat)

    def log_metrics(self, metrics: Mapping[str, Any]) -> None:
        flat = summary_values(metrics)
        numeric = {k: v for k, v in flat.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numeric:
            self.run.log(numeric)
        self.run.summary.update(flat)

    def log_predictions(self, rows: Sequence[Mapping[str, Any]], path: str | Path | None = None) -> None:
        import wandb

        variant = self.table_metric
        columns = [*TABLE_FIELDS, f"{variant}_f1", f"{variant}_bleu1", "judge", "pack_hit"]
        data = []
        for row in rows:
            scores = (row.get("scores") or {}).get(variant) or {}
            judge = row.get("judge") or {}
            retrieval = row.get("retrieval") or {}
            data.append(
                [*(_table_cell(row.get(f)) for f in TABLE_FIELDS), scores.get("f1"), scores.get("bleu1"),
                 judge.get("verdict"), retrieval.get("pack_hit")]
            )
        self.run.log({"predictions": wandb.Table(columns=columns, data=data)})
        if path is not None and Path(path).exists():
            artifact = wandb.Artifact(f"predictions-{self.run_id}", type="predictions",
                                      metadata={"questions": len(rows), "run_dir": str(self.run_dir)})
            artifact.add_file(str(path), name=Path(path).name)
            self.run.log_artifact(artifact)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """A table the caller built (columns, one list of cells per row) as a wandb.Table under `name`."""
        import wandb

        self.run.log({name: wandb.Table(columns=list(columns), data=[[_table_cell(v) for v in row] for row in rows])})

    def log_files(self, name: str, paths: Sequence[str | Path], images: Sequence[str | Path] = ()) -> None:
        """Files as one artifact of type `name` (e.g. profile.json), and images shown in the run (profile.png)."""
        import wandb

        for image in images:
            self.run.log({f"{name}/{Path(image).stem}": wandb.Image(str(image))})
        artifact = wandb.Artifact(f"{name}-{self.run_id}", type=name, metadata={"run_dir": str(self.run_dir)})
        for path in [*paths, *images]:
            artifact.add_file(str(path), name=Path(path).name)
        self.run.log_artifact(artifact)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _table_cell(value: Any) -> Any:
    # wandb.Table wants one type per column; category ids are strings in the schema, keep them so
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return json.dumps(value)
