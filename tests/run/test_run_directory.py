"""run/directory.py: what a run directory's own bookkeeping files must be, and what a damaged one says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit_gpu.config import load_config, to_yaml
from memfit_gpu.data.schema import DataError
from memfit_gpu.files import read_jsonl
from memfit_gpu.live import Memory
from memfit_gpu.run.directory import RunError, StageTimer, record_config, whole_groups
from memfit_gpu.run.pipeline import run

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"
DEMO = REPO / "configs" / "demo.yaml"
CHEAP = ["rerank.backend=none", "summary.enabled=false", "reader.backend=echo", "live.consolidate=manual"]


def test_stage_times_accumulate_across_invocations(tmp_path: Path) -> None:
    path = tmp_path / "timings.json"
    timer = StageTimer.load(path)
    timer.seconds["build"] = 2.5
    timer._save()
    again = StageTimer.load(path)
    assert again.seconds == {"build": 2.5} and json.loads(path.read_text()) == {"build": 2.5}


@pytest.mark.parametrize("content", [b'{"load": ', b"[]", b'{"build": "x"}', b"\xff"])
def test_a_damaged_timings_file_is_a_run_error_naming_it(tmp_path: Path, content: bytes) -> None:
    """A resume over a timings.json that is not JSON, not an object of numbers or not UTF-8 was a traceback."""
    path = tmp_path / "timings.json"
    path.write_bytes(content)
    with pytest.raises(RunError) as refused:
        StageTimer.load(path)
    assert str(refused.value).startswith(f"{path}")
    assert str(refused.value).endswith(": not the stage times memfit writes; delete it to resume (only the earlier "
                                       "invocations' stage times are lost, no result)")


def test_a_run_into_a_live_memorys_folder_is_refused_and_changes_nothing(tmp_path: Path, shared_data: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`memfit run --out` a live memory's folder would add the benchmark to its users' store and its calls to their
    cache, and leave a folder Memory.open refuses as a run directory. Refused under the lock, before config.yaml;
    a config.yaml of the operator's own there does not make it a run directory either."""
    import seam_echo_backend  # noqa: F401  (registers reader.backend=echo)

    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    folder = tmp_path / "memory"
    with Memory.open(folder, config=DEMO, overrides=CHEAP) as memory:
        memory.add(["alice"], [[{"speaker": "alice", "text": "I adopted a dog named Rex."}]])
    before = sorted(p.name for p in folder.rglob("*"))
    log = (folder / "store" / "log.jsonl").read_bytes()
    for operator_config in (False, True):
        if operator_config:
            (folder / "config.yaml").write_text(DEMO.read_text())
            before = sorted(p.name for p in folder.rglob("*"))
        with pytest.raises(RunError, match=rf"^{folder} holds a store \(store/\) but is a live memory's folder"):
            run(load_config(SMOKE), folder, progress=False)
        assert sorted(p.name for p in folder.rglob("*")) == before
        assert (folder / "store" / "log.jsonl").read_bytes() == log
    with Memory.open(folder, config=DEMO, overrides=CHEAP) as memory:
        assert memory.users() == ["alice"]


