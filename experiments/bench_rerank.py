"""Cross-encoder throughput: our batched CrossEncoderModule vs sentence-transformers' CrossEncoder.predict.

Both score the same (question, turn) pairs with the same weights: real LoCoMo questions, each paired
with `--candidates` turns of its own conversation (the size of a rerank pool), formatted as stored
episodes. Without `--model`, the weights are the real all-MiniLM-L6-v2 body with a seeded random
one-label head (no trained cross-encoder is installable offline); its scores mean nothing, its cost is
exactly that of ms-marco-MiniLM-L-6-v2 (same architecture and size).

The reference runs at its own default batch size (32) unless `--st-batch-size` says otherwise; runs
alternate (ours, reference, ours, ...) so both see the same machine load. Pairs/s are wall-clock; the
CPU-time figures are printed too because this machine is shared.

--dtype picks both models' compute dtype (rerank.dtype's values; the reference is loaded in the dtype ours
resolved to). Last line: JSON with cpu, dtype, ours_pps, st_pps, ratio (ours / reference), max_abs_diff.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from _timing import alternate, rate_fields  # noqa: E402  (experiments/, this script's folder)

from memfit_gpu import onednn  # noqa: E402
from memfit_gpu.data import load_benchmark  # noqa: E402
from memfit_gpu.devices import describe  # noqa: E402
from memfit_gpu.index.encoders import CrossEncoderModule, random_cross_encoder  # noqa: E402
from memfit_gpu.store import episode_text  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LOCOMO = REPO.parent / "shared" / "data" / "locomo" / "locomo10.json"


def locomo_pairs(path: Path, questions: int, candidates: int, seed: int) -> list[tuple[str, str]]:
    """`questions` questions spread over the conversations, each with `candidates` of its own turns."""
    memories = load_benchmark("locomo", path).memories
    rng = random.Random(seed)
    per_conv = -(-questions // len(memories))
    pairs: list[tuple[str, str]] = []
    for memory in memories:
        turns = [episode_text(turn) for turn in memory.turns()]
        for question in rng.sample(memory.questions, min(per_conv, len(memory.questions))):
            for turn in rng.sample(turns, min(candidates, len(turns))):
                pairs.append((question.question, turn))
    rng.shuffle(pairs)  # a rerank batch arrives in no particular length order
    return pairs[: questions * candidates]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--model", default=None, help="cross-encoder folder or hub id (default: random head)")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--candidates", type=int, default=80)
    parser.add_argument("--batch-size", type=int, default=256, help="ours (RerankConfig.batch_size)")
    parser.add_argument("--st-batch-size", type=int, default=32, help="reference (CrossEncoder.predict default)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads for both (0 = torch default)")
    parser.add_argument("--dtype", default="auto",
                        help="compute dtype of both (rerank.dtype's values: auto, float32, bf16, fp16)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    pairs = locomo_pairs(args.locomo, args.questions, args.candidates, args.seed)
    with tempfile.TemporaryDirectory(prefix="bench_rerank_") as tmp:
        model_path = args.model or str(random_cross_encoder(Path(tmp) / "ce", seed=args.seed))
        ours = CrossEncoderModule.from_pretrained(model_path, device=args.device, max_length=384, dtype=args.dtype,
                                                  setting="rerank.dtype")
        from sentence_transformers import CrossEncoder

        # the reference in the dtype ours resolved to (auto included)
        reference = CrossEncoder(ours.loaded_from.path, device=str(ours.device), max_length=384,
                                 model_kwargs={"dtype": ours.dtype})
        if ours.activation == "identity" and "Identity" not in type(reference.activation_fn).__name__:
            raise RuntimeError(f"activation mismatch: ours identity, reference {reference.activation_fn}")

        warm = pairs[:64]
        ours.score(warm, batch_size=args.batch_size)
        reference.predict(warm, batch_size=args.st_batch_size, show_progress_bar=False)

        ours_scores, st_scores, seconds = alternate(
            args.repeats, lambda: ours.score(pairs, batch_size=args.batch_size),
            lambda: reference.predict(pairs, batch_size=args.st_batch_size, show_progress_bar=False,
                                      convert_to_tensor=True))

    n = len(pairs)
    # token counts of the pairs as the module truncates them (its tokenizer and max_length)
    lengths = [len(ids) for ids in ours.tokenizer([p[0] for p in pairs], [p[1] for p in pairs], padding=False,
                                                  truncation="longest_first", max_length=ours.max_length)["input_ids"]]
    result = {
        "pairs": n,
        "mean_tokens": round(sum(lengths) / n, 1),
        "max_tokens": max(lengths),
        "device": str(ours.device),
        "cpu": describe()["cpu"]["model"],
        "dtype": str(ours.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "fast_path": ours.fast_path,
        "cpu_gemm": "onednn" if ours.device.type == "cpu" and onednn.available() else "aten",
        "batch_size": args.batch_size,
        "st_batch_size": args.st_batch_size,
        **rate_fields(n, seconds, "pps"),
        "max_abs_diff": float((ours_scores - st_scores.float().cpu()).abs().max()),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
