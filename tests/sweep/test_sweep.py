"""Sweep files, point ids and overrides, the aggregate table: no processes (see test_sweep_slurm.py)."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
from support.env import memfit_env

from memfit_gpu.cli import main as memfit_main
from memfit_gpu.cli.sweep import same_config
from memfit_gpu.config import load_config, to_yaml
from memfit_gpu.data import resolve_data_path
from memfit_gpu.sweep import slurm, watch
from memfit_gpu.sweep import spec as spec_module
from memfit_gpu.sweep.aggregate import aggregate, predictions_dataset, to_csv, to_markdown
from memfit_gpu.sweep.driver import run_point, run_sweep
from memfit_gpu.sweep.spec import (
    SweepError,
    find_point,
    load_sweep,
    override_arg,
    pin_data_location,
    point_command,
    point_ids,
    point_overrides,
)
from memfit_gpu.sweep.state import JobRecord, PointState, SweepState, read_sweep_record, state_after_stop

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "configs" / "memfit.yaml"


def write_sweep(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "sweeps" / "s.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body.replace("BASE", str(BASE)))
    return path


def test_override_arg_reads_back_as_the_same_value() -> None:
    args = [
        override_arg("reader.base_urls", ["http://127.0.0.1:8100/v1", "http://127.0.0.1:8101/v1"]),
        override_arg("retrieve.alpha", 0.5),
        override_arg("retrieve.prf.enabled", False),
        override_arg("data.limit_questions", None),
        override_arg("reader.model", "Qwen/Qwen2.5-7B-Instruct"),
    ]
    assert args[0] == 'reader.base_urls=["http://127.0.0.1:8100/v1", "http://127.0.0.1:8101/v1"]'
    cfg = load_config(BASE, args)
    assert cfg.reader.base_urls == ["http://127.0.0.1:8100/v1", "http://127.0.0.1:8101/v1"]
    assert (cfg.retrieve.alpha, cfg.retrieve.prf.enabled) == (0.5, False)
    assert cfg.data.limit_questions is None and cfg.reader.model == "Qwen/Qwen2.5-7B-Instruct"


def test_point_ids_are_readable_unique_and_use_full_keys_only_on_clashes() -> None:
    assert point_ids([{"pack.k": 5, "retrieve.alpha": 0.5}, {"pack.k": 10, "retrieve.alpha": 0.5}], [None, None]) == [
        "k=5,alpha=0.5", "k=10,alpha=0.5"]
    # two keys end in `model`: both are spelled out
    assert point_ids([{"reader.model": "org/m-1", "eval.judge.model": "j"}], [None]) == [
        "reader.model=org-m-1,eval.judge.model=j"]
    assert point_ids([{}, {"pack.k": 3}], ["paper", None]) == ["paper", "k=3"]
    assert point_ids([{}], [None]) == ["base"]
    # lists join with +
    assert point_ids([{"reader.base_urls": ["a", "b"]}], [None]) == ["base_urls=a+b"]
    with pytest.raises(SweepError, match="same overrides"):
        point_ids([{"pack.k": 3}, {"pack.k": 3}], [None, None])
    # one point is one name (or none) and its overrides however spelled; points named apart are runs of their own
    with pytest.raises(SweepError, match="same overrides \\{\"pack.k\": 3\\} \\(points 0 and 1"):
        point_ids([{"pack.k": 3}, {"pack": {"k": 3}}], ["a", "a"])
    assert point_ids([{"pack.k": 3}, {"pack.k": 3}], ["a", "b"]) == ["a", "b"]
    assert point_ids([{"pack.k": 3}, {"pack.k": 4}], ["a", "a"]) == [
        f"a-{spec_module._digest({'pack.k': 3})}", f"a-{spec_module._digest({'pack.k': 4})}"]
    with pytest.raises(SweepError, match="would share the directory base-"):
        point_ids([{}, {}], ["base", None])


def test_load_sweep_grid_then_points_fixed_and_group(tmp_path: Path) -> None:
    path = write_sweep(tmp_path, """
name: grid-test
config: BASE
fixed: {data.limit_memories: 1}
grid:
  pack.k: [5, 10]
  retrieve.alpha: [0.5, 0.7]
points:
  - {name: no-prf, retrieve.prf.enabled: false}
