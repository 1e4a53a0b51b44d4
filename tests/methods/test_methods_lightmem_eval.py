"""The LightMem-SLM evaluation, the parts that need no run: the Table 3 metrics on hand cases, the noise recipe, growth points,
seeds (aggregate --by, compare --seeds) on hand-made run directories, LoCoMo category 5 selection, configs.

Every expected value is worked out by hand in the comments (and, for ROUGE and METEOR, also equals what
rouge-score and nltk compute themselves)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_methods import ScriptedSLM, _bench, _two_users  # pytest puts this folder on sys.path

from memfit_gpu.config import ConfigError, load_config
from memfit_gpu.data import load_benchmark, select_from_config
from memfit_gpu.data.schema import Memory, Question, Session, Turn
from memfit_gpu.evaluate import text_metrics
from memfit_gpu.evaluate.compare import compare_seeds, format_seed_comparison
from memfit_gpu.evaluate.stats import bootstrap_mean_ci, paired_permutation_test
from memfit_gpu.evaluate.tables import render_markdown, summarize
from memfit_gpu.methods.base import MethodRun
from memfit_gpu.methods.lightmem import HQ, LightMem, UserMemory
from memfit_gpu.methods.lightmem_noise import Item, chosen, noise_hqs, noise_notes, read_noise, replacements
from memfit_gpu.run.growth import check_growth, due_questions, growth_turns
from memfit_gpu.sweep.aggregate import aggregate_by, by_to_markdown, unfinished_points
from memfit_gpu.sweep.spec import load_sweep, override_arg

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------- metrics
def test_rouge_equals_rouge_score_on_hand_cases():
    from rouge_score import rouge_scorer

    library = rouge_scorer.RougeScorer(["rougeL", "rouge2"], use_stemmer=True)
    cases = [
        # LCS "the cat on the mat" = 5 of 6 on both sides: P = R = F = 5/6; bigrams: the-cat, on-the, the-mat
        # shared of 5 each: F = 3/5
        ("the cat sat on the mat", "the cat is on the mat", 5 / 6, 3 / 5),
        # Porter stems: run dog / the dog run; LCS 1: P = 1/2, R = 1/3, F = 2/5; no shared bigram
        ("Running dogs!", "The dog runs.", 2 / 5, 0.0),
        # identical after lowercasing and dropping punctuation
        ("7 May 2023", "7 may, 2023", 1.0, 1.0),
    ]
    for prediction, gold, rouge_l, rouge_2 in cases:
        ours = text_metrics.rouge(prediction, gold)
        theirs = library.score(gold, prediction)
        assert ours["rouge_l"] == pytest.approx(rouge_l, abs=1e-12) == theirs["rougeL"].fmeasure
        assert ours["rouge_2"] == pytest.approx(rouge_2, abs=1e-12) == theirs["rouge2"].fmeasure


def _meteor_by_hand(matches: int, hyp: int, ref: int, chunks: int) -> float:
    precision, recall = matches / hyp, matches / ref
    fmean = precision * recall / (0.9 * precision + 0.1 * recall)
    return (1 - 0.5 * (chunks / matches) ** 3) * fmean


def test_meteor_equals_nltk_on_hand_worked_cases():
    from nltk.translate.meteor_score import single_meteor_score

    cases = [
        ("the cat sat", "the cat sat", _meteor_by_hand(3, 3, 3, 1)),  # 1 - 0.5/27 = 0.981481...
        ("dogs running", "dog runs", _meteor_by_hand(2, 2, 2, 1)),  # stem stage only: 1 - 0.5/8 = 0.9375
        ("sat the cat", "the cat sat", _meteor_by_hand(3, 3, 3, 2)),  # two chunks: 1 - 0.5 * 8/27
        ("a red car", "the red car is fast", _meteor_by_hand(2, 3, 5, 1)),  # P 2/3, R 2/5: 0.390625
    ]
    assert [round(c[2], 6) for c in cases] == [0.981481, 0.9375, 0.851852, 0.390625]
    wordnet, _ = text_metrics._wordnet()
    for prediction, gold, expected in cases:
        ours = text_metrics.meteor(prediction, gold)
        theirs = single_meteor_score(text_metrics.tokens(gold), text_metrics.tokens(prediction), wordnet=wordnet)
        assert ours == pytest.approx(expected, abs=1e-12) and ours == theirs
    assert text_metrics.meteor_variant() in (text_metrics.METEOR_WORDNET, text_metrics.METEOR_EXACT_STEM)


@pytest.mark.slow  # the real MiniLM
def test_sbert_is_one_for_identical_strings_and_the_cosine_otherwise(bi_encoder):
    def encode(texts: list[str]) -> Any:
        return bi_encoder.encode(texts)

    same, other = text_metrics.sbert(["She went to Paris in May.", "pottery"], ["She went to Paris in May.", "tax law"],
                                     encode)
    assert same == pytest.approx(1.0, abs=1e-6)
    vectors = bi_encoder.encode(["pottery", "tax law"])
    assert other == pytest.approx(float(vectors[0] @ vectors[1]), abs=1e-6) and other < 0.9


def test_text_scores_empty_sides_and_unknown_metrics():
    rows = text_metrics.text_scores(["", "", "x"], ["", "Paris", ""], ["rouge_l", "rouge_2", "meteor"])
    assert rows == [{"rouge_l": 1.0, "rouge_2": 1.0, "meteor": 1.0}, {"rouge_l": 0.0, "rouge_2": 0.0, "meteor": 0.0},
                    {"rouge_l": 0.0, "rouge_2": 0.0, "meteor": 0.0}]
    with pytest.raises(ValueError, match="unknown text metric"):
        text_metrics.text_scores(["a"], ["a"], ["bleu4"])
    with pytest.raises(ValueError, match="needs the run's bi-encoder"):
        text_metrics.text_scores(["a"], ["a"], ["sbert"])
    with pytest.raises(ConfigError, match=r"eval.text_metrics\[1\]='rouge1' is not one of"):
        load_config(None, ["eval.text_metrics=[rouge_l,rouge1]"])


def _cells(markdown: str) -> list[list[str]]:
    """The cells of the Markdown table rows in `markdown`, padding stripped (header and rule included)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in markdown.splitlines()
            if line.startswith("|")]


