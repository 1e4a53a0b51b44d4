"""Answer scores: token F1 and BLEU-1 in three variants (SPEC "Evaluation").

Every variant maps (prediction, gold, category) to {"f1", "bleu1"} in [0, 1]:

- ``paper``: the MemFit paper's scorer. Lowercase, delete ASCII punctuation, drop the articles
  a/an/the, split on whitespace. F1 from token-count overlap. BLEU-1 = clipped unigram precision x
  brevity penalty, BP = 1 if len(pred) >= len(gold) else exp(1 - len(gold)/len(pred)), with the
  released scorer's smoothing: no overlap at all gives precision 0.1 / len(pred), not 0
  ("work" vs "7 May 2023": 0.1 x e^(1-3) = 0.013534). Empty cases: both token lists empty -> F1 =
  1.0 (an empty answer to an empty gold is exact); exactly one empty -> F1 0.0; BLEU-1 is 0.0 when
  either side is empty (SPEC Evaluation).
- ``locomo``: the official LoCoMo scorer (snap-research/LoCoMo task_eval/evaluation.py), rewritten
  here. Commas deleted, lowercase, ASCII punctuation deleted, a/an/the/and dropped, Porter stems
  (nltk's PorterStemmer, the stemmer the official scorer uses). Category 1 (multi-hop): both strings
  are split on commas and F1 = mean over gold parts of the best F1 against any prediction part.
  Category 3 (open-domain): the gold is cut before its first ``;``. Category 5 (adversarial): 1.0
  when the prediction contains "no information available" or "not mentioned", else 0.0, as the
  official scorer does. No overlap scores 0 even when both sides are empty (official behaviour).
  The official scorer has no BLEU; ours is BLEU-1 (formula above) on the same stemmed tokens of
  the whole (category-3-cut) answer, 0.0 when either side is empty, and the category-5 indicator
  for category 5.
- ``memgallery``: Mem-Gallery's scorer (benchmark/memengine/evaluate/evaluation.py), rewritten
  here. "Universal" normalisation: lowercase; decimal points between digits and underscores are
  protected (so ``D1:IMG_001`` keeps ``img_001`` and ``3.14`` stays one token); a/an/the/and
  dropped; every other ASCII punctuation character becomes a space. F1 on Porter stems (0 when
  nothing overlaps, empty sides included). BLEU-1 is nltk's ``sentence_bleu`` with weights
  (1, 0, 0, 0) on the unstemmed tokens, which equals clipped unigram precision x brevity penalty;
  0.0 when either side is empty.

Categories are compared as strings ("1", not 1). Only the ``locomo`` variant looks at them, and
only for the LoCoMo categories 1, 3 and 5; any other category, or None (a run passes None for a
benchmark whose ids are not LoCoMo's: `rule_category`), is scored as plain F1.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import lru_cache

from tqdm import tqdm

from memfit_gpu.data.registry import find_spec

VARIANTS: tuple[str, ...] = ("paper", "locomo", "memgallery")
PAPER_BLEU_SMOOTHING = 0.1  # the released MemFit scorer: zero unigram overlap counts as 0.1 matches

_DELETE_PUNCT = str.maketrans("", "", string.punctuation)
_SPACE_PUNCT = str.maketrans(string.punctuation, " " * len(string.punctuation))
_PAPER_ARTICLES = re.compile(r"\b(a|an|the)\b")
_LOCOMO_ARTICLES = re.compile(r"\b(a|an|the|and)\b")
# Placeholders hold no punctuation and no lowercase letters, so neither the article pass nor the
# punctuation pass can touch them, and lowercased input can never contain them.
_DOT_MARK = "DOTPLACEHOLDER"
_UNDERSCORE_MARK = "UNDERSCOREPLACEHOLDER"
_DECIMAL_DOT = re.compile(r"(?<=\d)\.(?=\d)")
_ADVERSARIAL_PHRASES = ("no information available", "not mentioned")


# ----------------------------------------------------------------------------- normalisers


def paper_tokens(text: str) -> list[str]:
    """The paper's tokens: lowercase, punctuation deleted, a/an/the dropped, whitespace split."""
    text = str(text).lower().translate(_DELETE_PUNCT)
    return _PAPER_ARTICLES.sub(" ", text).split()


def locomo_normalize(text: str) -> str:
    """LoCoMo's normalize_answer: commas out, lowercase, punctuation deleted, a/an/the/and dropped."""
    text = str(text).replace(",", "").lower().translate(_DELETE_PUNCT)
    return " ".join(_LOCOMO_ARTICLES.sub(" ", text).split())


def memgallery_normalize(text: str) -> str:
    """Mem-Gallery's normalize_answer_universal (see the module docstring for the steps)."""
    text = str(text).lower()
    text = _DECIMAL_DOT.sub(_DOT_MARK, text)
    text = text.replace("_", _UNDERSCORE_MARK)
    text = _LOCOMO_ARTICLES.sub(" ", text)  # before the punctuation pass, as the original does
    text = text.translate(_SPACE_PUNCT)
    text = text.replace(_DOT_MARK, ".").replace(_UNDERSCORE_MARK, "_")
    return " ".join(text.split())


@lru_cache(maxsize=1)
def _porter():
    # nltk's default (NLTK_EXTENSIONS) mode, as PorterStemmer() in both official scorers; needs no data.
    from nltk.stem import PorterStemmer

    return PorterStemmer()