slurm: {partition: debug, gpus_per_task: 0, cpus_per_task: 1, mem_gb: 2, timeout_min: 5, array_parallelism: 2, max_requeue: 1}
""")
    spec = load_sweep(path)
    assert spec.name == "grid-test" and spec.config == BASE
    assert [p.point_id for p in spec.points] == [
        "k=5,alpha=0.5", "k=5,alpha=0.7", "k=10,alpha=0.5", "k=10,alpha=0.7", "no-prf"]
    assert spec.sweep_keys == ["pack.k", "retrieve.alpha", "retrieve.prf.enabled"]
    assert (spec.slurm.partition, spec.slurm.gpus_per_task, spec.slurm.max_requeue) == ("debug", 0, 1)
    out = tmp_path / "out" / "points" / "k=10,alpha=0.7"
    argv = point_command(spec, spec.points[3], out)
    assert argv[1:] == ["-m", "memfit_gpu.cli", "run", "--config", str(BASE), "--out", str(out),
                        "data.limit_memories=1", "pack.k=10", "retrieve.alpha=0.7", "tracking.wandb.group=grid-test"]
    assert find_point(spec, "4").point_id == "no-prf" and find_point(spec, "k=5,alpha=0.7") is spec.points[1]
    with pytest.raises(SweepError, match="out of range"):
        find_point(spec, "5")
    # command-line overrides join `fixed`
    spec2 = load_sweep(path, ["reader.backend=openai", 'reader.base_urls=["http://h:1/v1"]'])
    assert point_command(spec2, spec2.points[4], out)[-4:] == [
        "reader.backend=openai", 'reader.base_urls=["http://h:1/v1"]', "retrieve.prf.enabled=false",
        "tracking.wandb.group=grid-test"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("config: BASE\ngird: {pack.k: [1]}\n", "unknown key\\(s\\) \\['gird'\\]"),
        ("grid: {pack.k: [1]}\n", "missing `config:`"),
        ("config: nope.yaml\n", "config nope.yaml does not exist"),
        ("config: BASE\ngrid: {pack.k: 5}\n", "grid.pack.k must be a non-empty list"),
        ("config: BASE\ngrid: {pack.kk: [5]}\n", "point kk=5: .*pack.kk"),
        ("config: BASE\ngrid: {pack.k: [five]}\n", "point k=five: .*pack.k"),
        ("config: BASE\nslurm: {gpus: 1}\n", "unknown slurm key\\(s\\) \\['gpus'\\]"),
        # the slurm block's values were not checked: a TypeError or ValueError when the sbatch file was written
        ("config: BASE\nslurm: {mem_gb: lots}\n", "slurm.mem_gb='lots': must be a number of GB"),
        ("config: BASE\nslurm: {timeout_min: 2h}\n", "slurm.timeout_min='2h': must be a whole number"),
        ("config: BASE\nslurm: {gpus_per_task: one}\n", "slurm.gpus_per_task='one': must be a whole number"),
        ("config: BASE\nslurm: {cpus_per_task: 0}\n", "slurm.cpus_per_task=0: must be >= 1"),
        ("config: BASE\nslurm: {additional: [a]}\n", "slurm.additional=\\['a'\\]: must be a mapping of sbatch"),
        ("config: BASE\nslurm: {setup: module load x}\n", "slurm.setup='module load x': must be a list of shell"),
        ("config: BASE\ncommand: [memfit, run]\n", "command must contain \\{config\\}"),
        # a point or sweep name that would be OUT/points itself, OUT, or a folder outside runs/sweeps
        ("config: BASE\npoints: [{name: '..', pack.k: 5}]\n", "points\\[0\\].name='..': no directory name"),
        ("config: BASE\npoints: [{pack.k: 6}, {name: '.', pack.k: 5}]\n", "points\\[1\\].name='.': no directory name"),
        ("name: ../../elsewhere\nconfig: BASE\n", "name '../../elsewhere' must be one folder name"),
        ("name: /tmp/abs\nconfig: BASE\n", "name '/tmp/abs' must be one folder name"),
        ("name: '..'\nconfig: BASE\n", "name '..' must be one folder name"),
        # command parts point_command could not fill (KeyError, ValueError when the point ran)
        ("config: BASE\ncommand: [echo, '{config}', '{out}', '{oops}']\n", "command\\[3\\].*unknown placeholder \\{oops\\}"),
        ("config: BASE\ncommand: [echo, '{config}', '{out}', '{']\n", "command\\[3\\]='\\{': Single '\\{'"),
        ("config: BASE\ncommand: [echo, '{config}', '{out}', '{0}']\n", "unknown placeholder \\{0\\}"),
        # slurm values sbatch_args could not write (OverflowError) or a shell would split
        ("config: BASE\nslurm: {mem_gb: .inf}\n", "slurm.mem_gb=inf: must be a finite number"),
        ("config: BASE\nslurm: {mem_gb: .nan}\n", "slurm.mem_gb=nan: must be a finite number"),
        ("config: BASE\nslurm: {additional: {comment: my run}}\n", "slurm.additional=.*comment='my run': must be one word"),
        ("config: BASE\nslurm: {additional: {constraint: [a, b]}}\n", "constraint=\\['a', 'b'\\]: must be one word"),
        ("config: BASE\nslurm: {additional: {'my opt': x}}\n", "option 'my opt': must be one word"),
        ("config: BASE\nslurm: {partition: my part}\n", "slurm.partition='my part': must be a partition name"),
        # a fixed key the points vary was silently replaced by each point's value
        ("config: BASE\nfixed: {pack.k: 3}\ngrid: {pack.k: [5, 10]}\n", "pack.k is set by fixed: .* and by grid"),
        ("config: BASE\nfixed: {pack: {k: 3}}\ngrid: {pack.k: [5]}\n", "pack.k is set by fixed: .* and by grid"),
        # one point spelled two ways
        ("config: BASE\npoints: [{pack.k: 5}, {pack: {k: 5}}]\n", "same overrides \\{\"pack.k\": 5\\}"),
        ("config: BASE\ngrid: {pack.k: [5, 10]}\npoints: [{pack: {k: 10}}]\n", "same overrides"),
        # a key given twice: YAML keeps the last
        ("config: BASE\ngrid:\n  pack.k: [5, 10]\n  pack.k: [20]\n", r"key 'pack.k' is written twice in one mapping \(lines 3 and 4\)"),
        ("config: BASE\nconfig: BASE\n", r"key 'config' is written twice in one mapping \(lines 1 and 2\)"),
        # a grid nobody means (and nobody could check: every point's config is loaded)
        ("config: BASE\ngrid: {pack.k: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], retrieve.alpha: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, "
         "0.7, 0.8, 0.9, 1.0], pack.context_window: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], data.limit_questions: [1, 2, 3, 4, "
         "5, 6, 7, 8, 9, 10, 11]}\n", "11000 points .*at most 10000"),
    ],
)
def test_bad_sweep_files_name_the_file_and_the_field(tmp_path: Path, body: str, message: str) -> None:
    path = write_sweep(tmp_path, body)
    with pytest.raises(SweepError, match=message) as info:
        load_sweep(path)
    assert str(path) in str(info.value)


def test_a_spec_file_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    path = write_sweep(tmp_path, "")
    path.write_bytes(f"config: {BASE}\nname: ".encode() + b"\xff\xfe\n")
    with pytest.raises(SweepError, match="not UTF-8") as info:
        load_sweep(path)
    assert str(path) in str(info.value)


def test_the_point_cap_is_checked_before_any_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A million-point grid is refused at once, not after validating points for hours."""

    values = list(range(1000))
    path = write_sweep(tmp_path, f"config: BASE\ngrid: {{pack.k: {values}, retrieve.alpha: {values}}}\n")
    monkeypatch.setattr(spec_module, "load_config", lambda *a, **k: pytest.fail("a point was checked"))
    with pytest.raises(SweepError, match="1000000 points"):
        load_sweep(path)


def test_yaml_merge_keys_are_no_duplicates_and_names_that_only_look_like_dots_are_kept(tmp_path: Path) -> None:
    path = write_sweep(tmp_path, """
config: BASE
points:
  - &a {name: '...x', pack.k: 5}
  - {<<: *a, name: y, pack.k: 6}
command: ["{python}", "{{literal}}", "--config", "{config}", "--out", "{out}"]
""")
    spec = load_sweep(path)
    assert [p.point_id for p in spec.points] == ["...x", "y"]
    assert point_command(spec, spec.points[0], tmp_path / "o")[1] == "{literal}"


