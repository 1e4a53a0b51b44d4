"""Answer scores: every expected value below is computed by hand in the comment beside it."""

from __future__ import annotations

import json
import math

import pytest

from memfit_gpu.evaluate.metrics import (
    VARIANTS,
    bleu1,
    locomo_normalize,
    memgallery_normalize,
    overlap_f1,
    paper_tokens,
    score,
    score_all,
)

E1 = math.exp(-1.0)  # brevity penalty for 1 predicted token against 2 gold tokens: exp(1 - 2/1)
E2 = math.exp(-2.0)  # 1 against 3: exp(1 - 3/1)


def close(result: dict[str, float], f1: float, b1: float) -> bool:
    return result["f1"] == pytest.approx(f1, abs=1e-12) and result["bleu1"] == pytest.approx(b1, abs=1e-12)


# ----------------------------------------------------------------------------- normalisers


def test_paper_tokens_lowercase_punctuation_articles():
    assert paper_tokens("The Cat, an owl & a DOG!") == ["cat", "owl", "dog"]
    assert paper_tokens("Dr. Smith's") == ["dr", "smiths"]  # punctuation deleted, not spaced
    assert paper_tokens("D1:IMG_001") == ["d1img001"]
    assert paper_tokens("theater and the end") == ["theater", "and", "end"]  # whole words only; "and" kept
    assert paper_tokens("  ...  ") == []


def test_locomo_normalize_matches_official_steps():
    # commas out, lowercase, punctuation deleted, a/an/the/and dropped, whitespace collapsed
    assert locomo_normalize("Apples, Oranges and THE pears.") == "apples oranges pears"
    assert locomo_normalize("D1:IMG_001") == "d1img001"
    assert locomo_normalize("mother-in-law") == "motherinlaw"


def test_memgallery_normalize_keeps_ids_and_decimals():
    assert memgallery_normalize("D1:IMG_001") == "d1 img_001"
    assert memgallery_normalize("It costs 3.14 dollars.") == "it costs 3.14 dollars"
    assert memgallery_normalize("The end. A start") == "end start"  # sentence dots are not decimals
    assert memgallery_normalize("mother-in-law and a_b") == "mother in law a_b"  # "a" inside an id stays
    assert memgallery_normalize("v2.0_final") == "v2.0_final"


# ----------------------------------------------------------------------------- paper


def test_paper_exact_and_articles_and_punctuation():
    assert close(score("Paris.", "paris", "4", "paper"), 1.0, 1.0)
    assert close(score("The cat sat", "a cat sat", "4", "paper"), 1.0, 1.0)
    assert close(score("Dr. Smith's dog!", "dr smiths dog", "4", "paper"), 1.0, 1.0)


def test_paper_partial_overlap():
    # pred [went, to, paris, in, may] (5), gold [paris] (1): P = 1/5, R = 1, F1 = 2*(1/5)/(6/5) = 1/3
    # BLEU-1: 5 > 1 so BP = 1, clipped precision 1/5
    assert close(score("went to Paris in May", "Paris", "4", "paper"), 1 / 3, 0.2)
    # pred [paris] gold [paris, france]: P = 1, R = 1/2, F1 = 2/3; BLEU-1 = e^-1 * 1
    assert close(score("Paris", "Paris France", "4", "paper"), 2 / 3, E1)
    # clipping: pred [cat, cat, cat], gold [cat]: overlap 1, P = 1/3, R = 1, F1 = 1/2; BLEU-1 = 1/3
    assert close(score("cat cat cat", "cat", "4", "paper"), 0.5, 1 / 3)


def test_paper_integer_answers():
    # pred [in, 2022], gold [2022]: P = 1/2, R = 1, F1 = 2/3; BLEU-1 = 1/2 (no penalty, 2 > 1)
    assert close(score("in 2022", "2022", "2", "paper"), 2 / 3, 0.5)
    # reversed: P = 1, R = 1/2, F1 = 2/3; BLEU-1 = e^-1
    assert close(score("2022", "in 2022", "2", "paper"), 2 / 3, E1)
    assert close(score("2022", 2022, "2", "paper"), 1.0, 1.0)  # an int gold is its decimal string