def _lines(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def test_a_group_cut_short_is_taken_out_of_its_file_to_be_made_again(tmp_path: Path) -> None:
    """growth.jsonl and depths.jsonl append each point (depth) whole: its head row, then a row per question. A kill
    or a full disk in the middle of that write left the head and some rows: the point counted as done and its
    scores were averaged over the rows left. Such a group is taken out of the file now, and made again."""
    path = tmp_path / "growth.jsonl"

    def question(point: int, qid: str) -> dict:
        return {"t": "question", "point": point, "question_id": qid, "scores": {"paper": {"f1": 1.0}}}

    whole = [{"t": "point", "point": 1, "questions": 2}, question(1, "a"), question(1, "b")]
    cut = [{"t": "point", "point": 2, "questions": 3}, question(2, "a"), question(2, "b")]
    path.write_text(_lines(whole + cut) + '{"t": "question", "point": 2, "questi')  # the third row torn
    assert whole_groups(path, "point", "point") == whole
    assert path.read_text() == _lines(whole)  # rewritten whole: point 2 is made again by the rerun
    path.write_text(_lines([*whole, question(3, "a")]))  # rows whose head was lost
    assert whole_groups(path, "point", "point") == whole and path.read_text() == _lines(whole)
    empty = [{"t": "depth", "k": 5, "questions": 0}]  # a depth with no question is whole
    depths = tmp_path / "depths.jsonl"
    depths.write_text(_lines(empty))
    before = depths.stat().st_mtime_ns
    assert whole_groups(depths, "depth", "k") == empty and depths.stat().st_mtime_ns == before
    assert whole_groups(tmp_path / "missing.jsonl", "depth", "k") == []


def test_a_line_that_is_not_utf8_is_a_data_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "predictions.jsonl"
    path.write_bytes(b'{"question_id": "q1"}\n{"prediction": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"predictions\.jsonl, item line 2: not UTF-8 text \(invalid "):
        read_jsonl(path)


def test_a_finished_run_with_damaged_metrics_is_a_data_error_naming_the_file(tmp_path: Path) -> None:
    """A finished run (DONE) is only reported: its metrics.json damaged was a JSON traceback."""
    out = tmp_path / "run"
    out.mkdir()
    cfg = load_config(SMOKE)
    (out / "config.yaml").write_text(to_yaml(cfg))
    (out / "DONE").write_text("2026-12-07T10:00:00\n")
    (out / "metrics.json").write_text('{"questions": 6, "overall"')
    with pytest.raises(DataError, match=rf"^{out / 'metrics.json'}: not valid JSON"):
        run(cfg, out, progress=False)


def test_an_emptied_config_yaml_is_an_error_naming_it_not_the_defaults(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A run directory's config.yaml holds every section (record_config). Emptied, load_config read it as the
    defaults: a resume was refused as "another configuration", the judge audit ran the default judge."""
    from memfit_gpu.cli import main

    out = tmp_path / "run"
    out.mkdir()
    for name, text in (("config.yaml", ""), ("DONE", "x\n"), ("predictions.jsonl", "{}\n"), ("timings.json", "{}")):
        (out / name).write_text(text)
    with pytest.raises(DataError, match=rf"^{out / 'config.yaml'}: expected a mapping of keys, got NoneType"):
        run(load_config(SMOKE), out, progress=False)
    for command in (["judge-audit", "--quiet", str(out)], ["store", "compact", str(out)]):
        capsys.readouterr()
        assert main(command) == 2
        assert capsys.readouterr().err.strip().endswith(f"{out / 'config.yaml'}: expected a mapping of keys, got "
                                                        "NoneType"), command
    assert (out / "config.yaml").read_text() == ""


def test_a_run_started_under_the_old_category_default_resumes_where_it_selects_the_same(tmp_path: Path) -> None:
    """data.exclude_categories defaulted to ['5']; it is now null (the benchmark's evaluated set). On LoCoMo
    both select the same questions, so a LoCoMo run started before resumes; on own data, where "5" is a label
    like any other, they differ and the resume is refused naming the key."""
    for benchmark, resumes in (("locomo", True), ("jsonl", False)):
        out = tmp_path / benchmark
        out.mkdir()
        (out / "config.yaml").write_text(to_yaml(load_config(None, [f"data.benchmark={benchmark}",
                                                                    "data.exclude_categories=[5]"])))
        now = load_config(None, [f"data.benchmark={benchmark}"])
        if resumes:
            record_config(now, out)
            record_config(load_config(None, [f"data.benchmark={benchmark}", "data.exclude_categories=[5]"]), out)
            with pytest.raises(RunError, match=r"data.exclude_categories"):
                record_config(load_config(None, [f"data.benchmark={benchmark}", "data.exclude_categories=[]"]), out)
        else:
            with pytest.raises(RunError, match=r"started with a different configuration \(data.exclude_categories\)"):
                record_config(now, out)


def test_a_resume_with_its_data_or_servers_elsewhere_is_the_same_run(tmp_path: Path) -> None:
    """A sweep pins data.path to where each task finds the data, and a requeued task may find it (or its judge
    server) elsewhere: such a resume was refused as "a different configuration (data.path)". Where the inputs
    lie is not compared (provenance.json compares what they hold); anything else still is."""
    out = tmp_path / "run"
    out.mkdir()
    record_config(load_config(None, ["data.path=/nodeA/data/locomo10.json", "reader.backend=openai",
                                     "reader.base_urls=[http://nodeA:8000/v1]"]), out)
    record_config(load_config(None, ["data.path=/nodeB/shared/locomo10.json", "reader.backend=openai",
                                     "reader.base_urls=[http://nodeB:8000/v1]",
                                     "eval.judge.base_urls=[http://nodeB:8200/v1]"]), out)
    with pytest.raises(RunError, match=r"different configuration \(pack.k\)"):
        record_config(load_config(None, ["data.path=/nodeB/shared/locomo10.json", "reader.backend=openai",
                                         "reader.base_urls=[http://nodeB:8000/v1]", "pack.k=5"]), out)
