"""The LightMem-SLM evaluation's acceptance on one small real sweep (`memfit sweep --launcher local`, configs/demo.yaml with the
packaged MiniLM and SmolLM2-135M), shared by every test here: LoCoMo conv-26 cut to its first three sessions
(58 turns, one MTM window each, one LTM batch) with three real questions whose evidence lies there: multi-hop,
temporal and adversarial (category 5 scored); the Table 3 metrics on; answers sampled at 0.7 (the SLMs stay
greedy), so seeds differ.

Points: lightmem and naive_rag (with the growth analysis), naive_rag's seed-1 twin, cascading (HQ noise,
write noise, no re-rank), mtm_noise and no_ltm_update: four LightMem runs, the fewest that run every switch
and fill a row of every table (the other rows print `-`). Checked: every noise switch ran end to end and
changed exactly what it says, against the clean run's own HQs and notes; noise 0 with another seed reads
the clean run's packs bit for bit (one read on a copy, every call served by the cache); the growth
analysis's last point reproduces the run, and a run killed after its first growth point resumes to the same
rows; `experiments/paper_tables.py --lightmem` prints every table, its rows checked against the runs'
metrics.json; `memfit aggregate --by seed`; `memfit compare --seeds`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from support.data import write_small_locomo
from support.env import memfit_env

from memfit_gpu.config import load_config
from memfit_gpu.data import load_benchmark, select_from_config
from memfit_gpu.evaluate import lightmem_tables as lt
from memfit_gpu.evaluate.compare import compare_seeds
from memfit_gpu.evaluate.paper_tables import expand
from memfit_gpu.files import jsonl_text, read_jsonl
from memfit_gpu.methods.base import MethodRun
from memfit_gpu.methods.lightmem import LightMem
from memfit_gpu.readers.reader import make_reader
from memfit_gpu.store import RecordLog

REPO = Path(__file__).resolve().parents[2]
# conv-26's questions whose evidence lies in sessions 1-3: multi-hop q4 (D1:5), temporal q0 (D1:3),
# adversarial q152 (D2:3); in the file they are q0, q1, q2
PICK = [4, 0, 152]
SMALL = {"data.exclude_categories": [], "reader.max_new_tokens": 8, "reader.temperature": 0.7,
         "lightmem.mtm_window_turns": 24, "lightmem.consolidate_every": 2, "lightmem.turn_chars": 60,
         "lightmem.stm_turns": 2, "lightmem.top_k": 4, "lightmem.mtm_max_new_tokens": 12,
         "lightmem.consolidate_max_new_tokens": 24, "lightmem.rewrite_max_new_tokens": 16,
         "lightmem.rerank_max_new_tokens": 4, "eval.text_metrics": ["rouge_l", "rouge_2", "meteor", "sbert"],
         "naive_rag.chunk_tokens": 48, "naive_rag.overlap_tokens": 8, "naive_rag.top_k": 3,  # short prompts
         "method": "lightmem_slm"}
GROWTH = [1, 3]  # MTM entries: the end of session 1 (18 turns), everything
POINTS = [  # the LightMem runs (minutes) first, so that the two at a time keep both cores busy to the end
    {"name": "lightmem", "eval.growth_points": GROWTH},
    {"name": "cascading", "lightmem.noise.hq": 0.5, "lightmem.rerank": False, "lightmem.noise.write": 0.5},
    {"name": "mtm_noise", "lightmem.noise.mtm": 0.8},
    {"name": "no_ltm_update", "lightmem.ltm_updates": False},
    {"name": "naive_rag", "method": "naive_rag", "eval.growth_points": GROWTH},
    # the same keys but the seed: `aggregate --by seed` groups the pair
    {"name": "naive_rag-seed1", "method": "naive_rag", "eval.growth_points": GROWTH, "reader.seed": 1},
]

def memfit(*args: str, shared_data: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memfit_gpu.cli", *args], env=memfit_env(shared_data, threads=1), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Path:
    root = tmp_path_factory.mktemp("lightmem-sweep")
    data = write_small_locomo(shared_data, root, questions=0, pick=PICK)
    sweep_file = root / "lightmem_small.yaml"
    sweep_file.write_text(json.dumps({"name": "lightmem_small", "config": str(REPO / "configs" / "demo.yaml"),
                                      "fixed": {**SMALL, "data.path": str(data)}, "points": POINTS}))
    out = root / "sweep"
    proc = memfit("sweep", "--config", str(sweep_file), "--launcher", "local", "--jobs", "2", "--out", str(out),
                  shared_data=shared_data, timeout=1800)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("*.log"))) if (out / "logs").exists() else ""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:] + logs
    return out


def point(sweep: Path, name: str) -> Path:
    return sweep / "points" / name


def metrics(sweep: Path, name: str) -> dict[str, Any]:
    return json.loads((point(sweep, name) / "metrics.json").read_text())


def log_records(run: Path, kind: str) -> list[dict[str, Any]]:
    log = RecordLog(run / "lightmem" / "log.jsonl")
    records = [r for r in log.records if r.get("t") == kind]
    log.close()
    return records


@pytest.mark.slow
def test_category_5_and_the_text_metrics_are_scored(sweep: Path):
    got = metrics(sweep, "lightmem")
    assert list(got["by_category"]) == ["1", "2", "5"] and got["questions"] == 3
    assert got["text_metrics"]["metrics"] == ["rouge_l", "rouge_2", "meteor", "sbert"]
    assert got["text_metrics"]["sbert_model"]["name"] == "sentence-transformers/all-MiniLM-L6-v2"
    rows = read_jsonl(point(sweep, "lightmem") / "predictions.jsonl")
    adversarial = next(r for r in rows if r["category"] == "5")
    assert adversarial["evaluated"] and adversarial["gold"] == "self-care is important"  # its adversarial_answer
    for cat, block in got["by_category"].items():
        members = [r for r in rows if r["category"] == cat]
        for name in got["text_metrics"]["metrics"]:
            assert block["text"][name] == pytest.approx(sum(r["text_scores"][name] for r in members) / len(members))
    assert "ROUGE-L" in (point(sweep, "lightmem") / "results.md").read_text()


@pytest.mark.slow
def test_each_noise_switch_changes_exactly_what_it_says(sweep: Path):
    clean = {r["question_id"]: r for r in read_jsonl(point(sweep, "lightmem") / "packs.jsonl")}
    noisy = {r["question_id"]: r for r in read_jsonl(point(sweep, "cascading") / "packs.jsonl")}
    # HQ noise: the same SLM-1 replies (greedy), half of all HQs replaced by another question's HQ text
    total = sum(len(r["lightmem"]["hqs"]) for r in clean.values())
    replaced = 0
    for qid, row in noisy.items():
        assert len(row["lightmem"]["hqs"]) == len(clean[qid]["lightmem"]["hqs"])
        for hq, before in zip(row["lightmem"]["hqs"], clean[qid]["lightmem"]["hqs"], strict=True):
            assert (hq["tier"], hq["budget"]) == (before["tier"], before["budget"])
            if "noise_from" in hq:
                replaced += 1
                assert hq["noise_from"] != qid
                assert hq["text"] in [h["text"] for h in clean[hq["noise_from"]]["lightmem"]["hqs"]]
            else:
                assert hq == before
    assert replaced == round(0.5 * total)
    # write noise: half the notes stored with another session's note, SLM-3's own text kept
    notes, stored = log_records(point(sweep, "lightmem"), "mtm"), log_records(point(sweep, "cascading"), "mtm")
    assert [n["entry"] for n in stored] == [n["entry"] for n in notes] and len(notes) == 3
    swapped = [s for s in stored if "noise" in s]
    assert len(swapped) == 2  # round(0.5 x 3)
    for s, n in zip(stored, notes, strict=True):
        if "noise" in s:
            donor = notes[s["noise"]["from"][1]]
            assert s["slm_text"] == n["text"] and s["text"] == donor["text"] and donor["session"] != n["session"]
        else:
            assert s == n
    # MTM noise: the log and LTM stay clean; 80 % of the notes read as noise, marked where chosen
    assert log_records(point(sweep, "mtm_noise"), "mtm") == notes
    assert log_records(point(sweep, "mtm_noise"), "ltm") == log_records(point(sweep, "lightmem"), "ltm")
    held = metrics(sweep, "mtm_noise")["retrieval"]["method"]["noise"]
    assert held == {"hqs_replaced": 0, "notes_replaced_write": 0,
                    "notes_replaced_mtm": round(0.8 * sum(1 for n in notes if n["text"]))}
    assert log_records(point(sweep, "no_ltm_update"), "ltm") == [] and log_records(point(sweep, "lightmem"), "ltm")


@pytest.mark.slow
def test_noise_zero_reads_the_clean_runs_packs_bit_for_bit(sweep: Path, tmp_path: Path, shared_data: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    """lightmem.noise.* = 0 with another noise seed, read again on a copy of the clean run (every SLM call a
    cache hit): the packs are the clean run's."""
    copy = tmp_path / "copy"
    shutil.copytree(point(sweep, "lightmem"), copy)
    cfg = load_config(copy / "config.yaml", ["lightmem.noise.seed=12345", "lightmem.noise.hq=0",
                                             "lightmem.noise.write=0.0", "lightmem.noise.mtm=0"])
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    bench = load_benchmark("locomo", cfg.data.path)
    selected = select_from_config(bench, cfg.data)
    reader = make_reader(cfg.reader, copy, progress=False)
    method = LightMem()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the run computed its vectors (OMP_NUM_THREADS=1): the same float bits
    try:
        run = MethodRun(cfg, copy, bench, selected.memories, selected.questions(), reader=lambda: reader)
        method.write(run)
        rows, _ = method.read(run)
    finally:
        torch.set_num_threads(threads)
        method.close()
        reader.close()
    assert json.loads(json.dumps(rows)) == read_jsonl(point(sweep, "lightmem") / "packs.jsonl")
    assert reader.ledger.roles["rewrite"].calls == reader.ledger.roles["rerank_slm"].calls == 0