def test_paper_empty_cases():
    assert close(score("", "Paris", "4", "paper"), 0.0, 0.0)
    assert close(score(None, "Paris", "4", "paper"), 0.0, 0.0)
    assert close(score("Paris", "", "4", "paper"), 0.0, 0.0)
    assert close(score("", "", "4", "paper"), 1.0, 0.0)  # F1 exact; BLEU-1 is 0 with an empty side (SPEC)
    assert close(score("the ...", "a", "4", "paper"), 1.0, 0.0)  # both normalise to nothing


def test_paper_ignores_category():
    assert score("London", "Paris, London", "1", "paper") == score("London", "Paris, London", "4", "paper")


# ----------------------------------------------------------------------------- locomo


def test_locomo_stemming_and_and_removal():
    # running -> run, dogs -> dog
    assert close(score("running dogs", "run dog", "4", "locomo"), 1.0, 1.0)
    # "and" dropped, commas removed: both are [appl, orang]
    assert close(score("apples and oranges", "apples, oranges", "4", "locomo"), 1.0, 1.0)
    # the paper variant keeps "and": pred [apples, and, oranges] gold [apples, oranges]: F1 = 2*(2/3)/(5/3) = 0.8
    assert close(score("apples and oranges", "apples, oranges", "4", "paper"), 0.8, 2 / 3)


def test_locomo_multi_hop_parts():
    # gold parts {paris, london}; best matches 0 and 1 -> mean 0.5
    # BLEU-1 on the whole answer: pred [london], gold [pari, london]: e^-1
    assert close(score("London", "Paris, London", "1", "locomo"), 0.5, E1)
    # gold parts paris -> 1, london -> 1, rome -> 0: F1 = 2/3
    # BLEU-1: pred [london, pari] (2), gold 3 tokens, clipped 2/2, BP = exp(1 - 3/2)
    assert close(score("London, Paris", "Paris, London, Rome", "1", "locomo"), 2 / 3, math.exp(-0.5))
    # a part with partial overlap: gold part "new york" vs pred part "york": P = 1, R = 1/2 -> 2/3;
    # gold part "boston" matched exactly -> 1; mean = (2/3 + 1) / 2 = 5/6
    result = score("york, Boston", "New York, Boston", "1", "locomo")
    assert result["f1"] == pytest.approx(5 / 6)
    # the same pair outside category 1 is one bag of words: pred [york, boston] gold [new, york, boston]
    # P = 1, R = 2/3, F1 = 0.8
    assert score("york, Boston", "New York, Boston", "4", "locomo")["f1"] == pytest.approx(0.8)


def test_locomo_category3_semicolon():
    # category 3 keeps "Seattle" only: exact
    assert close(score("Seattle", "Seattle; possibly Portland", "3", "locomo"), 1.0, 1.0)
    # elsewhere gold is [seattl, possibl, portland]: P = 1, R = 1/3, F1 = 1/2; BLEU-1 = e^-2
    assert close(score("Seattle", "Seattle; possibly Portland", "4", "locomo"), 0.5, E2)
    assert close(score("Seattle", "Seattle; possibly Portland", 3, "locomo"), 1.0, 1.0)  # int category


def test_locomo_adversarial_category5():
    assert close(score("Not mentioned in the conversation.", "a dog", "5", "locomo"), 1.0, 1.0)
    assert close(score("There is no information available.", "a dog", "5", "locomo"), 1.0, 1.0)
    assert close(score("a dog", "a dog", "5", "locomo"), 0.0, 0.0)


def test_locomo_empty_and_integers():
    assert close(score("", "", "4", "locomo"), 0.0, 0.0)  # official: no overlap scores 0
    assert close(score("", "Paris", "4", "locomo"), 0.0, 0.0)
    assert close(score("Paris", "", "4", "locomo"), 0.0, 0.0)
    assert close(score("", "Paris, London", "1", "locomo"), 0.0, 0.0)
    assert close(score("in 2022", "2022", "2", "locomo"), 2 / 3, 0.5)
    # punctuation is deleted before splitting, so an id survives as one token
    assert close(score("D1:IMG_001", "d1img001", "4", "locomo"), 1.0, 1.0)