def _prediction(qid: str, category: str, f1: float, text: dict[str, float] | None = None) -> dict[str, Any]:
    row = {"question_id": qid, "memory_id": "m", "category": category, "evaluated": True, "question": "?",
           "gold": "g", "prediction": "p", "scores": {"paper": {"f1": f1, "bleu1": f1 / 2}}, "judge": None}
    return {**row, "text_scores": text} if text is not None else row


def test_metrics_json_and_results_md_hold_the_text_metrics_per_category():
    rows = [_prediction("a", "1", 0.5, {"rouge_l": 0.2, "sbert": 0.9}), _prediction("b", "1", 0.5, {"rouge_l": 0.4, "sbert": 0.7}),
            _prediction("c", "2", 1.0, {"rouge_l": 1.0, "sbert": 1.0})]
    metrics = summarize(rows, benchmark="locomo", ci=False)
    assert metrics["by_category"]["1"]["text"] == pytest.approx({"rouge_l": 0.3, "sbert": 0.8})
    assert metrics["overall"]["text"] == pytest.approx({"rouge_l": 1.6 / 3, "sbert": 2.6 / 3})
    # LoCoMo's Average = mean of the category means: rouge_l (0.3 + 1.0) / 2, sbert (0.8 + 1.0) / 2
    assert metrics["average"]["text"] == pytest.approx({"rouge_l": 0.65, "sbert": 0.9})
    metrics["text_metrics"] = {"metrics": ["rouge_l", "sbert"], "sbert_model": {"name": "enc/x"}}
    table = render_markdown(metrics)
    text_rows = _cells(table.split("Text similarity")[1])
    assert text_rows[0] == ["Category", "n", "ROUGE-L", "SBERT"] and "`enc/x`" in table
    assert text_rows[2:] == [["multi-hop (1)", "2", "30.00", "80.00"], ["temporal (2)", "1", "100.00", "100.00"],
                             ["**Average**", "3", "65.00", "90.00"], ["**Overall**", "3", "53.33", "86.67"]]
    # a row without text scores (an older resumed run) leaves them out rather than mixing two means
    assert "text" not in summarize(rows + [_prediction("d", "2", 0.0)], benchmark="locomo", ci=False)["overall"]