def test_a_command_line_override_of_a_key_the_sweep_varies_is_refused(tmp_path: Path) -> None:
    path = write_sweep(tmp_path, "config: BASE\ngrid: {pack.k: [5, 10]}\n")
    with pytest.raises(SweepError, match="pack.k is set by fixed: \\(or a command-line override\\) and by grid"):
        load_sweep(path, ["pack.k=3"])
    assert memfit_main(["sweep", "--config", str(path), "--count", "pack.k=3"]) == 2
    assert len(load_sweep(path, ["retrieve.alpha=0.3"]).points) == 2
    # fixed: is the default of the explicit points that do not set the key themselves
    mixed = write_sweep(tmp_path, "name: mixed\nconfig: BASE\nfixed: {pack.k: 3}\npoints: [{pack.k: 5}, {retrieve.alpha: 0.3}]\n")
    spec = load_sweep(mixed)
    assert [load_config(spec.config, point_overrides(spec.name, spec.fixed, p)).pack.k for p in spec.points] == [5, 3]


def test_sbatch_args_are_single_words(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_sweep(tmp_path, "config: BASE\nslurm: {gpus_per_task: 0, additional: {account: abc, nice: 10}}\n")
    assert memfit_main(["sweep", "--config", str(path), "--sbatch-args"]) == 0
    words = capsys.readouterr().out.split()
    assert "--account=abc" in words and "--nice=10" in words


@pytest.mark.parametrize("poll", ["-1", "0", "nan", "inf", "soon"])
def test_poll_seconds_are_checked_before_any_point_starts(tmp_path: Path, poll: str,
                                                          capsys: pytest.CaptureFixture) -> None:
    path = write_sweep(tmp_path, "config: BASE\n")
    with pytest.raises(SystemExit) as info:
        memfit_main(["sweep", "--config", str(path), "--out", str(tmp_path / "out"), f"--poll-s={poll}"])
    assert info.value.code == 2 and "--poll-s" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_commands_a_shell_reads_back(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:

    path = write_sweep(tmp_path, "name: dry\nconfig: BASE\ngrid: {pack.k: [5]}\n")
    out = tmp_path / "my out"
    override = "reader.model=org/a model's \"name\""
    assert memfit_main(["sweep", "--config", str(path), "--out", str(out), "--dry-run", override]) == 0
    spec = load_sweep(path, [override])
    want = point_command(spec, spec.points[0], out.resolve() / "points" / "k=5")
    assert shlex.split(capsys.readouterr().out.strip()) == want


def test_a_finished_point_whose_configuration_changed_is_refused(tmp_path: Path, shared_data: Path) -> None:
    """A re-run with another override used to report the finished point DONE and record, in sweep.json,
    arguments its results never ran with; like `memfit run`, the sweep refuses, naming the point and key."""

    path = write_sweep(tmp_path, "name: stale\nconfig: BASE\ngrid: {pack.k: [5]}\n")
    data = f"data.path={shared_data / 'locomo'}"
    spec = load_sweep(path, [data, "reader.max_new_tokens=64"])
    out = tmp_path / "out"
    point_dir = out / "points" / "k=5"
    point_dir.mkdir(parents=True)
    # what `memfit run` leaves in a finished point's directory
    (point_dir / "config.yaml").write_text(to_yaml(load_config(BASE, point_overrides(spec.name, spec.fixed,
                                                                                       spec.points[0]))))
    (point_dir / "DONE").write_text("")
    # the same configuration: skipped, nothing run
    state = run_sweep(spec, out, same_config=same_config)
    assert state.points["k=5"].state is PointState.DONE
    recorded = (out / "sweep.json").read_text()
    changed = load_sweep(path, [data, "reader.max_new_tokens=32"])
    with pytest.raises(SweepError, match="point k=5 is DONE with another configuration.*reader.max_new_tokens"):
        run_sweep(changed, out, same_config=same_config)
    assert (out / "sweep.json").read_text() == recorded  # the arguments it never ran are not recorded
    with pytest.raises(SweepError, match="point k=5 is DONE with another configuration"):
        run_point(changed, out, "0", same_config=same_config)
    assert run_point(spec, out, "0", same_config=same_config) == 0


def test_a_point_added_to_the_sweep_file_is_listed_by_its_sbatch_task(tmp_path: Path, shared_data: Path) -> None:
    """`memfit sweep --point` (one SLURM array task per point) wrote sweep.json only when it was missing, so a
    sweep file extended by a point and submitted again ran the new point, and `memfit aggregate` (which lists
    what sweep.json holds) left it out without a word."""
    data = f"data.path={shared_data / 'locomo'}"
    first = load_sweep(write_sweep(tmp_path, "name: grow\nconfig: BASE\ngrid: {pack.k: [5]}\n"), [data])
    out = tmp_path / "out"
    for point_id in ("k=5", "k=10"):  # finished: the tasks return at once
        (out / "points" / point_id).mkdir(parents=True)
        (out / "points" / point_id / "DONE").write_text("")
    assert run_point(first, out, "0") == 0
    assert [p.point_id for p in read_sweep_record(out / "sweep.json").points] == ["k=5"]
    grown = load_sweep(write_sweep(tmp_path, "name: grow\nconfig: BASE\ngrid: {pack.k: [5, 10]}\n"), [data])
    assert run_point(grown, out, "1") == 0
    assert [p.point_id for p in read_sweep_record(out / "sweep.json").points] == ["k=5", "k=10"]
    assert run_point(grown, out, "0") == 0  # a point sweep.json lists leaves it as it is
    assert [p.point_id for p in read_sweep_record(out / "sweep.json").points] == ["k=5", "k=10"]


def _point(sweep_dir: Path, point_id: str, metrics: dict | None, predictions: list[dict] | None, done: bool) -> None:
    point_dir = sweep_dir / "points" / point_id
    point_dir.mkdir(parents=True)
    if metrics is not None:
        (point_dir / "metrics.json").write_text(json.dumps(metrics))
    if predictions is not None:
        (point_dir / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in predictions))
    if done:
        (point_dir / "DONE").write_text("")


def test_aggregate_table_from_metrics_and_predictions(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sweep_dir = tmp_path / "sw"
    sweep_dir.mkdir()
    points = [{"id": "k=5", "overrides": {"pack.k": 5}, "dir": str(sweep_dir / "points" / "k=5"), "state": "done"},
              {"id": "k=10", "overrides": {"pack.k": 10}, "dir": str(sweep_dir / "points" / "k=10"), "state": "done"},
              {"id": "k=20", "overrides": {"pack.k": 20}, "dir": str(sweep_dir / "points" / "k=20"),
               "state": "failed"}]
    (sweep_dir / "sweep.json").write_text(json.dumps({"name": "t", "sweep_keys": ["pack.k"], "points": points}))
    # k=5: judge and pack_hit in metrics.json; k=10: no judge, pack_hit from predictions (2 of 3 evaluated hit)
    _point(sweep_dir, "k=5", {"questions": 4, "metric_variant": "paper",
                              "average": {"paper": {"f1": 0.25, "bleu1": 0.125}, "judge": 0.5},
                              "retrieval": {"overall": {"pack_hit": 0.75, "mrr": 0.5}}}, None, True)
    _point(sweep_dir, "k=10", {"questions": 3, "metric_variant": "locomo",
                               "average": {"paper": {"f1": 0.9, "bleu1": 0.9}, "locomo": {"f1": 0.5, "bleu1": 0.375},
                                           "judge": None},
                               "overall": {"judge": None}},
           [{"question_id": "a", "evaluated": True, "retrieval": {"pack_hit": True}},
            {"question_id": "b", "evaluated": True, "retrieval": {"pack_hit": False}},
            {"question_id": "c", "evaluated": False, "retrieval": {"pack_hit": False}},
            {"question_id": "d", "evaluated": True, "retrieval": {"pack_hit": True}}], True)
    _point(sweep_dir, "k=20", None, None, False)

    columns, rows = aggregate(sweep_dir)
    assert columns == ["point", "pack.k", "status", "metric", "f1", "bleu1", "judge", "pack_hit", "questions"]
    assert rows[1]["pack_hit"] == pytest.approx(2 / 3)
    expected_md = (
        "| point   | pack.k   | status   | metric   |   f1 % |   bleu1 % |   judge % |   pack_hit % |   questions |\n"
        "|:--------|:---------|:---------|:---------|-------:|----------:|----------:|-------------:|------------:|\n"
        "| k=5     | 5        | done     | paper    |  25.00 |     12.50 |     50.00 |        75.00 |           4 |\n"
        "| k=10    | 10       | done     | locomo   |  50.00 |     37.50 |           |        66.67 |           3 |\n"
        "| k=20    | 20       | failed   |          |        |           |           |              |             |\n"
    )
    assert to_markdown(columns, rows) == expected_md
    assert to_csv(columns, rows).splitlines()[1] == "k=5,5,done,paper,0.25,0.125,0.5,0.75,4"

    # the CLI prints the same table and writes both files; below it, what it could not compare (provenance)
    assert memfit_main(["aggregate", str(sweep_dir)]) == 0
    note = ("\nnote: no provenance.json in k=5, k=10 (made before memfit recorded provenance): provenance not "
            "compared\n")
    assert capsys.readouterr().out == expected_md + note
    assert (sweep_dir / "aggregate.md").read_text() == expected_md + note
    assert (sweep_dir / "aggregate.csv").read_text() == to_csv(columns, rows)


def test_predictions_of_every_point_load_as_one_dataset(tmp_path: Path) -> None:
    """`datasets` earns its place: a sweep's predictions as one Arrow table (point and sweep keys as columns,
    nested fields flattened, a mixed-type gold column as text), written to Parquet and read back. Finished
    points only: a point still appending (its torn last line left on disk for its writer) or failed held some
    of its predictions, which went into the table with nothing to tell them apart."""
    sweep_dir = tmp_path / "sw"
    sweep_dir.mkdir()
    points = [{"id": f"k={k}", "overrides": {"pack.k": k}, "dir": str(sweep_dir / "points" / f"k={k}"),
               "state": "done"} for k in (5, 10, 20)]
    (sweep_dir / "sweep.json").write_text(json.dumps({"name": "t", "sweep_keys": ["pack.k"], "points": points}))
    _point(sweep_dir, "k=5", None, [
        {"question_id": "a", "gold": "7 May 2023", "scores": {"paper": {"f1": 0.5}}, "judge": None},
        {"question_id": "b", "gold": 2022, "scores": {"paper": {"f1": 1.0}}, "judge": {"verdict": True}}], True)
    _point(sweep_dir, "k=10", None, [{"question_id": "a", "gold": "7 May 2023", "scores": {"paper": {"f1": 0.0}},
                                      "judge": None}], False)
    _point(sweep_dir, "k=20", None, [{"question_id": "a", "gold": 7, "scores": {"paper": {"f1": 0.25}},
                                      "judge": None}], True)
    torn = sweep_dir / "points" / "k=10" / "predictions.jsonl"
    with torn.open("a") as handle:
        handle.write('{"question_id": "b", "go')
    size = torn.stat().st_size
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "sweep.json").write_text(json.dumps({"name": "e", "sweep_keys": ["pack.k"], "points": [
        {"id": "k=5", "overrides": {"pack.k": 5}, "dir": str(empty / "points" / "k=5"), "state": "pending"}]}))
    with pytest.raises(SweepError, match=r"no point has finished yet \(DONE\)"):
        predictions_dataset(empty)
    for damaged in ({"name": "e", "sweep_keys": []}, {"name": "e", "sweep_keys": [], "points": []}):
        (empty / "sweep.json").write_text(json.dumps(damaged))  # every sweep has points: none is damage
        with pytest.raises(SweepError, match=r"sweep\.json: field 'points' (missing|is empty)"):
            predictions_dataset(empty)
    table = predictions_dataset(sweep_dir)
    assert table.num_rows == 3 and torn.stat().st_size == size
    assert table["point"] == ["k=5", "k=5", "k=20"] and table["sweep.pack.k"] == [5, 5, 20]
    assert table["gold"] == ["7 May 2023", "2022", "7"]
    assert table["scores.paper.f1"] == [0.5, 1.0, 0.25] and table["judge.verdict"] == [None, True, None]
    table.to_parquet(tmp_path / "p.parquet")
    back = datasets.load_dataset("parquet", data_files=str(tmp_path / "p.parquet"), split="train",
                                 cache_dir=str(tmp_path / "hf"))
    assert back.to_list() == table.to_list()
    assert memfit_main(["aggregate", str(sweep_dir), "--parquet", str(tmp_path / "cli.parquet")]) == 0
    assert datasets.Dataset.from_parquet(str(tmp_path / "cli.parquet"),
                                         cache_dir=str(tmp_path / "hf")).to_list() == table.to_list()


@pytest.mark.parametrize(("damage", "field"), [
    # a text "n/a" was printed in the f1 % column, "0.5" as 0.5 where 50.00 is meant; --by seed raised
    ({"average": {"paper": {"f1": "n/a", "bleu1": 0.5}}}, "average.paper.f1"),
    ({"average": {"paper": {"f1": "0.5", "bleu1": 0.5}}}, "average.paper.f1"),
    ({"average": {"paper": {"f1": 0.5, "bleu1": 0.5}, "judge": True}}, "average.judge"),
    ({"retrieval": {"overall": {"pack_hit": float("nan")}}}, "retrieval.overall.pack_hit"),
    ({"questions": "4"}, "questions"),
    ({"by_category": {"1": {"paper": {"f1": [0.5]}}}}, "by_category.1.paper.f1"),
])
def test_aggregate_refuses_a_metrics_value_that_is_no_number(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                             damage: dict, field: str) -> None:
    sweep_dir = tmp_path / "sw"
    sweep_dir.mkdir()
    points = [{"id": f"seed={seed}", "overrides": {"reader.seed": seed}, "dir": str(sweep_dir / "points" / f"seed={seed}"),
               "state": "done"} for seed in (0, 1)]
    (sweep_dir / "sweep.json").write_text(json.dumps({"name": "t", "sweep_keys": ["reader.seed"], "points": points}))
    sound = {"questions": 4, "metric_variant": "paper", "average": {"paper": {"f1": 0.25, "bleu1": 0.125}}}
    _point(sweep_dir, "seed=0", sound, None, True)
    _point(sweep_dir, "seed=1", {**sound, **damage}, None, True)
    said = f"{sweep_dir / 'points' / 'seed=1' / 'metrics.json'}, field {field!r}: "
    for command in (["aggregate", str(sweep_dir)], ["aggregate", str(sweep_dir), "--by", "seed"]):
        if (field.startswith("by_category") and "--by" not in command) or (field == "questions" and "--by" in command):
            continue  # the table of points shows no category; --by summarises no question count
        assert memfit_main(command) == 2, command
        err = capsys.readouterr().err
        assert said in err and "is not a finite number" in err, (command, err)


def test_aggregate_refuses_a_directory_without_sweep_json(tmp_path: Path) -> None:
    with pytest.raises(SweepError, match="no sweep.json"):
        aggregate(tmp_path)
    assert memfit_main(["aggregate", str(tmp_path)]) == 2


class FrozenClock:
    """A monotonic clock that moves only when the test says so (the watcher's settle time)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _running_state(tmp_path: Path) -> tuple[SweepState, object]:
    spec = load_sweep(write_sweep(tmp_path, "name: settle\nconfig: BASE\npoints:\n  - {pack.k: 5}\n"))
    (tmp_path / "out").mkdir()
    state = SweepState(spec, tmp_path / "out", "slurm")
    point = spec.points[0]
    record = state.points[point.point_id]
    record.state, record.attempts = PointState.RUNNING, 1
    record.jobs = [JobRecord("7_0", "RUNNING", 1, "log", None)]
    return state, point


def _write_result(state: SweepState, task_id: str, outcome: tuple[str, str]) -> None:
    """The result file submitit's task runner leaves when the submitted function returned or raised."""
    import pickle

    import submitit

    path = submitit.SlurmJob(folder=slurm.submitit_folder(state), job_id=task_id).paths.result_pickle
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(outcome))