# ----------------------------------------------------------------------------- memgallery


def test_memgallery_ids_and_decimals():
    assert close(score("D1:IMG_001", "D1:IMG_001", "VS", "memgallery"), 1.0, 1.0)
    # pred [img_001], gold [d1, img_001]: P = 1, R = 1/2, F1 = 2/3; BLEU-1 = e^-1
    assert close(score("IMG_001", "D1:IMG_001", "VS", "memgallery"), 2 / 3, E1)
    # the paper variant glues the id into "d1img001" and "img001": no overlap
    assert close(score("IMG_001", "D1:IMG_001", "VS", "paper"), 0.0, 0.1)  # no overlap: smoothed 0.1 / 1
    # different image: [d1, img_002] vs [d1, img_001]: overlap 1, P = R = 1/2, F1 = 1/2; BLEU-1 = 1/2
    assert close(score("D1:IMG_002", "D1:IMG_001", "VS", "memgallery"), 0.5, 0.5)
    # decimals: pred [3.14], gold [3.14, meter(s)]: F1 = 2/3, BLEU-1 = e^-1
    assert close(score("3.14", "3.14 meters", "VR", "memgallery"), 2 / 3, E1)
    # paper deletes the dot: "314" vs "3.14" -> "314": still equal tokens, a different reason
    assert close(score("3.14", "3.14", "VR", "paper"), 1.0, 1.0)
    assert close(score("3.15", "3.14", "VR", "memgallery"), 0.0, 0.0)


def test_memgallery_stems_f1_but_not_bleu():
    # F1 on stems: [run, dog] both -> 1; BLEU-1 on words: [running, dogs] vs [run, dog] -> 0
    assert close(score("running dogs", "run dog", "FR", "memgallery"), 1.0, 0.0)


def test_memgallery_yes_no_and_empty():
    assert close(score("Yes.", "Yes", "CD", "memgallery"), 1.0, 1.0)
    # pred [no, it, conflicts] gold [no]: F1 = 2*(1/3)/(4/3) = 1/2; BLEU-1 = 1/3
    assert close(score("No, it conflicts.", "No.", "CD", "memgallery"), 0.5, 1 / 3)
    assert close(score("", "", "CD", "memgallery"), 0.0, 0.0)
    assert close(score("", "Yes", "CD", "memgallery"), 0.0, 0.0)
    assert close(score("Yes", "", "CD", "memgallery"), 0.0, 0.0)


def test_memgallery_bleu1_equals_nltk_sentence_bleu(shared_data):
    # Mem-Gallery computes BLEU-1 with nltk's sentence_bleu(weights=(1,0,0,0), method1 smoothing)
    # on the normalised words: check ours against nltk on real gold answers paired with others.
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    scenario = sorted((shared_data / "memgallery" / "dialog").glob("*.json"))[0]
    answers = [str(q["answer"]) for q in json.loads(scenario.read_text())["human-annotated QAs"]][:40]
    smoothing = SmoothingFunction().method1
    checked = 0
    for i, gold in enumerate(answers):
        for pred in (answers[(i + 1) % len(answers)], gold + " " + answers[(i + 3) % len(answers)], gold):
            ref = memgallery_normalize(gold).split()
            hyp = memgallery_normalize(pred).split()
            if not ref or not hyp:
                continue
            expected = sentence_bleu([ref], hyp, weights=(1, 0, 0, 0), smoothing_function=smoothing)
            assert score(pred, gold, "FR", "memgallery")["bleu1"] == pytest.approx(expected, abs=1e-12)
            checked += 1
    assert checked >= 100


# ----------------------------------------------------------------------------- helpers and batching