@lru_cache(maxsize=200_000)
def stem(word: str) -> str:
    """Porter stem of one token (cached: answers repeat the same few thousand words)."""
    return _porter().stem(word)


def locomo_tokens(text: str) -> list[str]:
    return [stem(w) for w in locomo_normalize(text).split()]


def memgallery_tokens(text: str, stemmed: bool = True) -> list[str]:
    words = memgallery_normalize(text).split()
    return [stem(w) for w in words] if stemmed else words


# ----------------------------------------------------------------------------- token metrics


def overlap_f1(pred: Sequence[str], gold: Sequence[str], both_empty: float = 0.0) -> float:
    """F1 of token-count overlap; `both_empty` is the score when both lists are empty."""
    if not pred and not gold:
        return both_empty
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred)
    recall = common / len(gold)
    return 2 * precision * recall / (precision + recall)


def bleu1(pred: Sequence[str], gold: Sequence[str], zero_overlap: float = 0.0) -> float:
    """Clipped unigram precision x brevity penalty; 0 when either side is empty.

    zero_overlap: the clipped count used when nothing overlaps (0 = nltk, which returns 0 then;
    0.1 = the MemFit released scorer's smoothing, precision 0.1 / len(pred))."""
    if not pred or not gold:
        return 0.0
    clipped = sum((Counter(pred) & Counter(gold)).values()) or zero_overlap
    c, r = len(pred), len(gold)
    brevity = 1.0 if c >= r else math.exp(1.0 - r / c)
    return brevity * clipped / c


# ----------------------------------------------------------------------------- variants


def _score_paper(prediction: str, gold: str, category: str) -> dict[str, float]:
    p, g = paper_tokens(prediction), paper_tokens(gold)
    return {"f1": overlap_f1(p, g, both_empty=1.0), "bleu1": bleu1(p, g, zero_overlap=PAPER_BLEU_SMOOTHING)}


def _score_locomo(prediction: str, gold: str, category: str) -> dict[str, float]:
    if category == "5":
        lowered = prediction.lower()
        hit = float(any(phrase in lowered for phrase in _ADVERSARIAL_PHRASES))
        return {"f1": hit, "bleu1": hit}
    if category == "3":
        gold = gold.split(";")[0].strip()
    if category == "1":
        pred_parts = [locomo_tokens(part.strip()) for part in prediction.split(",")]
        gold_parts = [locomo_tokens(part.strip()) for part in gold.split(",")]
        f1 = sum(max(overlap_f1(p, g) for p in pred_parts) for g in gold_parts) / len(gold_parts)
    else:
        f1 = overlap_f1(locomo_tokens(prediction), locomo_tokens(gold))
    return {"f1": float(f1), "bleu1": bleu1(locomo_tokens(prediction), locomo_tokens(gold))}


def _score_memgallery(prediction: str, gold: str, category: str) -> dict[str, float]:
    f1 = overlap_f1(memgallery_tokens(prediction), memgallery_tokens(gold))
    b1 = bleu1(memgallery_tokens(prediction, stemmed=False), memgallery_tokens(gold, stemmed=False))
    return {"f1": f1, "bleu1": b1}


_SCORERS = {"paper": _score_paper, "locomo": _score_locomo, "memgallery": _score_memgallery}


def _text(value: object) -> str:
    # None is an empty prediction; integers (LongMemEval, LoCoMo gold) score as their decimal string.
    return "" if value is None else str(value)


def rule_category(category: str | int | None, benchmark: str | None) -> str | int | None:
    """The category the `locomo` variant's rules read for a question of `benchmark`: its own where the
    benchmark's ids are LoCoMo's (BenchmarkSpec.locomo_categories), else None (plain F1): own data labelled
    "5" is no adversarial question. The one place that decides it, for a run, compare and the judge audit."""
    spec = find_spec(benchmark)
    return category if spec is not None and spec.locomo_categories else None


def score(
    prediction: str | None, gold: str | int, category: str | int | None, variant: str = "paper"
) -> dict[str, float]:
    """{"f1", "bleu1"} of one answer under one metric variant."""
    if variant not in _SCORERS:
        raise ValueError(f"unknown metric variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return _SCORERS[variant](_text(prediction), _text(gold), _text(category))


def score_all(
    predictions: Sequence[str | None],
    golds: Sequence[str | int],
    categories: Sequence[str | int | None],
    variants: Iterable[str] = VARIANTS,
    progress: bool = False,
) -> list[dict[str, dict[str, float]]]:
    """Per question {variant: {"f1", "bleu1"}}: the `scores` field of predictions.jsonl."""
    variants = list(variants)
    if not (len(predictions) == len(golds) == len(categories)):
        raise ValueError(
            f"score_all: predictions ({len(predictions)}), golds ({len(golds)}) and categories "
            f"({len(categories)}) must have the same length"
        )
    for variant in variants:
        if variant not in _SCORERS:
            raise ValueError(f"unknown metric variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    rows = zip(predictions, golds, categories, strict=True)
    if progress:
        rows = tqdm(rows, total=len(golds), desc="scoring", unit="q")
    return [{v: score(p, g, c, v) for v in variants} for p, g, c in rows]