def test_a_task_showing_failed_on_its_way_back_to_pending_is_not_resubmitted(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """SLURM shows a task requeued on its preemption signal as FAILED for a moment: the sweep waits for
    the state to settle instead of starting the point a second time beside the requeued task."""
    state, point = _running_state(tmp_path)
    record = state.points[point.point_id]
    script = iter(["FAILED", "REQUEUED", "PENDING", "RUNNING", "COMPLETED"])

    def squeue(task_ids: list[str]) -> dict[str, str]:
        now = next(script)  # StopIteration here: the sweep kept polling a task that had ended
        if now == "COMPLETED":
            state.point_dir(point).mkdir(parents=True, exist_ok=True)
            (state.point_dir(point) / "DONE").write_text("")
        return {"7_0": now}

    def resubmit(*args: object) -> None:
        raise AssertionError("the point was submitted a second time")

    monkeypatch.setattr(watch, "squeue_states", squeue)
    monkeypatch.setattr(slurm, "submit_slurm", resubmit)
    watcher = watch.TaskWatcher(slurm.submitit_folder(state), clock=FrozenClock())
    slurm.wait_slurm(state, poll_s=0.0, retries=2, starts={point.point_id: 1}, watcher=watcher)
    assert record.state is PointState.DONE and [j.job_id for j in record.jobs] == ["7_0"]
    assert record.jobs[0].state == "COMPLETED"


def test_an_array_sbatch_refuses_is_one_sweep_error_with_its_reason(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """sbatch refusing the array (GPUs asked on a partition without any) gave submitit's FailedJobError as
    a traceback. The refusal is provoked here at the executor: no SLURM controller refuses on demand."""
    from submitit.core.utils import FailedJobError

    state, point = _running_state(tmp_path)

    class Refusing:
        def map_array(self, *args: object) -> None:
            raise FailedJobError("sbatch: error: Batch job submission failed: Requested node configuration is "
                                 "not available\n")

    monkeypatch.setattr(slurm, "slurm_executor", lambda *args: Refusing())
    with pytest.raises(SweepError, match=r"sbatch refused the job array of 1 point\(s\): sbatch: error: Batch job "
                                         r"submission failed: Requested node configuration is not available$"):
        slurm.submit_slurm(state, [point], 0)
    assert state.points[point.point_id].attempts == 1  # nothing recorded as submitted


def test_a_task_whose_function_ended_is_resubmitted_without_waiting_to_settle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """submitit's result file says the task's function returned or raised, so no requeue follows: the
    first poll that shows the task ended resubmits the point (the clock never moves here), and the log
    names what the task raised."""
    state, point = _running_state(tmp_path)
    record = state.points[point.point_id]
    _write_result(state, "7_0", ("error", "Traceback (most recent call last):\n  ...\n"
                                          "RuntimeError: point k=5: `memfit run` exited with code -15\n"))
    polls: list[list[str]] = []

    def squeue(task_ids: list[str]) -> dict[str, str]:
        polls.append(list(task_ids))
        assert len(polls) <= 3, f"the ended task was not resubmitted: polls {polls}"
        if task_ids == ["8_0"]:  # the resubmitted task finishes the point
            state.point_dir(point).mkdir(parents=True, exist_ok=True)
            (state.point_dir(point) / "DONE").write_text("")
            return {"8_0": "COMPLETED"}
        return {"7_0": "CANCELLED"}

    def resubmit(sweep_state: SweepState, todo: list, retries: int) -> list[str]:
        assert [p.point_id for p in todo] == ["k=5"] and retries == 2
        again = sweep_state.points["k=5"]
        again.attempts += 1
        again.state = PointState.RUNNING
        again.jobs.append(JobRecord("8_0", "PENDING", again.attempts, "log2", None))
        return ["8_0"]

    monkeypatch.setattr(watch, "squeue_states", squeue)
    monkeypatch.setattr(slurm, "submit_slurm", resubmit)
    watcher = watch.TaskWatcher(slurm.submitit_folder(state), clock=FrozenClock())
    with caplog.at_level("WARNING", logger="memfit_gpu.sweep.state"):
        slurm.wait_slurm(state, poll_s=0.0, retries=2, starts={point.point_id: 1}, watcher=watcher)
    assert polls == [["7_0"], ["8_0"]]
    assert [(j.job_id, j.state) for j in record.jobs] == [("7_0", "CANCELLED"), ("8_0", "COMPLETED")]
    assert record.state is PointState.DONE and record.attempts == 2
    assert "task 7_0 CANCELLED: RuntimeError: point k=5: `memfit run` exited with code -15" in caplog.text


def test_watcher_settles_an_end_without_a_result_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FrozenClock()
    listing = {"3_0": "FAILED", "3_1": "RUNNING", "3_2": "COMPLETED"}
    monkeypatch.setattr(watch, "squeue_states", lambda ids: {i: listing[i] for i in ids if i in listing})
    folder = tmp_path / "slurm" / "%j"
    watcher = watch.TaskWatcher(folder, settle_s=10.0, clock=clock)
    last = {"3_0": "RUNNING", "3_1": "PENDING", "3_2": "RUNNING", "3_3": "RUNNING", "3_4": "FAILED"}
    views = watcher.poll(last)
    assert views["3_1"] == watch.TaskView("RUNNING", active=True, ended=False)
    assert views["3_0"] == watch.TaskView("FAILED", active=False, ended=False)  # may be on its way back
    assert views["3_3"] == watch.TaskView(watch.FORGOTTEN, active=False, ended=False)  # purged by squeue
    assert views["3_4"] == watch.TaskView("FAILED", active=False, ended=False)  # ended before: kept state
    clock.now += 9.5
    assert not watcher.poll(last)["3_0"].ended
    clock.now += 0.5
    assert watcher.poll(last)["3_0"].ended
    # a live state in between starts the settle time again
    listing["3_0"] = "PENDING"
    assert watcher.poll(last)["3_0"].active
    listing["3_0"] = "FAILED"
    assert not watcher.poll(last)["3_0"].ended
    # stopped or held tasks go on once continued or released: never resubmitted beside themselves
    for waiting in ("STOPPED", "SPECIAL_EXIT", "RESV_DEL_HOLD"):
        listing["3_0"] = waiting
        clock.now += 60.0
        assert watcher.poll(last)["3_0"] == watch.TaskView(waiting, active=True, ended=False), waiting


def test_squeue_states_prefer_a_live_record_of_a_task_listed_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    listing = "5_0 PENDING\n5_1 FAILED\n5_1 PENDING\n5_2 RUNNING\n5_2 FAILED\n"
    monkeypatch.setattr(watch.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, listing, ""))
    assert watch.squeue_states(["5_0", "5_1", "5_2", "5_3"]) == {"5_0": "PENDING", "5_1": "PENDING",
                                                                 "5_2": "RUNNING"}


def test_sweep_json_round_trips_typed_records(tmp_path: Path) -> None:
    """sweep.json keeps its layout (a local start has no status file, a SLURM one does); a later command
    reads back attempts, jobs and states, and a state outside PointState is an error naming the point."""
    state, point = _running_state(tmp_path)
    record = state.points[point.point_id]
    record.jobs.append(JobRecord("local:41", "FAILED(rc=1)", 2, "log2"))
    record.state = PointState.FAILED
    state.save()
    saved = json.loads(state.path.read_text())
    assert list(saved["points"][0]) == ["id", "overrides", "dir", "args", "attempts", "jobs", "state"]
    assert saved["points"][0]["jobs"] == [
        {"job_id": "7_0", "state": "RUNNING", "attempt": 1, "log": "log", "status": None},
        {"job_id": "local:41", "state": "FAILED(rc=1)", "attempt": 2, "log": "log2"}]
    assert (saved["points"][0]["state"], saved["state"]) == ("failed", "incomplete")
    again = SweepState(state.spec, state.out_dir, "local").points["k=5"]
    assert again == record
    saved["points"][0]["state"] = "finished"
    state.path.write_text(json.dumps(saved))
    with pytest.raises(SweepError, match=r"sweep.json: points\[0\] \(point k=5\): state 'finished' is not one of"):
        read_sweep_record(state.path)
    del saved["points"][0]["jobs"][1]["job_id"]
    saved["points"][0]["state"] = "failed"
    state.path.write_text(json.dumps(saved))
    with pytest.raises(SweepError, match=r"points\[0\] \(point k=5\) jobs\[1\]: field 'job_id' missing"):
        SweepState(state.spec, state.out_dir, "local")


def test_each_subcommand_module_registers_only_its_own_parser() -> None:
    """`memfit sweep` and `memfit aggregate` each have one module that adds exactly that subcommand."""
    import argparse
    import importlib

    from memfit_gpu.cli import SUBCOMMANDS

    for name in ("sweep", "aggregate"):
        subparsers = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(SUBCOMMANDS[name]).register(subparsers)
        assert list(subparsers.choices) == [name]


def test_points_get_the_data_location_explicitly(tmp_path: Path, shared_data: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A config that leaves data.path to the environment gets the location found by the sweep itself
    pinned into every point: tasks on other nodes or with another environment read the same files."""
    path = write_sweep(tmp_path, "name: pin\nconfig: BASE\ngrid: {pack.k: [5, 10]}\n")
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    pinned = pin_data_location(load_sweep(path))
    want = f"data.path={(shared_data / 'locomo' / 'locomo10.json').resolve()}"
    for point in pinned.points:
        assert want in point_command(pinned, point, tmp_path / point.point_id)
    # a config that names its data keeps it
    explicit = load_sweep(path, [f"data.path={shared_data / 'locomo'}"])
    assert pin_data_location(explicit).fixed == explicit.fixed
    # no data anywhere: the sweep stops before anything is submitted, saying where it looked
    monkeypatch.delenv("MEMFIT_DATA_DIR")
    with pytest.raises(SweepError, match=r"point k=5: no locomo data found \(looked in cache .*empty-cache"):
        pin_data_location(load_sweep(path))


def test_a_start_refused_because_another_process_runs_the_point_is_busy_not_an_error(tmp_path: Path) -> None:
    """`memfit run` exits 2 when the point's directory is locked by a run still going (e.g. a duplicate
    SLURM task): that is not the point's configuration error, and it must not be marked as one."""
    from memfit_gpu.locks import exclusive, lock_path

    point_dir = tmp_path / "points" / "k=5"
    point_dir.mkdir(parents=True)
    with exclusive(lock_path(point_dir), "test"):
        assert state_after_stop("k=5", "exit code 2", 2, 1, 0, "log", point_dir) is PointState.BUSY
    # once nobody holds it, exit code 2 is the point's own error again
    assert state_after_stop("k=5", "exit code 2", 2, 1, 0, "log", point_dir) is PointState.ERROR
    assert state_after_stop("k=5", "exit code 1", 1, 1, 1, "log", point_dir) is PointState.RETRY
    assert state_after_stop("k=5", "exit code 1", 1, 2, 1, "log", point_dir) is PointState.FAILED


def test_a_slurm_task_lets_its_run_wait_for_the_task_it_replaces(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The point's command gets MEMFIT_LOCK_WAIT_S (a requeued task may start before its predecessor is
    dead); a value the user set is kept; the exit code goes to the status file."""
    point_dir, status = tmp_path / "p", tmp_path / "status.json"
    point_dir.mkdir()
    argv = [sys.executable, "-c", "import os, pathlib, sys; "
            f"pathlib.Path({str(point_dir / 'DONE')!r}).write_text(os.environ['MEMFIT_LOCK_WAIT_S'])"]
    monkeypatch.delenv("MEMFIT_LOCK_WAIT_S", raising=False)
    assert slurm.PointTask()(argv, str(point_dir), str(status)) == str(point_dir)
    assert (point_dir / "DONE").read_text() == str(slurm.TASK_LOCK_WAIT_S) == "300"
    assert json.loads(status.read_text())["rc"] == 0
    monkeypatch.setenv("MEMFIT_LOCK_WAIT_S", "12")
    slurm.PointTask()(argv, str(point_dir), str(status))
    assert (point_dir / "DONE").read_text() == "12"


@pytest.mark.slow
def _one_point_sweep(tmp_path: Path, name: str, script: str) -> Path:
    """A sweep file of one point (pack.k=5) whose command is `python -c script CONFIG OUT`: a stand-in for
    `memfit run` that tests of the driver control."""
    return write_sweep(tmp_path, f"""
name: {name}
config: BASE
grid: {{pack.k: [5]}}
command: ["{{python}}", "-c", {json.dumps(script)}, "{{config}}", "{{out}}"]
""")


def test_a_killed_local_sweep_takes_its_points_with_it_and_the_next_start_corrects_the_record(
        tmp_path: Path, shared_data: Path) -> None:
    """A SIGKILLed local sweep used to leave its point's `memfit run` running unsupervised (ppid 1) and
    sweep.json saying RUNNING. The child dies with the driver; the next start records it as stopped.
    (The points' command stands in for `memfit run`: it sleeps on its first start, finishes on the next.)"""
    import os
    import signal
    import subprocess
    import time

    script = ("import pathlib, sys, time; out = pathlib.Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True); "
              "started = out / 'started'\n"
              "if started.exists(): (out / 'DONE').write_text('done')\n"
              "else: started.write_text('1'); time.sleep(120)")
    path = _one_point_sweep(tmp_path, "orphans", script)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "memfit_gpu.cli", "sweep", "--config", str(path), "--launcher", "local",
               "--out", str(out)]
    env = memfit_env(shared_data)
    driver = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    child_pid = None
    deadline = time.monotonic() + 120
    while child_pid is None and time.monotonic() < deadline:
        time.sleep(0.1)
        if (out / "points" / "k=5" / "started").exists():
            record = json.loads((out / "sweep.json").read_text())["points"][0]
            child_pid = int(record["jobs"][0]["job_id"].removeprefix("local:"))
    assert child_pid is not None, driver.stderr.read().decode() if driver.poll() is not None else "no start"
    driver.kill()
    driver.wait()

    def alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        return state not in ("Z", "X")  # a zombie nobody reaps is dead all the same

    deadline = time.monotonic() + 10
    while alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(child_pid):
        os.kill(child_pid, signal.SIGKILL)
        pytest.fail("the point's process outlived its SIGKILLed sweep")
    assert json.loads((out / "sweep.json").read_text())["points"][0]["state"] == "running"  # as the driver left it
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    record = json.loads((out / "sweep.json").read_text())["points"][0]
    assert record["state"] == "done"
    assert [job["state"] for job in record["jobs"]] == ["CANCELLED", "COMPLETED"]


def test_a_local_sweep_killed_at_each_save_of_its_record_finishes_every_point_once(tmp_path: Path,
                                                                                    shared_data: Path) -> None:
    """`memfit sweep --launcher local` SIGKILLed right after each write of sweep.json, then the same command: the
    point DONE and recorded done, not started again when it was DONE before the kill, else once more (a point
    killed with its driver resumes). The point's command stands in for `memfit run`."""
    import signal
    import subprocess

    from memfit_gpu.faults import parse_trace

    script = ("import pathlib, sys; out = pathlib.Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)\n"
              "with open(out.parent.parent / 'starts.log', 'a') as f: f.write(out.name + '\\n')\n"
              "(out / 'DONE').write_text('done')")
    path = _one_point_sweep(tmp_path, "killed", script)

    def sweep(out: Path, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "memfit_gpu.cli", "sweep", "--config", str(path), "--launcher",
                               "local", "--out", str(out)], env=memfit_env(shared_data, **extra),
                              capture_output=True, text=True, timeout=300)

    trace = tmp_path / "sweep.trace"
    assert sweep(tmp_path / "reference", MEMFIT_FAULT_TRACE=str(trace)).returncode == 0
    saves = [name for name, _ in parse_trace(trace)]
    assert set(saves) == {"sweep.state"} and len(saves) >= 4, saves  # the start, the point's start and end, the end
    for n in range(1, len(saves) + 1):
        out = tmp_path / f"killed-{n}"
        killed = sweep(out, MEMFIT_FAULT=f"sweep.state:{n}")
        assert killed.returncode == -signal.SIGKILL, (n, killed.stderr[-2000:])
        done_before = {p.parent.name for p in (out / "points").glob("*/DONE")}
        started_before = (out / "starts.log").read_text().split() if (out / "starts.log").exists() else []
        again = sweep(out)
        assert again.returncode == 0, (n, again.stderr[-2000:])
        record = json.loads((out / "sweep.json").read_text())
        assert record["state"] == "done" and [p["state"] for p in record["points"]] == ["done"], n
        starts = (out / "starts.log").read_text().split()
        assert starts == started_before + ([] if done_before else ["k=5"]), (n, started_before, starts)