# --------------------------------------------------------------------------------------------- noise
def test_noise_chooses_exactly_its_fraction_by_each_items_own_key():
    keys = [f"conv-{u}:{e}" for u in range(3) for e in range(10)]
    picked = chosen(keys, 0.5, seed=7, switch="write")
    assert len(picked) == 15 and chosen(keys, 0.5, seed=7, switch="write") == picked
    assert chosen(keys, 0.5, seed=8, switch="write") != picked and chosen(keys, 0.0, 7, "write") == set()
    # the choice follows the keys, not their order
    reordered = list(reversed(keys))
    assert {reordered[i] for i in chosen(reordered, 0.5, 7, "write")} == {keys[i] for i in picked}


def test_donors_are_other_users_items_else_unrelated_items_of_the_one_user():
    items = [Item(f"{u}:{e}", u, f"s{e // 2}", f"note {u}{e}") for u in ("A", "B") for e in range(4)]
    swaps = replacements(items, 0.5, 0, "write")
    assert len(swaps) == 4 and all(items[d].owner != items[i].owner for i, d in swaps.items())
    alone = [i for i in items if i.owner == "A"]
    swaps = replacements(alone, 1.0, 0, "mtm")
    assert len(swaps) == 4 and all(alone[d].group != alone[i].group for i, d in swaps.items())
    assert replacements([Item("A:0", "A", "s0", "x")], 1.0, 0, "hq") == {}  # no donor: left as it is


def test_hq_noise_replaces_the_chosen_hqs_text_and_keeps_tier_and_budget():
    questions = [Question(f"q{i}", "conv", f"question {i}", "a", "1") for i in range(4)]
    plans = [[HQ(f"hq {i}.{j}", "mtm" if j else "ltm", 2) for j in range(2)] for i in range(4)]
    assert noise_hqs(plans, questions, 0.0, 3) is plans  # noise 0: the very same plans
    noisy = noise_hqs(plans, questions, 0.5, 3)
    changed = [(i, j) for i in range(4) for j in range(2) if noisy[i][j] != plans[i][j]]
    assert len(changed) == 4
    for i, j in changed:
        hq = noisy[i][j]
        donor = int(hq.noise_from[1:])
        assert donor != i and hq.text in {f"hq {donor}.0", f"hq {donor}.1"}
        assert (hq.tier, hq.budget) == (plans[i][j].tier, plans[i][j].budget)
    assert all(noisy[i][j] is plans[i][j] for i in range(4) for j in range(2) if (i, j) not in changed)


def test_write_noise_stores_donor_text_and_keeps_the_slms_own():
    records = [{"t": "mtm", "user": "A", "entry": e, "session": f"s{e}", "text": f"note {e}", "rows": [e]}
               for e in range(4)]
    clean = [dict(r) for r in records]
    assert noise_notes(records, 0.0, 0, "write") == {} and records == clean
    swaps = noise_notes(records, 0.5, 0, "write")
    assert len(swaps) == 2
    for i, d in swaps.items():
        assert records[i]["text"] == clean[d]["text"] and records[i]["slm_text"] == clean[i]["text"]
        assert records[i]["noise"] == {"switch": "write", "from": ["A", d]}
    assert [records[i] for i in range(4) if i not in swaps] == [clean[i] for i in range(4) if i not in swaps]
    # read-time MTM noise only says what the index holds instead
    assert read_noise(clean, 0.0, 0) == {}
    held = read_noise(clean, 1.0, 0)
    assert set(held) == {("A", e) for e in range(4)} and all(held[("A", e)] != f"note {e}" for e in range(4))


def test_lightmem_prefix_keeps_the_windows_and_batches_within_it():
    memory = UserMemory()
    memory.mtm = {e: {"rows": [2 * e, 2 * e + 1], "text": f"n{e}"} for e in range(4)}
    for batch, entries in ((0, [0, 1]), (1, [2, 3])):
        memory.apply_ltm({"batch": batch, "entries": entries, "nodes": [[f"X{batch}", "Entity"]],
                          "edges": [[f"X{batch}", "IsA", f"C{batch}"]], "dropped": batch})
    at = memory.prefix(4)  # rows 0..4: entries 0 and 1 (rows up to 3), not entry 2 (rows 4, 5)
    assert sorted(at.mtm) == [0, 1] and at.ltm_done == {0} and at.graph.names == ["X0", "C0"] and at.dropped == 0
    whole = memory.prefix(7)
    assert sorted(whole.mtm) == [0, 1, 2, 3] and whole.graph.names == memory.graph.names and whole.dropped == 1


