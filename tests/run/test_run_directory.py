"""run/directory.py: what a run directory's own bookkeeping files must be, and what a damaged one says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit_gpu.config import load_config
from memfit_gpu.live import Memory
from memfit_gpu.run.directory import RunError, StageTimer
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
        with pytest.raises(RunError, match=rf"^{folder} holds a store \(store/\) but is no run directory"):
            run(load_config(SMOKE), folder, progress=False)
        assert sorted(p.name for p in folder.rglob("*")) == before
        assert (folder / "store" / "log.jsonl").read_bytes() == log
    with Memory.open(folder, config=DEMO, overrides=CHEAP) as memory:
        assert memory.users() == ["alice"]
