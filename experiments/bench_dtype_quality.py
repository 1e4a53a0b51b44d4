"""Retrieval quality of the encoders in bf16 (or fp16) against float32, on every evaluated LoCoMo question.

Not a timing benchmark: it measures what a dtype does to retrieval, so that `index.dtype` / `rerank.dtype`
`auto` may choose bf16 where the CPU computes it fast (devices.resolve_dtype).

Bi-encoder: the ten conversations are stored twice, once per dtype (the store's episode vectors and the
questions' and PRF queries' embeddings all come from that dtype's encoder), and the batched read path runs
all questions (configs/memfit.yaml, reranker none and no summary layer, as experiments/bench_retrieval.py:
no trained cross-encoder nor summarising reader is installable offline). Per dtype: hit@5, hit@10 and pack
hit (retrieve/diagnostics.py); between them: the differences in points and the share of questions whose
top-10 episodes (rows, in order) are equal. The batched = one-at-a-time identity the live server and the
parity tests rely on is checked per dtype too: the questions and PRF queries encoded one text at a time
give embeddings within `*_one_at_a_time_max_abs_diff` of the batched ones, and the packs and top-10s that
come from them are compared with the batched ones.

Cross-encoder: bench_rerank.py's (question, turn) pairs scored in float32 and in the dtype: the largest
score difference, the share of questions whose top-10 candidates (in order) are equal, and the scores of
pairs scored one at a time against the batched ones. Without `--cross-encoder`, its weights are the real
MiniLM body with a seeded random head (bench_rerank.py's; its scores mean nothing, their arithmetic is a
ms-marco MiniLM's).

`--dtype bf16x3` measures split bf16 instead, the arithmetic an AMX CPU can run at bf16 speed with close to
float32's precision (Intel oneMKL's FLOAT_TO_BF16X3 compute mode; three bf16 GEMMs where one fp32 GEMM was):
each float32 operand of every linear layer is split into a bf16 high part and the bf16 rounding of the rest,
and the layer sums the three products hi*hi + lo*hi + hi*lo in float32. Here those products are formed
exactly, as float32 GEMMs of the bf16-valued parts (`split_bf16_products`), so the figures are the
arithmetic's on any CPU; they say nothing about its speed, which only an AMX CPU can measure.

    OMP_NUM_THREADS=2 .venv/bin/python experiments/bench_dtype_quality.py --dtype bf16
    OMP_NUM_THREADS=2 .venv/bin/python experiments/bench_dtype_quality.py --dtype bf16x3

Last line: JSON with `bi_encoder` and `cross_encoder` sections and `cpu`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from bench_gemm import bf16x3_linear, stacked_split_weight  # noqa: E402  (experiments/, this script's folder)
from bench_rerank import locomo_pairs  # noqa: E402

from memfit_gpu.config import load_config  # noqa: E402
from memfit_gpu.data import load_benchmark, select_questions  # noqa: E402
from memfit_gpu.devices import describe, parse_dtype  # noqa: E402
from memfit_gpu.index.encoders import CrossEncoderModule, load_bi_encoder, packed_bert, random_cross_encoder  # noqa: E402
from memfit_gpu.retrieve.batched import retrieve_batch  # noqa: E402
from memfit_gpu.retrieve.diagnostics import compute_diagnostics  # noqa: E402
from memfit_gpu.retrieve.view import ReadView  # noqa: E402
from memfit_gpu.store import EpisodeStore  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "locomo" / "locomo10.json"
RATES = ("hit@5", "hit@10", "pack_hit")
SPLIT = "bf16x3"  # --dtype: split bf16, emulated exactly (float32 encoders whose linear layers sum three bf16 products)


@contextmanager
def split_bf16_products() -> Iterator[None]:
    """Every linear layer of the packed encoders (projections, feed-forward) computed as bf16x3 does, by
    bench_gemm's `bf16x3_linear`: x @ w.T = xh @ wh.T + xl @ wh.T + xh @ wl.T (the lo*lo term dropped), the
    products of bf16 values exact in float32 (torch's default fp32 precision) and summed in float32. Each
    layer's weight is split once."""
    exact = packed_bert.linear
    stacked: dict[tuple[int, str], torch.Tensor] = {}

    def linear(owner: torch.nn.Module, name: str, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != torch.float32:
            return exact(owner, name, x, weight, bias)
        key = (id(owner), name)
        if key not in stacked:
            stacked[key] = stacked_split_weight(weight.detach())
        return bf16x3_linear(x, stacked[key], bias)

    with mock.patch.object(packed_bert, "linear", linear):
        yield


def _arithmetic(dtype: str) -> tuple[str, AbstractContextManager[None]]:
    """(the encoders' dtype, the context it runs in) for --dtype."""
    return ("float32", split_bf16_products()) if dtype == SPLIT else (dtype, nullcontext())


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _label(dtype: str) -> str:
    """--dtype as the figures name it: a torch dtype's name, or bf16x3's."""
    return f"{SPLIT} (emulated)" if dtype == SPLIT else _name(parse_dtype(dtype))


def _top(result, k: int = 10) -> list[int]:
    return [c["row"] for c in result.ranked if c["kind"] == "episode"][:k]


def _one_at_a_time(encode: Callable[[list[str]], torch.Tensor]) -> Callable[[list[str]], torch.Tensor]:
    def embed(texts: list[str]) -> torch.Tensor:
        return torch.cat([encode([t]) for t in texts]) if texts else encode([])
    return embed


def bi_encoder_run(data: Path, config: str, overrides: Sequence[str], dtype: str,
                   limit_questions: int | None) -> dict:
    """One dtype: the store, the batched read path, its rates; the one-at-a-time embeddings and what they give."""
    cfg = load_config(config, [*overrides, "rerank.backend=none", "retrieve.summaries=false", "index.device=cpu",
                               f"index.dtype={dtype}"])
    benchmark = select_questions(load_benchmark("locomo", data), exclude_categories=["5"])
    questions = [q for q in benchmark.questions() if q.evaluated][:limit_questions]
    texts, memory_ids = [q.question for q in questions], [q.memory_id for q in questions]
    encoder = load_bi_encoder(cfg.index)
    store = EpisodeStore(None, cfg, encoder)
    store.add_memories(benchmark.memories, progress=False)

    def batched_embed(batch: list[str]) -> torch.Tensor:
        return encoder.encode(batch, batch_size=cfg.index.encode_batch_size)

    single_embed = _one_at_a_time(batched_embed)
    q_batched = batched_embed(texts)
    q_single = single_embed(texts)
    batched = retrieve_batch(ReadView.from_store(store), cfg, texts, memory_ids, embed=batched_embed,
                             question_embeddings=q_batched)
    view = ReadView.from_store(store)
    single = retrieve_batch(view, cfg, texts, memory_ids, embed=single_embed, question_embeddings=q_single)
    overall = compute_diagnostics(batched, questions, view, {"backend": "none"})[0]["overall"]
    n = len(questions)
    summary = {
        "dtype": _name(encoder.dtype), "questions": n, "scored_questions": overall["questions"],
        **{key: overall[key] for key in RATES},
        "one_at_a_time_max_abs_diff": float((q_batched - q_single).abs().max()),
        "one_at_a_time_equal_packs": sum(a.pack_key() == b.pack_key() for a, b in zip(batched, single, strict=True)) / n,
        "one_at_a_time_equal_top10": sum(_top(a) == _top(b) for a, b in zip(batched, single, strict=True)) / n,
    }
    vectors = store.episode_dense.vectors(store.memory_rows(0))
    store.close()
    return {"summary": summary, "results": batched, "first_memory_vectors": torch.as_tensor(vectors)}


def compare_bi_encoder(base: dict, other: dict) -> dict:
    a, b = base["summary"], other["summary"]
    n = a["questions"]
    return {
        "float32": a, "other": b,
        **{f"{key}_diff_points": round(100 * (b[key] - a[key]), 3) for key in RATES},
        "equal_top10": sum(_top(x) == _top(y) for x, y in zip(base["results"], other["results"], strict=True)) / n,
        "equal_top10_set": sum(set(_top(x)) == set(_top(y))
                               for x, y in zip(base["results"], other["results"], strict=True)) / n,
        "equal_packs": sum(x.pack_key() == y.pack_key() for x, y in zip(base["results"], other["results"], strict=True)) / n,
        "episode_vectors_max_abs_diff": float((base["first_memory_vectors"] - other["first_memory_vectors"]).abs().max()),
    }


def cross_encoder_run(data: Path, model: str | None, dtype: str, questions: int, candidates: int,
                      seed: int, single: int) -> dict:
    """bench_rerank's pairs scored in float32 and in `dtype`: score differences, top-10 agreement per question."""
    pairs = locomo_pairs(data, questions, candidates, seed)
    with tempfile.TemporaryDirectory(prefix="bench_dtype_quality_") as tmp:
        path = model or str(random_cross_encoder(Path(tmp) / "ce", seed=seed))
        scores, one_at_a_time = {}, {}
        for name in ("float32", dtype):
            module_dtype, arithmetic = _arithmetic(name)
            module = CrossEncoderModule.from_pretrained(path, device="cpu", max_length=384, dtype=module_dtype,
                                                        setting="rerank.dtype")
            with arithmetic:
                scores[name] = module.score(pairs)
                one_at_a_time[name] = torch.cat([module.score([p]) for p in pairs[:single]]) if single else None
    base, other = scores["float32"], scores[dtype]
    by_question: dict[str, list[int]] = {}
    for i, (question, _) in enumerate(pairs):
        by_question.setdefault(question, []).append(i)

    def top(values: torch.Tensor, rows: list[int]) -> list[int]:
        order = torch.argsort(values[rows], descending=True, stable=True).tolist()
        return [rows[i] for i in order[:10]]

    equal = sum(top(base, rows) == top(other, rows) for rows in by_question.values())
    equal_set = sum(set(top(base, rows)) == set(top(other, rows)) for rows in by_question.values())
    out = {
        "model": model or f"random head on all-MiniLM-L6-v2 (seed {seed})", "dtype": _label(dtype),
        "pairs": len(pairs), "questions": len(by_question),
        "max_abs_score_diff": float((base - other).abs().max()),
        "float32_score_std": float(base.std()),
        "equal_top10": equal / len(by_question), "equal_top10_set": equal_set / len(by_question),
    }
    if single:
        out.update({f"{'float32' if name == 'float32' else 'other'}_one_at_a_time_max_abs_diff":
                    float((one_at_a_time[name] - scores[name][:single]).abs().max()) for name in scores})
        out["one_at_a_time_pairs"] = single
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="locomo10.json")
    parser.add_argument("--config", default=str(REPO / "configs" / "memfit.yaml"))
    parser.add_argument("--dtype", default="bf16",
                        help=f"compared with float32: bf16 (default), fp16 or {SPLIT} (split bf16, emulated)")
    parser.add_argument("--limit-questions", type=int, default=None, help="the first N evaluated questions")
    parser.add_argument("--cross-encoder", default=None, help="cross-encoder folder or hub id (default: random head)")
    parser.add_argument("--ce-questions", type=int, default=16, help="bench_rerank.py's --questions")
    parser.add_argument("--ce-candidates", type=int, default=80, help="bench_rerank.py's --candidates")
    parser.add_argument("--ce-one-at-a-time", type=int, default=160, help="pairs also scored one at a time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="config overrides")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    if args.dtype != SPLIT and parse_dtype(args.dtype, "--dtype") in (None, torch.float32):
        raise SystemExit(f"--dtype: name the dtype to compare with float32 (bf16, fp16 or {SPLIT})")

    runs = {}
    for name in ("float32", args.dtype):
        module_dtype, arithmetic = _arithmetic(name)
        with arithmetic:
            runs[name] = bi_encoder_run(args.data, args.config, args.overrides, module_dtype, args.limit_questions)
        runs[name]["summary"]["dtype"] = _label(name)
    result = {
        "cpu": describe()["cpu"]["model"], "threads": torch.get_num_threads(),
        "bi_encoder": compare_bi_encoder(runs["float32"], runs[args.dtype]),
        "cross_encoder": cross_encoder_run(args.data, args.cross_encoder, args.dtype, args.ce_questions,
                                           args.ce_candidates, args.seed, args.ce_one_at_a_time),
    }
    text = json.dumps(result)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