def test_a_text_value_reaches_its_point_as_the_same_text() -> None:
    """`reader.model: "1.10"` and `eval.judge.model: "on"` in a sweep file ran as '1.1' and 'True': the override
    wrote the text unquoted and the point's dot-list read it back as YAML. A command-line value is read as
    `memfit run key=value` reads it."""
    assert override_arg("reader.model", "1.10") == 'reader.model="1.10"'
    assert override_arg("reader.model", "Qwen/Qwen2.5-7B-Instruct") == "reader.model=Qwen/Qwen2.5-7B-Instruct"
    cfg = load_config(BASE, [override_arg("reader.model", "1.10"), override_arg("eval.judge.model", "on"),
                             override_arg("tracking.wandb.group", "a: b # c")])
    assert (cfg.reader.model, cfg.eval.judge.model, cfg.tracking.wandb.group) == ("1.10", "on", "a: b # c")


def test_a_command_line_override_a_point_also_sets_is_refused(tmp_path: Path) -> None:
    """`memfit sweep ... pack.k=3` is "an override every point gets", but a point of the file that set pack.k kept
    its own 7: the override held at some points only."""
    path = write_sweep(tmp_path, "name: s\nconfig: BASE\npoints:\n  - {name: a, retrieve.alpha: 0.3}\n"
                                 "  - {name: b, pack.k: 7}\n")
    assert load_sweep(path, ["pack.context_window=0"]).fixed == {"pack.context_window": 0}  # typed, as `memfit run` reads it
    with pytest.raises(SweepError, match=r"the command-line override pack.k is also set by points\[1\]"):
        load_sweep(path, ["pack.context_window=0", "pack.k=3"])
    with pytest.raises(SweepError, match=r"override 'eval.metrics=\[f1': its value is not read as YAML"):
        load_sweep(path, ["eval.metrics=[f1"])  # a traceback once the value was read as `memfit run` reads it
    # a fixed: key of the file stays the default of the points that do not set it (documented)
    fixed = write_sweep(tmp_path, "name: s\nconfig: BASE\nfixed: {pack.k: 3}\npoints:\n  - {name: b, pack.k: 7}\n")
    assert load_sweep(fixed).points[0].overrides == {"pack.k": 7}


