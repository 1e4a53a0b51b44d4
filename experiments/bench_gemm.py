"""fp32 linear layers on this CPU: oneDNN with prepacked weights (memfit_gpu.onednn, what the
encoders run) against torch's own `F.linear` (MKL), at MiniLM's layer shapes.

Why it exists: the encoders route their linear layers through oneDNN because on the AMD EPYC host of
2026-11-29 MKL's fp32 GEMM ran 1.1-1.8x slower (docs/benchmarks/history.md). On another CPU the gain may be gone,
and with it most of bench_encode's and bench_rerank's lead over sentence-transformers: this bench says
which case a machine is, before anyone hunts for a regression in the encoders.

For each torch thread count and shape (rows = tokens of a batch, in -> out features): the best of
`--repeats` timings of `--inner` calls each, ours and the reference alternating; `mkl_over_onednn` > 1
means oneDNN is faster. Results are checked equal (max abs difference printed). `bf16_ms` times the same layer
in bf16 (`F.linear` on bf16 tensors: what the encoders run with `index.dtype: bf16`, oneDNN's AMX or AVX512-BF16
kernels where the CPU has them), and `onednn_over_bf16` is fp32's time over it.

    PYTHONPATH=. .venv/bin/python experiments/bench_gemm.py

Last line: JSON with the CPU model, and per thread count and shape the two times and their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from memfit_gpu.index.encoders import onednn

# MiniLM-L6 (and ms-marco-MiniLM-L-6): hidden 384, intermediate 1,536; the attention projections are 384 -> 384
SHAPES = ((2048, 384, 1536), (2048, 1536, 384), (2048, 384, 384))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def best_of(repeats: int, inner: int, call: Callable[[], torch.Tensor]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            call()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def compare(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, repeats: int,
            inner: int) -> tuple[float, float, float, float]:
    """(oneDNN seconds, F.linear seconds, max abs difference, bf16 F.linear seconds) of one layer, the three
    alternating twice."""
    owner = torch.nn.Module()
    low = [t.bfloat16() for t in (x, weight, bias)]
    with torch.inference_mode():
        ours = onednn.linear(owner, "w", x, weight, bias)  # packs the weight once (not timed)
        diff = float((ours - torch.nn.functional.linear(x, weight, bias)).abs().max())
        t_onednn = t_mkl = t_bf16 = float("inf")
        for _ in range(2):  # alternate, so all see the same load
            t_onednn = min(t_onednn, best_of(repeats, inner, lambda: onednn.linear(owner, "w", x, weight, bias)))
            t_mkl = min(t_mkl, best_of(repeats, inner, lambda: torch.nn.functional.linear(x, weight, bias)))
            t_bf16 = min(t_bf16, best_of(repeats, inner, lambda: torch.nn.functional.linear(*low)))
    return t_onednn, t_mkl, diff, t_bf16


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts to measure")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", type=int, default=10, help="calls per timing")
    args = parser.parse_args(argv)
    if not onednn.available():
        parser.error("this torch build has no usable oneDNN linear ops: the encoders use F.linear here")
    generator = torch.Generator().manual_seed(0)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for tokens, fan_in, fan_out in SHAPES:
            x = torch.randn(tokens, fan_in, generator=generator)
            weight, bias = torch.randn(fan_out, fan_in, generator=generator), torch.randn(fan_out, generator=generator)
            t_onednn, t_mkl, diff, t_bf16 = compare(x, weight, bias, args.repeats, args.inner)
            row = {"threads": threads, "shape": f"{tokens}x{fan_in}->{fan_out}", "onednn_ms": round(t_onednn * 1e3, 3),
                   "mkl_ms": round(t_mkl * 1e3, 3), "mkl_over_onednn": round(t_mkl / t_onednn, 3),
                   "gflops_onednn": round(2 * tokens * fan_in * fan_out / t_onednn / 1e9, 1), "max_abs_diff": diff,
                   "bf16_ms": round(t_bf16 * 1e3, 3), "onednn_over_bf16": round(t_onednn / t_bf16, 3),
                   "gflops_bf16": round(2 * tokens * fan_in * fan_out / t_bf16 / 1e9, 1)}
            rows.append(row)
            print(f"threads={threads} {row['shape']:>16}: oneDNN {row['onednn_ms']:8.3f} ms  MKL {row['mkl_ms']:8.3f} ms"
                  f"  MKL/oneDNN {row['mkl_over_onednn']:.2f}  bf16 {row['bf16_ms']:8.3f} ms"
                  f"  oneDNN/bf16 {row['onednn_over_bf16']:.2f}", flush=True)
    result = {"cpu": cpu_model(), "torch": torch.__version__, "rows": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