@pytest.mark.slow
def test_growth_scores_the_due_questions_and_its_last_point_is_the_run(sweep: Path):
    for name in ("lightmem", "naive_rag"):
        got = metrics(sweep, name)
        points = got["growth"]["points"]
        # point 1 = the end of session 1 (18 turns, one window): q0 (D1:5) and q1 (D1:3), not q2 (D2:3)
        assert [(p["point"], p["questions"], p["turns"]) for p in points] == [(1, 2, 18), (3, 3, 58)]
        rows = [r for r in read_jsonl(point(sweep, name) / "growth.jsonl") if r["t"] == "question"]
        assert sorted(r["question_id"] for r in rows if r["point"] == 1) == ["conv-26:q0", "conv-26:q1"]
        # the whole trajectory: the same packs, so the same (cached) answers as the run itself
        assert points[1]["paper"]["f1"] == pytest.approx(got["overall"]["paper"]["f1"])
    held = metrics(sweep, "lightmem")["growth"]["points"][0]["memory"]
    assert (held["mtm_entries"], held["ltm_batches"]) == (1, 0)  # the LTM batch needs entries 0 and 1


@pytest.mark.slow
def test_paper_tables_lightmem_prints_every_table_from_the_runs(sweep: Path, tmp_path: Path, shared_data: Path):
    out = tmp_path / "tables"
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "paper_tables.py"), "--out", str(out),
                           "--lightmem", str(sweep), "--permutations", "500"], env=memfit_env(shared_data, threads=1),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = json.loads(proc.stdout.splitlines()[-1])["tables"]
    assert names == ["lightmem_table2_locomo", "lightmem_table3_metrics", "lightmem_table5_growth",
                     "lightmem_table6_noise", "lightmem_table7_update_gap", "lightmem_table8_significance",
                     "lightmem_table10_ltm"]
    runs = expand(str(sweep))
    tables = {t.key: t for t in lt.build(runs, n_permutations=500)}
    assert (out / "tables.md").read_text() == "\n".join(t.markdown() for t in tables.values())
    lm, rag = metrics(sweep, "lightmem"), metrics(sweep, "naive_rag")

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.2f}"

    t2, t3 = tables["lightmem_table2_locomo"], tables["lightmem_table3_metrics"]
    for cat, label in (("1", "multi-hop"), ("5", "adversarial"), ("2", "temporal")):
        assert t2.cell("lightmem", f"{label} F1") == pct(lm["by_category"][cat]["paper"]["f1"])
        assert t2.cell("naive_rag", f"{label} BLEU-1") == pct(rag["by_category"][cat]["paper"]["bleu1"])
    assert t2.cell("lightmem", "single-hop F1") == "-" and t2.cell("memfit", "multi-hop F1") == "-"  # not run
    for column, key in (("ROUGE-L", "rouge_l"), ("ROUGE-2", "rouge_2"), ("METEOR", "meteor"), ("SBERT", "sbert")):
        assert t3.cell("lightmem", column) == pct(lm["average"]["text"][key])
    assert t3.cell("naive_rag", "F1") == pct(rag["average"]["paper"]["f1"])
    t5 = tables["lightmem_table5_growth"]
    assert t5.cell("1", "LightMem F1") == pct(lm["growth"]["points"][0]["paper"]["f1"])
    assert t5.cell("3", "Vector retrieval F1") == pct(rag["growth"]["points"][1]["paper"]["f1"])
    t6, t7 = tables["lightmem_table6_noise"], tables["lightmem_table7_update_gap"]
    cascading, mtm_noise = metrics(sweep, "cascading"), metrics(sweep, "mtm_noise")
    assert t6.cell("A", "F1") == pct(lm["average"]["paper"]["f1"]) and t6.cell("B", "F1") == "-"
    assert t6.cell("E", "SBERT") == pct(cascading["average"]["text"]["sbert"])
    assert t7.cell("D", "Multi-hop F1") == pct(mtm_noise["by_category"]["1"]["paper"]["f1"])
    t8 = tables["lightmem_table8_significance"]
    seeds = compare_seeds([point(sweep, "naive_rag"), point(sweep, "naive_rag-seed1")], [point(sweep, "lightmem")],
                          n_permutations=500)
    hop = seeds["by_category"]["1"]
    rows = [r for r in t8.rows if r[0] == "multi-hop"]
    assert rows[0][1:5] == ["naive_rag", 2, hop["a"]["mean"], hop["a"]["std"]] and hop["a"]["std"] is not None
    assert rows[1][1:5] == ["lightmem", 1, hop["b"]["mean"], None]  # one seed: no spread
    assert rows[1][5:] == [hop["diff"], *hop["ci95"], hop["p_value"]]
    t10 = tables["lightmem_table10_ltm"]
    held = lm["retrieval"]["method"]
    assert held["turns"] == 58 and held["ltm_batches"] == 1
    assert t10.cell("Batch update interval", "Value") == "every 48 turns (measured: 58.0 turns / batch)"
    assert t10.cell("Reasoning accuracy (F1)", "Value") == (
        f"{pct(lm['average']['paper']['f1'])} (full) vs {pct(metrics(sweep, 'no_ltm_update')['average']['paper']['f1'])} "
        "(no update)")


