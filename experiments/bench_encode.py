"""Bi-encoder throughput: our BiEncoder.encode vs SentenceTransformer.encode on real LoCoMo turns.

Same weights (all-MiniLM-L6-v2, packaged offline), same texts (stored-episode format), both at batch
size 128 and normalised; runs alternate so both see the same machine load. Pairs of figures: wall
clock texts/s (the ratio) and CPU-time texts/s (this machine is shared).

--dtype picks both models' compute dtype (index.dtype's values; the reference is loaded in the dtype ours
resolved to). Last line: JSON with cpu, dtype, ours_tps, st_tps, ratio (ours / reference), max_abs_diff.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from _timing import alternate, rate_fields  # noqa: E402  (experiments/, this script's folder)

from memfit_gpu import onednn  # noqa: E402
from memfit_gpu.data import load_benchmark  # noqa: E402
from memfit_gpu.devices import describe  # noqa: E402
from memfit_gpu.index.encoders import BiEncoder  # noqa: E402
from memfit_gpu.store import episode_text  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LOCOMO = REPO.parent / "shared" / "data" / "locomo" / "locomo10.json"


def locomo_turns(path: Path) -> list[str]:
    """Every LoCoMo turn as the store keeps it (SPEC episode text)."""
    return [episode_text(turn) for memory in load_benchmark("locomo", path).memories for turn in memory.turns()]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--texts", type=int, default=1500, help="turns sampled from all of LoCoMo")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads for both (0 = torch default)")
    parser.add_argument("--dtype", default="auto",
                        help="compute dtype of both (index.dtype's values: auto, float32, bf16, fp16)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    turns = locomo_turns(args.locomo)
    texts = random.Random(args.seed).sample(turns, min(args.texts, len(turns)))
    ours = BiEncoder.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    from sentence_transformers import SentenceTransformer

    # the reference in the dtype ours resolved to (auto included)
    reference = SentenceTransformer(ours.loaded_from.path, device=str(ours.device), model_kwargs={"dtype": ours.dtype})
    ours.encode(texts[:64], batch_size=args.batch_size)
    reference.encode(texts[:64], batch_size=args.batch_size)

    ours_vectors, st_vectors, seconds = alternate(
        args.repeats, lambda: ours.encode(texts, batch_size=args.batch_size),
        lambda: reference.encode(texts, batch_size=args.batch_size, normalize_embeddings=True, convert_to_tensor=True))

    n = len(texts)
    result = {
        "texts": n,
        "device": str(ours.device),
        "cpu": describe()["cpu"]["model"],
        "dtype": str(ours.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "fast_path": ours.fast_path,
        "cpu_gemm": "onednn" if ours.device.type == "cpu" and onednn.available() else "aten",
        "batch_size": args.batch_size,
        **rate_fields(n, seconds, "tps"),
        "max_abs_diff": float((ours_vectors - st_vectors.float().cpu()).abs().max()),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
