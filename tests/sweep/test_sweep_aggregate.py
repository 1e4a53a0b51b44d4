"""`memfit aggregate` and `memfit tables` over run directories another memfit (or damage) left: what they
cannot read is refused naming the file and the field, never shown as blank cells."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit_gpu.data.schema import DataError
from memfit_gpu.evaluate.paper_tables import TablesError, load_run
from memfit_gpu.sweep.aggregate import aggregate, pack_hit_rate

OLDER = {"questions": 4, "overall": {"paper": {"f1": 0.5}}}  # before `average` and `metric_variant`


def _sweep(tmp_path: Path, metrics: dict) -> Path:
    point = tmp_path / "sw" / "points" / "k=5"
    point.mkdir(parents=True)
    (tmp_path / "sw" / "sweep.json").write_text(json.dumps({"name": "s", "sweep_keys": ["pack.k"], "points": [
        {"id": "k=5", "overrides": {"pack.k": 5}, "dir": str(point), "state": "done"}]}))
    (point / "metrics.json").write_text(json.dumps(metrics))
    (point / "DONE").write_text("")
    (point / "config.yaml").write_text("name: old\n")
    return tmp_path / "sw"


def test_an_older_metrics_json_is_refused_by_aggregate_and_tables_naming_the_field(tmp_path: Path) -> None:
    """Both printed a row of blanks (exit 0) for a metrics.json without `average`; report refused it."""
    sweep = _sweep(tmp_path, OLDER)
    with pytest.raises(DataError, match=r"k=5/metrics.json, field 'metric_variant': missing"):
        aggregate(sweep)
    with pytest.raises(TablesError, match=r"k=5/metrics.json, field 'metric_variant': missing"):
        load_run(sweep / "points" / "k=5")
    listed = _sweep(tmp_path / "b", {**OLDER, "metric_variant": ["paper"], "average": {}})
    with pytest.raises(DataError, match=r"field 'metric_variant': expected str, got list"):  # was a TypeError
        aggregate(listed)


def test_pack_hit_is_read_through_the_one_jsonl_reader(tmp_path: Path) -> None:
    """A predictions.jsonl whose last line a kill cut short gave a JSONDecodeError traceback."""
    path = tmp_path / "predictions.jsonl"
    rows = [{"evaluated": True, "retrieval": {"pack_hit": hit}} for hit in (True, False, True)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"evaluated": true, "retr')
    assert pack_hit_rate(path) == pytest.approx(2 / 3)
    assert path.read_text().endswith('"retr')  # a reader leaves another process's file alone
    path.write_text("not json\n")
    with pytest.raises(DataError, match=r"predictions.jsonl, item line 1: not valid JSON"):
        pack_hit_rate(path)


def test_an_archived_sweep_reads_its_own_points_not_the_new_sweep_at_its_old_place(tmp_path: Path) -> None:
    """sweep.json records each point's absolute `dir`; aggregate read it whenever it existed. A sweep folder
    archived under another name, with a new sweep run at the old name, printed the new sweep's F1 under the
    archived one's name. Every reader of a sweep now goes by OUT/points/<id>."""
    def metrics(f1: float) -> dict:
        return {"metric_variant": "paper", "questions": 6, "average": {"paper": {"f1": f1, "bleu1": f1}}}

    first = _sweep(tmp_path, metrics(0.11))
    first.rename(tmp_path / "sw_v1")
    _sweep(tmp_path, metrics(0.99))  # a new sweep at the old place: the archived sweep.json's dirs name it
    columns, rows = aggregate(tmp_path / "sw_v1")
    assert rows[0]["f1"] == pytest.approx(0.11), rows  # the new sweep's is 0.99