# -------------------------------------------------------------------------------------------- growth
def _memory(memory_id: str, sessions: list[int]) -> Memory:
    when, day = "2023-05-01T10:00:00", "10:00 am on 1 May, 2023"
    return Memory(memory_id, [Session(f"S{s}", day, when, [Turn(f"D{s}:{i + 1}", "A", "hi", when, day)
                                                           for i in range(n)]) for s, n in enumerate(sessions, 1)])


def test_growth_points_cut_each_memory_at_the_end_of_its_pth_window():
    memories = [_memory("m1", [5, 3]), _memory("m2", [2])]
    # window 2: m1's windows are [0,1] [2,3] [4] | [5,6] [7] -> ends 2, 4, 5, 7, 8; m2: [0,1] -> 2
    assert growth_turns(memories, [1, 3, 10], 2) == {1: {"m1": 2, "m2": 2}, 3: {"m1": 5, "m2": 2},
                                                    10: {"m1": 8, "m2": 2}}
    questions = [Question("a", "m1", "?", "x", "1", evidence=["D1:2"]), Question("b", "m1", "?", "x", "1",
                 evidence=["D1:2", "D2:1"]), Question("c", "m1", "?", "x", "3"), Question("d", "m2", "?", "x", "2")]
    assert [q.question_id for q in due_questions(questions, memories, {"m1": 2, "m2": 2})] == ["a", "d"]
    # without evidence: only once the memory is whole
    assert [q.question_id for q in due_questions(questions, memories, {"m1": 8, "m2": 2})] == ["a", "b", "c", "d"]
    # evidence naming no turn of the memory (LoCoMo has two such questions) is not waited for: such a question
    # was never scored, not even at the point that holds every memory whole
    odd = [Question("e", "m1", "?", "x", "1", evidence=["D1:2", "D9:9"]), Question("f", "m1", "?", "x", "1",
           evidence=["D9:9"])]
    assert [q.question_id for q in due_questions(odd, memories, {"m1": 2, "m2": 2})] == ["e"]
    assert [q.question_id for q in due_questions(odd, memories, {"m1": 8, "m2": 2})] == ["e", "f"]


def test_growth_needs_a_method_that_reads_at_a_point_and_increasing_points():
    check_growth(load_config(None, ["method=naive_rag", "eval.growth_points=[1,2]"]))
    with pytest.raises(ConfigError, match="needs method lightmem_slm or naive_rag"):
        check_growth(load_config(None, ["eval.growth_points=[1,2]"]))
    with pytest.raises(ConfigError, match=r"eval.growth_points\[1\]=2 must be >= 1 and larger"):
        load_config(None, ["eval.growth_points=[2,2]"])