def test_paper_bleu1_uses_the_released_smoothing():
    # "work" vs "7 May 2023": no overlap, precision 0.1 / 1, BP = exp(1 - 3/1)
    assert score("work", "7 May 2023", "2", "paper")["bleu1"] == pytest.approx(0.1 * math.exp(-2.0), abs=1e-12)
    assert round(score("work", "7 May 2023", "2", "paper")["bleu1"], 6) == 0.013534
    # two tokens, no overlap, longer than gold: 0.1 / 2, BP = 1
    assert score("red car", "blue", "4", "paper")["bleu1"] == pytest.approx(0.05, abs=1e-12)
    # equal lengths: BP = 1, precision 1/2 (one of two matches), 0.1/2 when none match
    assert score("red car", "red bus", "4", "paper")["bleu1"] == pytest.approx(0.5, abs=1e-12)
    assert score("red car", "blue bus", "4", "paper")["bleu1"] == pytest.approx(0.05, abs=1e-12)
    # an empty side gives 0, smoothing or not
    assert score("", "7 May 2023", "2", "paper")["bleu1"] == 0.0
    assert score("work", "", "2", "paper")["bleu1"] == 0.0
    # the other variants keep nltk's rule: no overlap gives 0
    assert score("work", "7 May 2023", "2", "memgallery")["bleu1"] == 0.0
    assert score("work", "7 May 2023", "2", "locomo")["bleu1"] == 0.0


def test_overlap_f1_and_bleu1_primitives():
    assert overlap_f1([], []) == 0.0
    assert overlap_f1([], [], both_empty=1.0) == 1.0
    # pred [a, b, b, c], gold [b, b, d]: overlap 2, P = 1/2, R = 2/3, F1 = 2*(1/3)/(7/6) = 4/7
    assert overlap_f1(["a", "b", "b", "c"], ["b", "b", "d"]) == pytest.approx(4 / 7)
    # same pair, BLEU-1: 4 > 3 so BP = 1, clipped 2/4
    assert bleu1(["a", "b", "b", "c"], ["b", "b", "d"]) == pytest.approx(0.5)
    # 2 predicted vs 4 gold, both match: BP = exp(1 - 4/2) = e^-1
    assert bleu1(["x", "y"], ["x", "y", "z", "w"]) == pytest.approx(E1)


def test_score_all_batches_every_variant():
    preds = ["Paris", "", "in 2022"]
    golds = ["Paris France", "x", 2022]
    cats = ["4", "4", 2]
    rows = score_all(preds, golds, cats)
    assert len(rows) == 3 and all(set(r) == set(VARIANTS) for r in rows)
    for row, p, g, c in zip(rows, preds, golds, cats, strict=True):
        for v in VARIANTS:
            assert row[v] == score(p, g, c, v)
    assert close(rows[0]["paper"], 2 / 3, E1)
    only = score_all(preds, golds, cats, variants=["locomo"])
    assert [set(r) for r in only] == [{"locomo"}] * 3


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown metric variant 'squad'"):
        score("a", "b", "1", "squad")
    with pytest.raises(ValueError, match="same length"):
        score_all(["a"], ["b", "c"], ["1"])


def test_real_gold_answers_score_themselves(locomo_path, shared_data):
    # Every evaluated LoCoMo gold scored against itself is exact, except under the official scorer
    # for category-3 golds with a ";": it cuts the gold, not the prediction, so those lose recall.
    qa = [q for conv in json.loads(locomo_path.read_text()) for q in conv["qa"] if q["category"] != 5]
    golds, cats = [str(q["answer"]) for q in qa], [str(q["category"]) for q in qa]
    assert len(golds) == 1540
    rows = score_all(golds, golds, cats)
    for variant in ("paper", "memgallery"):
        assert all(r[variant] == {"f1": 1.0, "bleu1": 1.0} for r in rows), variant
    below = {i for i, r in enumerate(rows) if r["locomo"]["f1"] < 1.0}
    cut = {i for i, (g, c) in enumerate(zip(golds, cats, strict=True)) if c == "3" and ";" in g}
    assert below == cut and len(cut) > 0
    # MemGallery golds (image ids, decimals, yes/no) under its own scorer
    answers = [
        str(q["answer"])
        for path in sorted((shared_data / "memgallery" / "dialog").glob("*.json"))
        for q in json.loads(path.read_text())["human-annotated QAs"]
    ]
    assert len(answers) == 1711
    scored = score_all(answers, answers, ["FR"] * len(answers), variants=["memgallery"])
    assert all(r["memgallery"] == {"f1": 1.0, "bleu1": 1.0} for r in scored)
