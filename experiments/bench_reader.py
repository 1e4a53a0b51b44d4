"""In-process reader on the CPU: `reader.dtype=auto` (bf16 where the CPU computes it natively, with the
one-new-token attention of readers/cpu_attention.py) against float32 with transformers' SDPA (the CPU
reader before 2026-12-02), same model, same requests, same process.

The requests are answer prompts the size of the embedded demo's MemFit packs: real LoCoMo questions of
conv-26, each with `--excerpts` of its conversation's turns around its evidence (one turn of context on
each side, as `pack.context_window=1` gives), in the paper's answer prompt. Both readers answer them
greedily with `--max-new-tokens` at `--batch-size` per generate call (the demo's 32 and 8); runs
alternate (ours, reference, ...) and medians are kept. Tokens/s counts prompt and generated tokens.

`--reference unpacked` compares instead with the same reader (same dtype) whose linear layers run through
torch's F.linear, i.e. memfit_gpu.onednn's packed weights undone: what packing gains, with the same answers
(`same_answers` = all of them).

Last line: JSON with ours_tps, st_tps (the reference), ratio (reference time / ours), the dtype, attention
and linear kernel that ran on each side, and `same_answers` (how many greedy answers are identical: bf16
and fp32 round differently, so some differ; both are the model's answers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from _timing import alternate, rate_fields  # noqa: E402  (experiments/, this script's folder)

from memfit_gpu import onednn  # noqa: E402
from memfit_gpu.config import ReaderConfig  # noqa: E402
from memfit_gpu.data import load_benchmark  # noqa: E402
from memfit_gpu.devices import cpu_native_bf16  # noqa: E402
from memfit_gpu.readers.prompts import build_answer_messages  # noqa: E402
from memfit_gpu.readers.transformers import TransformersBackend  # noqa: E402
from memfit_gpu.readers.types import Request  # noqa: E402
from memfit_gpu.store import episode_text  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LOCOMO = REPO.parent / "shared" / "data" / "locomo" / "locomo10.json"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def answer_requests(path: Path, questions: int, excerpts: int) -> list[Request]:
    """conv-26's first scored questions, each with `excerpts` turns around its evidence (+-1 turn)."""
    memory = load_benchmark("locomo", path).memories[0]
    turns = list(memory.turns())
    where = {turn.turn_id: i for i, turn in enumerate(turns)}
    requests = []
    for question in [q for q in memory.questions if q.evidence][:questions]:
        anchors = [where[e] for e in question.evidence if e in where] or [0]
        picked: list[int] = []
        for step in range(len(turns)):  # the evidence first, then turns further and further from it
            for anchor in anchors:
                for i in (anchor - step, anchor + step):
                    if 0 <= i < len(turns) and i not in picked and len(picked) < excerpts * 3:
                        picked.append(i)
            if len(picked) >= excerpts * 3:
                break
        text = "\n".join(f"- {episode_text(turns[i])}" for i in sorted(picked))
        requests.append(Request(build_answer_messages(question.question, text), role="answer",
                                key=question.question_id))
    return requests


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--excerpts", type=int, default=8, help="turns around the evidence per question (~1,500-token prompts, the demo's MemFit size)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the tests' setting: 1)")
    parser.add_argument("--reference", choices=("float32", "unpacked"), default="float32",
                        help="float32: the CPU reader before 2026-12-02 (fp32, SDPA); unpacked: this reader with its "
                             "linear layers through F.linear (memfit_gpu.onednn's packed weights undone)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    requests = answer_requests(args.locomo, args.questions, args.excerpts)
    reference_dtype = "float32" if args.reference == "float32" else "auto"
    readers = {name: TransformersBackend(ReaderConfig(backend="transformers", model=MODEL, dtype=dtype,
                                                      max_new_tokens=args.max_new_tokens,
                                                      batch_size=args.batch_size), device="cpu")
               for name, dtype in (("ours", "auto"), ("reference", reference_dtype))}
    for reader in readers.values():
        reader.load()  # the weights (a backend loads them on first use)
    if args.reference == "unpacked":
        onednn.unpack_linears(readers["reference"].net)
        readers["reference"].linear = "torch (packing undone)"
    for reader in readers.values():  # one warm-up call each
        reader.generate(requests[:1])
    ours, reference, seconds = alternate(args.repeats, lambda: readers["ours"].generate(requests),
                                         lambda: readers["reference"].generate(requests))
    tokens = sum(r.input_tokens + r.output_tokens for r in reference)
    result: dict[str, object] = {
        "requests": len(requests), "prompt_tokens": sum(r.input_tokens for r in reference),
        "new_tokens_ours": sum(r.output_tokens for r in ours), "new_tokens_reference": sum(r.output_tokens for r in reference),
        **rate_fields(tokens, seconds, "tps"),
        "dtype": str(readers["ours"].net.dtype).removeprefix("torch."), "attention": readers["ours"].attention,
        "linear": readers["ours"].linear, "reference_dtype": str(readers["reference"].net.dtype).removeprefix("torch."),
        "reference_attention": readers["reference"].attention, "reference_linear": readers["reference"].linear,
        "cpu_native_bf16": cpu_native_bf16(), "threads": args.threads,
        "same_answers": sum(a.text == b.text for a, b in zip(ours, reference, strict=True)),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