@pytest.mark.slow
def test_aggregate_by_seed_and_compare_seeds_commands(sweep: Path, shared_data: Path):
    proc = memfit("aggregate", str(sweep), "--by", "seed", shared_data=shared_data)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "| naive_rag " in line]
    f1 = [metrics(sweep, n)["average"]["paper"]["f1"] for n in ("naive_rag", "naive_rag-seed1")]
    mean, std = sum(f1) / 2, abs(f1[0] - f1[1]) / 2 ** 0.5
    assert len(lines) == 1 and f"{100 * mean:.2f} ± {100 * std:.2f}" in lines[0]
    proc = memfit("compare", "--seeds", str(sweep / "points" / "naive_rag*"), str(sweep / "points" / "lightmem*"),
                  "--permutations", "500", "--json", shared_data=shared_data)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert [Path(p).parent.name for p in result["runs_b"]] == ["lightmem"]
    assert result["overall"]["a"]["per_seed"] == pytest.approx(
        [metrics(sweep, n)["overall"]["paper"]["f1"] for n in ("naive_rag", "naive_rag-seed1")])


@pytest.mark.slow
def test_growth_killed_at_its_durable_writes_resumes_to_the_same_rows(sweep: Path, tmp_path: Path,
                                                                       shared_data: Path):
    """naive_rag's finished point with its growth analysis undone (growth files, metrics, DONE removed; its
    store of answers kept), run again and killed at each of the growth stage's durable writes, then run once
    more: growth.jsonl and metrics.json's growth are the sweep point's, and no call was made again."""
    done = point(sweep, "naive_rag")
    config = done / "config.yaml"
    want = read_jsonl(done / "growth.jsonl")
    before = json.loads((done / "ledger.json").read_text())["roles"]

    def kill_then_rerun(fault: str) -> tuple[Path, subprocess.CompletedProcess[str], bool,
                                             subprocess.CompletedProcess[str]]:
        out = tmp_path / fault.replace(":", "_")
        shutil.copytree(done, out)
        for name in ("growth.jsonl", "growth.json", "metrics.json", "results.md", "DONE"):
            (out / name).unlink()
        if fault.startswith("growth.jsonl.whole"):
            # as a kill or a full disk in the middle of the second point's append leaves it: its head and half of
            # its first question row; the rerun takes the point out (and is killed right after)
            second = next(i for i, r in enumerate(want) if r["t"] == "point" and i > 0)
            assert want[second]["questions"] > 0
            (out / "growth.jsonl").write_text(jsonl_text(want[:second + 1]) + jsonl_text([want[second + 1]])[:40])
        env = memfit_env(shared_data, threads=1, MEMFIT_FAULT=fault)
        killed = subprocess.run([sys.executable, "-m", "memfit_gpu.cli", "run", "--config", str(config), "--out",
                                 str(out), "--quiet"], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
        done_after_kill = (out / "DONE").exists()
        return out, killed, done_after_kill, memfit("run", "--config", str(config), "--out", str(out), "--quiet",
                                                    shared_data=shared_data)

    # the last point's calls accounted, its rows not appended; the first point's rows appended; a point cut short
    # taken out of the file (whole_groups' rewrite)
    faults = ("growth.ledger:2", "growth:1", "growth.jsonl.whole:1")
    with ThreadPoolExecutor(2) as pool:  # independent directories, one torch thread each
        scenarios = list(pool.map(kill_then_rerun, faults))
    for fault, (out, killed, done_after_kill, rerun) in zip(faults, scenarios, strict=True):
        assert killed.returncode == -9 and not done_after_kill, (fault, killed.stderr[-2000:])
        assert rerun.returncode == 0, (fault, rerun.stderr[-3000:])
        assert read_jsonl(out / "growth.jsonl") == want, fault
        assert json.loads((out / "metrics.json").read_text())["growth"] == metrics(sweep, "naive_rag")["growth"]
        roles = json.loads((out / "ledger.json").read_text())["roles"]
        assert {r: s["calls"] for r, s in roles.items()} == {r: s["calls"] for r, s in before.items()}, fault