# --------------------------------------------------------------------------------------------- seeds
def _seed_run(path: Path, f1: list[float], categories: list[str]) -> Path:
    path.mkdir(parents=True)
    rows = [_prediction(f"q{i}", c, v) for i, (v, c) in enumerate(zip(f1, categories, strict=True))]
    (path / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_compare_seeds_means_std_interval_and_p(tmp_path: Path):
    cats = ["1", "1", "2", "2"]
    a = [_seed_run(tmp_path / "a0", [0.0, 0.5, 1.0, 0.0], cats), _seed_run(tmp_path / "a1", [0.5, 0.5, 0.5, 0.0], cats)]
    b = [_seed_run(tmp_path / "b0", [1.0, 0.5, 1.0, 0.5], cats), _seed_run(tmp_path / "b1", [0.5, 1.0, 1.0, 0.5], cats)]
    result = compare_seeds(a, b, n_permutations=2000, n_boot=2000, seed=1)
    overall = result["overall"]
    # per seed: A 0.375, 0.375 (std 0); B 0.75, 0.75; diff 0.375
    assert overall["a"] == {"mean": 0.375, "std": 0.0, "per_seed": [0.375, 0.375]}
    assert overall["b"]["mean"] == 0.75 and overall["diff"] == pytest.approx(0.375)
    # questions averaged over seeds: A [0.25, 0.5, 0.75, 0], B [0.75, 0.75, 1, 0.5] -> differences 0.5, 0.25, 0.25, 0.5
    differences = np.array([0.5, 0.25, 0.25, 0.5])
    assert overall["ci95"] == list(bootstrap_mean_ci(differences, n_boot=2000, seed=1))
    assert overall["p_value"] == paired_permutation_test([0.25, 0.5, 0.75, 0.0], [0.75, 0.75, 1.0, 0.5],
                                                         n_permutations=2000, seed=1)["p_value"]
    # multi-hop: A seeds 0.25, 0.5 -> mean 0.375, std 0.1768; B 0.75, 0.75
    hop = result["by_category"]["1"]
    assert hop["a"]["mean"] == 0.375 and hop["a"]["std"] == pytest.approx(math.sqrt(0.03125))
    assert hop["diff"] == pytest.approx(0.375) and result["category_mean"]["diff"] == pytest.approx(0.375)
    # Table 8's layout: A's line with mean ± std, B's with the difference, its interval and p
    lines = format_seed_comparison(result, "naive", "lightmem").splitlines()
    a_line, b_line = lines[lines.index(next(x for x in lines if x.startswith("multi-hop (1)"))):][:2]
    assert a_line.split()[2:6] == ["naive", "37.50", "±", "17.68"]
    low, high = (f"{100 * v:+.2f}" for v in hop["ci95"])
    assert b_line.split() == ["lightmem", "75.00", "±", "0.00", "+37.50", f"[{low},", f"{high}]", f"{hop['p_value']:.4f}"]
    (tmp_path / "a1" / "predictions.jsonl").write_text(json.dumps(_prediction("q0", "1", 0.0)) + "\n")
    with pytest.raises(ValueError, match="seeds of one system must answer the same questions"):
        compare_seeds(a, b)


def test_compare_seeds_takes_permutations_and_seed_from_the_first_a_runs_config(tmp_path: Path, capsys):
    """--seeds took 10,000 permutations and seed 0 whatever the runs' config said (--help said RUN_A's config),
    and ignored --exact without a word. Now it reads them as two-run compare does, and refuses --exact."""
    from memfit_gpu.cli import main
    from memfit_gpu.config import to_yaml

    cats = ["1", "1", "2", "2"]
    a = [_seed_run(tmp_path / "a0", [0.0, 0.5, 1.0, 0.0], cats), _seed_run(tmp_path / "a1", [0.5, 0.5, 0.5, 0.0], cats)]
    b = [_seed_run(tmp_path / "b0", [1.0, 0.5, 1.0, 0.5], cats)]
    assert (compare_seeds(a, b)["n_permutations"], compare_seeds(a, b)["seed"]) == (10_000, 0)
    (a[0] / "config.yaml").write_text(to_yaml(load_config(None, ["eval.permutation_samples=300", "eval.seed=7"])))
    configured = compare_seeds(a, b)
    assert (configured["n_permutations"], configured["seed"]) == (300, 7)
    assert configured == compare_seeds(a, b, n_permutations=300, seed=7)
    assert main(["compare", "--seeds", "--exact", str(tmp_path / "a*"), str(tmp_path / "b*")]) == 2
    assert "--exact tests two runs" in capsys.readouterr().err


def test_aggregate_by_seed_gives_mean_and_std_per_group(tmp_path: Path):
    points = []
    for method, seed, f1 in (("naive_rag", 0, 0.2), ("naive_rag", 1, 0.4), ("lightmem_slm", 0, 0.5),
                             ("lightmem_slm", 1, 0.5), ("lightmem_slm", 2, 0.8)):
        pid = f"{method}-seed{seed}"
        folder = tmp_path / "points" / pid
        folder.mkdir(parents=True)
        metrics = {"metric_variant": "paper", "average": {"paper": {"f1": f1, "bleu1": f1 / 2}, "text": {"sbert": f1}},
                   "by_category": {"1": {"paper": {"f1": f1, "bleu1": 0.0}}}}
        (folder / "metrics.json").write_text(json.dumps(metrics))
        (folder / "DONE").write_text("x\n")
        points.append({"id": pid, "overrides": {"method": method, "reader.seed": seed}, "dir": str(folder),
                       "state": "done"})
    (tmp_path / "sweep.json").write_text(json.dumps({"name": "s", "sweep_keys": ["method", "reader.seed"],
                                                     "points": points}))
    columns, names, rows = aggregate_by(tmp_path, "seed")
    assert columns == ["method", "reader.seed", "points", "of"] and names == ["f1", "bleu1", "sbert", "f1 1"]
    assert [(r["method"], r["reader.seed"], r["points"], r["of"]) for r in rows] == [
        ("naive_rag", [0, 1], 2, 2), ("lightmem_slm", [0, 1, 2], 3, 3)]
    assert rows[0]["f1"] == pytest.approx((0.3, math.sqrt(0.02)))
    assert rows[1]["f1"] == pytest.approx((0.6, math.sqrt(0.03)))
    assert _cells(by_to_markdown(columns, names, rows))[3] == ["lightmem_slm", "[0, 1, 2]", "3", "3", "60.00 ± 17.32",
                                                              "30.00 ± 8.66", "60.00 ± 17.32", "60.00 ± 17.32"]
    with pytest.raises(ValueError, match="--by temperature names no sweep key"):
        aggregate_by(tmp_path, "temperature")
    # a point without a metric (its judge off, a category it did not select): the group's cell is empty, not a
    # mean over the others under "3 points"
    seed2 = tmp_path / "points" / "lightmem_slm-seed2" / "metrics.json"
    seed2.write_text(json.dumps({**json.loads(seed2.read_text()), "by_category": {}}))
    _, _, rows = aggregate_by(tmp_path, "seed")
    assert rows[1]["f1 1"] is None and rows[1]["f1"] == pytest.approx((0.6, math.sqrt(0.03)))
    assert rows[0]["f1 1"] == pytest.approx((0.3, math.sqrt(0.02)))
    # unfinished points: a group's mean says over how many of its points, and a group none of whose points
    # finished is a row too (one seed of naive_rag failing and no lightmem point done showed naive_rag alone)
    (tmp_path / "points" / "naive_rag-seed1" / "DONE").unlink()
    for seed in (0, 1, 2):
        (tmp_path / "points" / f"lightmem_slm-seed{seed}" / "DONE").unlink()
    _, _, rows = aggregate_by(tmp_path, "seed")
    assert [(r["method"], r["reader.seed"], r["points"], r["of"], r["f1"]) for r in rows] == [
        ("naive_rag", [0], 1, 2, (0.2, None)), ("lightmem_slm", [], 0, 3, None)]
    assert unfinished_points(tmp_path) == ["naive_rag-seed1", "lightmem_slm-seed0", "lightmem_slm-seed1",
                                           "lightmem_slm-seed2"]


# ------------------------------------------------------------------------------------ data and configs
def test_exclude_categories_empty_scores_locomo_category_5(locomo_path: Path):
    bench = load_benchmark("locomo", locomo_path)
    every = select_from_config(bench, load_config(None, ["data.exclude_categories=[]"]).data)
    adversarial = [q for q in every.questions() if q.category == "5"]
    assert len(every.questions()) == 1986 and len(adversarial) == 446 and all(q.evaluated for q in adversarial)
    assert adversarial[0].answer == adversarial[0].extra["adversarial_answer"]
    assert len(select_from_config(bench, load_config().data).questions()) == 1540


def test_lightmem_sweeps_load_and_change_what_their_names_say():
    main = load_sweep(REPO / "configs" / "sweeps" / "lightmem_locomo_qwen3_8b.yaml")
    base = load_config(main.config)
    assert base.method == "lightmem_slm" and base.data.exclude_categories == []
    assert base.eval.text_metrics == ["rouge_l", "rouge_2", "meteor", "sbert"]
    points = {p.point_id: p.overrides for p in main.points}
    assert points["cascading"] == {"lightmem.noise.hq": 0.5, "lightmem.rerank": False, "lightmem.noise.write": 0.5}
    assert points["lightmem"]["eval.growth_points"] == points["naive_rag"]["eval.growth_points"]
    seeds = load_sweep(REPO / "configs" / "sweeps" / "lightmem_seeds_locomo_qwen3_8b.yaml")
    assert [p.point_id for p in seeds.points] == ["naive_rag", "naive_rag-seed1", "naive_rag-seed2", "lightmem",
                                                   "lightmem-seed1", "lightmem-seed2"]
    # load_sweep has loaded every point's config (a bad key or value would have raised)
    assert load_config(seeds.config, [override_arg(k, v) for k, v in seeds.fixed.items()]).reader.temperature == 0.7


# --------------------------------------------------------- LightMem's hooks, with the scripted SLMs of test_methods
def _scripted_run(tmp_path: Path, bi_encoder, monkeypatch: pytest.MonkeyPatch, *overrides: str):
    monkeypatch.setattr("memfit_gpu.methods.lightmem.load_bi_encoder", lambda index: bi_encoder)
    cfg = load_config(REPO / "configs" / "demo.yaml", [
        "method=lightmem_slm", "lightmem.mtm_window_turns=2", "lightmem.consolidate_every=2", "lightmem.top_k=3",
        "lightmem.stm_turns=1", "index.device=cpu", *overrides])
    memories = _two_users()
    slm = ScriptedSLM()
    run = MethodRun(cfg, tmp_path, _bench(*memories), list(memories), [q for m in memories for q in m.questions],
                    reader=lambda: slm)
    return run, slm


@pytest.mark.slow  # the real MiniLM
def test_lightmem_noise_hooks_with_two_users(tmp_path: Path, bi_encoder, monkeypatch: pytest.MonkeyPatch):
    run, _ = _scripted_run(tmp_path, bi_encoder, monkeypatch, "lightmem.noise.write=0.5", "lightmem.noise.hq=1")
    method = LightMem()
    method.write(run)
    rows, diagnostics = method.read(run)
    memlog = method.memlog
    assert memlog is not None
    notes = {(u, e): r for u in ("alpine", "urban") for e, r in memlog.user(u).mtm.items()}
    noisy = {k: r for k, r in notes.items() if "noise" in r}
    assert len(notes) == 6 and len(noisy) == 3  # half of one write batch's six notes
    for (user, _), record in noisy.items():
        donor_user, donor_entry = record["noise"]["from"]
        donor = notes[(donor_user, donor_entry)]
        assert donor_user != user and record["text"] == donor.get("slm_text", donor["text"]) != record["slm_text"]
    # consolidation read the stored (noisy) notes: an urban name reaches alpine's graph or the other way round
    names = {u: set(memlog.user(u).graph.names) for u in ("alpine", "urban")}
    assert names["alpine"] & {"Kim", "jazz", "croissants", "painting"} or names["urban"] & {"Sam", "hiking", "cheese"}
    # every HQ (noise.hq = 1) is the other user's question's
    for row, other in zip(rows, ("urban:q0", "alpine:q0"), strict=True):
        assert {h["noise_from"] for h in row["lightmem"]["hqs"]} == {other}
    assert diagnostics["method"]["noise"] == {"hqs_replaced": 4, "notes_replaced_write": 3, "notes_replaced_mtm": 0}
    method.close()


@pytest.mark.slow  # the real MiniLM
def test_lightmem_reads_its_memory_as_it_stood_at_a_point(tmp_path: Path, bi_encoder, monkeypatch: pytest.MonkeyPatch):
    run, slm = _scripted_run(tmp_path, bi_encoder, monkeypatch)
    method = LightMem()
    method.write(run)
    whole, _ = method.read(run)
    calls = len(slm.requests)
    # two turns each: the first window of each user, no LTM batch yet (batch 0 needs entries 0 and 1)
    rows, diagnostics = method.read_at(run, {"alpine": 2, "urban": 2})
    assert {k: diagnostics["method"][k] for k in ("turns", "mtm_entries", "ltm_nodes", "ltm_batches")} == {
        "turns": 4, "mtm_entries": 2, "ltm_nodes": 0, "ltm_batches": 0}
    for row, user, stm in zip(rows, ("A", "B"), ("Sam likes skiing", "Kim likes jazz"), strict=True):
        assert "KNOWLEDGE:" not in row["excerpts"] and {i["tier"] for i in row["lightmem"]["items"]} <= {"mtm"}
        assert {e["turn_id"] for e in row["pack"]["episodes"]} <= {f"{user}1", f"{user}2"}
        assert stm in row["excerpts"].split("\n\n")[0]  # STM: the second turn
    # the whole trajectory is the ordinary read, asking what that read asked
    again, _ = method.read_at(run, {"alpine": 5, "urban": 4})
    assert again == whole and [r.key for r in slm.requests[-4:]] == [r.key for r in slm.requests[calls - 4:calls]]
    method.close()
