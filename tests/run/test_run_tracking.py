"""W&B tracking: a real offline wandb run per run directory, read back from its transaction log."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
from support.wandb_offline import read_offline_run

from memfit_gpu.config import ConfigError, load_config
from memfit_gpu.mappings import flatten
from memfit_gpu.run.tracking import (
    RUN_ID_FILE,
    Tracker,
    TrackingError,
    WandbTracker,
    run_id_for,
    summary_values,
)

ROWS = [
    {"question_id": "conv-26:q0", "memory_id": "conv-26", "category": "2", "evaluated": True,
     "question": "When did Caroline go to the LGBTQ support group?", "gold": "7 May 2023",
     "prediction": "7 May 2023", "raw_output": "7 May 2023", "abstained": False,
     "scores": {"paper": {"f1": 1.0, "bleu1": 1.0}, "locomo": {"f1": 1.0, "bleu1": 1.0}},
     "judge": {"verdict": True, "reason": "same date", "score": 1.0},
     "retrieval": {"pack_hit": True, "pack_hit_window": True, "hit@30": True, "rr": 1.0}},
    {"question_id": "conv-26:q1", "memory_id": "conv-26", "category": "1", "evaluated": True,
     "question": "What did Caroline research?", "gold": "Adoption agencies",
     "prediction": "agencies", "raw_output": "agencies", "abstained": False,
     "scores": {"paper": {"f1": 0.6667, "bleu1": 0.3679}, "locomo": {"f1": 0.6667, "bleu1": 0.3679}},
     "judge": None,
     "retrieval": {"pack_hit": False, "pack_hit_window": True, "hit@30": True, "rr": 0.25}},
]
METRICS = {"benchmark": "locomo", "questions": 2, "metric_variant": "paper",
           "overall": {"paper": {"f1": 0.83335, "bleu1": 0.68395}, "judge": None},
           "timings": {"build": 1.5}}


@pytest.fixture()
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    wandb_dir = tmp_path / "wandb-files"
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return wandb_dir


def run_folders(wandb_env: Path, run_id: str) -> list[Path]:
    """The offline folders of one run id: W&B names a second start within the same second of the first
    (a resume) `offline-run-<time>-<id>-1`, so the plain `*-<id>` glob would miss it."""
    pattern = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    return sorted(f for f in (wandb_env / "wandb").glob("offline-run-*") if pattern.fullmatch(f.name))


def test_summary_values_keep_numbers_and_text_drop_none() -> None:
    metrics = {"overall": {"paper": {"f1": 0.5}, "judge": None}, "questions": 3, "metric_variant": "paper",
               "variants": ["paper"]}
    assert summary_values(metrics) == {"overall/paper/f1": 0.5, "questions": 3, "metric_variant": "paper"}
    # the one flattener keeps every leaf; the W&B summary is its scalar part
    assert flatten(metrics, sep="/") == {"overall/paper/f1": 0.5, "overall/judge": None, "questions": 3,
                                         "metric_variant": "paper", "variants": ["paper"]}


def test_run_id_is_stable_per_directory_and_distinct_across_sweeps(tmp_path: Path) -> None:
    a = tmp_path / "sweep-a" / "points" / "k=5"
    b = tmp_path / "sweep-b" / "points" / "k=5"
    id_a, id_b = run_id_for(a), run_id_for(b)
    assert id_a != id_b
    assert id_a.startswith("k-5-") and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", id_a)
    assert run_id_for(a) == id_a  # read back from the file, not recomputed
    assert (a / RUN_ID_FILE).read_text().strip() == id_a
    # a moved run directory keeps its W&B run (the id travels in the file)
    moved = tmp_path / "moved"
    a.rename(moved)
    assert run_id_for(moved) == id_a
    # a directory deleted and made again is a new run: its id came from the path alone, so with resume="allow"
    # the new run appended to the deleted one's W&B run
    shutil.rmtree(moved)
    assert run_id_for(moved) != id_a


def test_a_w_and_b_run_that_cannot_start_is_one_line_exit_2(tmp_path: Path, wandb_env: Path,
                                                             monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Online without a login, `memfit run` ended in W&B's traceback (exit 1), which a sweep retries as a
    crash, up to max_requeue times. It is one line naming what to set (exit 2: not retried)."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    cfg = load_config(None, ["tracking.wandb.enabled=true", "tracking.wandb.mode=online"])
    with pytest.raises(TrackingError, match=r"W&B could not start the run's tracking \(online mode: .*\); log in "
                                            r"with `wandb login`"):
        Tracker.start(cfg, tmp_path / "run")
    assert issubclass(TrackingError, ConfigError)  # every command's user error: exit 2, one line


def test_disabled_tracking_is_a_no_op(tmp_path: Path, wandb_env: Path) -> None:
    cfg = load_config(None, [])
    tracker = Tracker.start(cfg, tmp_path / "run")
    assert type(tracker) is Tracker and not tracker.enabled
    tracker.log_timings({"build": 1.0})
    tracker.log_metrics(METRICS)
    tracker.log_predictions(ROWS, None)
    tracker.finish()
    assert not wandb_env.exists() and not (tmp_path / "run").exists()
    # mode=disabled is off too, even with enabled=true
    assert type(Tracker.start(load_config(None, ["tracking.wandb.enabled=true", "tracking.wandb.mode=disabled"]),
                              tmp_path / "run")) is Tracker


def test_enabled_without_wandb_warns_and_does_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # provokes ImportError on `import wandb`
    cfg = load_config(None, ["tracking.wandb.enabled=true"])
    with caplog.at_level(logging.WARNING, logger="memfit_gpu.run.tracking"):
        tracker = Tracker.start(cfg, tmp_path / "run")
    assert type(tracker) is Tracker
    assert "wandb is not installed" in caplog.text


@pytest.mark.slow
def test_offline_run_records_config_timings_metrics_table_and_artifact(tmp_path: Path, wandb_env: Path) -> None:
    run_dir = tmp_path / "points" / "k=7"
    run_dir.mkdir(parents=True)
    predictions = run_dir / "predictions.jsonl"
    predictions.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = load_config(None, ["tracking.wandb.enabled=true", "tracking.wandb.group=smoke-sweep",
                             "tracking.wandb.project=memfit-test", "pack.k=7"])

    tracker = Tracker.start(cfg, run_dir)
    assert isinstance(tracker, WandbTracker)
    tracker.log_provenance({"schema": 1, "data": {"files": {"locomo10.json": {"sha256": "79fa87e9"}}}})
    tracker.log_timings({"build": 1.5, "retrieve": 0.25})
    tracker.log_metrics(METRICS)
    tracker.log_predictions(ROWS, predictions)
    tracker.finish()

    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    folders = run_folders(wandb_env, run_id)
    assert len(folders) == 1
    run = read_offline_run(folders[0], wait_s=30)
    assert run.exited
    assert (run.run_id, run.project, run.group) == (run_id, "memfit-test", "smoke-sweep")
    assert run.tags == [cfg.name] == ["memfit"]  # the config's `name` labels the run
    # the resolved config, nested as MemFitConfig
    assert run.config["pack"]["k"] == 7
    assert run.config["tracking"]["wandb"]["group"] == "smoke-sweep"
    assert run.config["retrieve"]["scan_top_k"] == 60
    # provenance.json's record beside it
    assert run.config["provenance"]["data"]["files"]["locomo10.json"]["sha256"] == "79fa87e9"
    # timings and metrics in the summary and in history
    assert run.summary["timings/build"] == 1.5 and run.summary["timings/retrieve"] == 0.25
    assert run.summary["overall/paper/f1"] == 0.83335 and run.summary["questions"] == 2
    assert run.summary["metric_variant"] == "paper"
    assert any(row.get("overall/paper/f1") == 0.83335 for row in run.history)
    # the per-question table: 2 rows, 11 columns (7 fields, f1, bleu1, judge, pack_hit)
    table = next(row["predictions"] for row in run.history if "predictions" in row)
    assert (table["_type"], table["nrows"], table["ncols"]) == ("table-file", 2, 11)
    table_file = folders[0] / "files" / table["path"]
    table_json = json.loads(table_file.read_text())
    assert table_json["columns"][-4:] == ["paper_f1", "paper_bleu1", "judge", "pack_hit"]
    assert table_json["data"][1][0] == "conv-26:q1" and table_json["data"][1][-4:] == [0.6667, 0.3679, None, False]
    # the predictions file as an artifact, byte for byte (manifest digest = base64 md5)
    artifact = next(a for a in run.artifacts if a["type"] == "predictions")
    assert artifact["name"] == f"predictions-{run_id}"
    assert artifact["files"] == ["predictions.jsonl"]
    md5 = base64.b64encode(hashlib.md5(predictions.read_bytes()).digest()).decode()
    assert artifact["digests"]["predictions.jsonl"] == md5

    # a resumed run directory continues the same W&B run
    again = Tracker.start(cfg, run_dir)
    assert again.run_id == run_id
    again.log_metrics({"resumed": 1})
    again.finish()
    # finish() returns before W&B's service has written the resumed run's folder: poll for it
    deadline = time.monotonic() + 60
    while True:
        folders = run_folders(wandb_env, run_id)
        records = [read_offline_run(f) for f in folders if any(f.glob("run-*.wandb"))]
        if any(r.summary.get("resumed") == 1 for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {r.run_id for r in records} == {run_id}
    assert any(r.summary.get("resumed") == 1 for r in records)


def test_offline_run_records_profile_files_and_image(tmp_path: Path, wandb_env: Path) -> None:
    """What `memfit profile` logs: profile.png shown as an image, profile.json + png as one artifact."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = tmp_path / "prof"
    out.mkdir()
    (out / "profile.json").write_text('{"stages": {}}\n')
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    fig.savefig(out / "profile.png")
    plt.close(fig)
    cfg = load_config(None, ["tracking.wandb.enabled=true", "tracking.wandb.project=memfit-test"])
    tracker = Tracker.start(cfg, out)
    tracker.log_files("profile", [out / "profile.json"], images=[out / "profile.png"])
    tracker.finish()
    run_id = (out / RUN_ID_FILE).read_text().strip()
    folders = run_folders(wandb_env, run_id)
    run = read_offline_run(folders[0], wait_s=30)
    image = next(row["profile/profile"] for row in run.history if "profile/profile" in row)
    assert image["_type"] == "image-file" and image["format"] == "png"
    artifact = next(a for a in run.artifacts if a["type"] == "profile")
    assert sorted(artifact["files"]) == ["profile.json", "profile.png"]
    md5 = base64.b64encode(hashlib.md5((out / "profile.json").read_bytes()).digest()).decode()
    assert artifact["digests"]["profile.json"] == md5