def test_points_of_several_beam_splits_get_the_folder_holding_them(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """BEAM's splits lie in folders of their own: the splits sweep stopped at once with "points read different
    benchmarks". The points now get the folder holding them, where each point's split finds its own files."""
    data = tmp_path / "data"
    for split in ("100K", "500K"):
        (data / "beam" / split / "1").mkdir(parents=True)
        (data / "beam" / split / "1" / "chat.json").write_text("[]")
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(data))
    path = write_sweep(tmp_path, f"name: s\nconfig: {REPO / 'configs' / 'demo_beam.yaml'}\n"
                                 "grid: {data.split: [100K, 500K]}\n")
    pinned = pin_data_location(load_sweep(path))
    assert pinned.fixed["data.path"] == str((data / "beam").resolve())
    for point in pinned.points:
        cfg = load_config(pinned.config, point_overrides(pinned.name, pinned.fixed, point))
        assert resolve_data_path("beam", cfg.data.path, cfg.data.split) == [
            (data / "beam" / cfg.data.split / "1" / "chat.json").resolve()]


def test_a_point_task_warned_by_submitit_lets_its_run_keep_working(tmp_path: Path) -> None:
    """submitit's USR2 handler requeues the job and raises SystemExit in the task; subprocess.run then killed
    the point's `memfit run` at once (SIGKILL: no kill point reached, its last minutes of work lost), though
    the comment said it keeps working until SLURM's own kill. The task now waits for its command."""
    marks = tmp_path / "marks"
    child = f"import time; open({str(marks)!r}, 'a').write('alive 0\\n'); time.sleep(1.5); " \
            f"open({str(marks)!r}, 'a').write('alive 1\\n')"
    task = (f"import signal, sys\nfrom memfit_gpu.sweep.slurm import PointTask\n"
            "def requeue(signum, frame):  # what submitit's handler does once it has requeued the job\n"
            "    sys.exit(-1)\n"
            "signal.signal(signal.SIGUSR2, requeue)\n"
            f"PointTask()([sys.executable, '-c', {child!r}], {str(tmp_path)!r})\n")
    proc = subprocess.Popen([sys.executable, "-c", task], env=memfit_env())
    deadline = time.monotonic() + 60
    while not (marks.exists() and "alive 0" in marks.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "the point's command never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)
    assert proc.wait(timeout=60) != 0  # the task itself exits (requeued), after its command
    assert marks.read_text() == "alive 0\nalive 1\n"


def test_a_preempted_task_with_an_earlier_attempt_s_result_file_settles_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SLURM requeues a preempted task (--requeue) under the same id; the result file its first attempt left
    made the first poll that showed PREEMPTED count it as over, and the sweep resubmitted the point while SLURM
    ran it again. Such an end settles first; a task whose function ended otherwise (CANCELLED, FAILED) does
    not wait."""
    state, _ = _running_state(tmp_path)
    _write_result(state, "7_0", ("error", "RuntimeError: point k=5: `memfit run` exited with code -15\n"))
    _write_result(state, "7_1", ("error", "RuntimeError: point k=10: `memfit run` exited with code 2\n"))
    listing = {"7_0": "PREEMPTED", "7_1": "FAILED"}
    monkeypatch.setattr(watch, "squeue_states", lambda ids: {i: listing[i] for i in ids if i in listing})
    clock = FrozenClock()
    watcher = watch.TaskWatcher(slurm.submitit_folder(state), settle_s=10.0, clock=clock)
    views = watcher.poll({"7_0": "RUNNING", "7_1": "RUNNING"})
    assert not views["7_0"].ended and views["7_1"].ended
    listing["7_0"] = "REQUEUED"
    assert watcher.poll({"7_0": "PREEMPTED"})["7_0"].active


def test_a_driverless_point_that_started_is_not_shown_as_never_started(tmp_path: Path) -> None:
    """`sbatch slurm/memfit-array.sbatch` runs points without a driver, which records no state: a point whose task
    started (its config.yaml written) and failed or is running was listed as `pending` ("never started")."""
    sweep_dir = tmp_path / "sw"
    sweep_dir.mkdir()
    points = [{"id": f"k={k}", "overrides": {"pack.k": k}, "dir": str(sweep_dir / "points" / f"k={k}"),
               "state": "pending"} for k in (5, 10)]
    (sweep_dir / "sweep.json").write_text(json.dumps({"name": "t", "sweep_keys": ["pack.k"], "points": points}))
    _point(sweep_dir, "k=5", None, None, False)
    (sweep_dir / "points" / "k=5" / "config.yaml").write_text("name: t\n")
    _, rows = aggregate(sweep_dir)
    assert [(r["point"], r["status"]) for r in rows] == [("k=5", "started"), ("k=10", "pending")]
