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

Split bf16 (`bf16x3_ms`): the float32 layer as three bf16 products summed in float32 (x = xh + xl, w = wh + wl,
each part a bf16 value; x @ w.T ~ xh @ wh.T + xl @ wh.T + xh @ wl.T), run as one float32 GEMM over the parts
laid side by side ([xh | xl | xh] @ [wh | wh | wl].T, three times the inner dimension, the split of x timed)
with torch's `torch.backends.mkldnn.matmul.fp32_precision = "bf16"`, which lets oneDNN round float32 GEMM inputs
to bf16: the parts are bf16 values, so nothing is lost, and a CPU whose oneDNN honours the mode runs the GEMM
on its bf16 units. Quality of that arithmetic over LoCoMo: bench_dtype_quality.py --dtype bf16x3. The errors
(`*_rel_err`: max abs difference to a float64 product over the largest float64 value) tell whether the mode
took effect: `fpmath_bf16_rel_err` is the plain float32 layer under the mode, about 1e-3 where oneDNN rounds to
bf16 and float32's own error where it ignores the mode (`fpmath_bf16_applied`); `bf16x3_rel_err` should stay
near float32's either way. `onednn_over_bf16x3` > 1 means split bf16 is faster than our float32 path here.

    PYTHONPATH=. .venv/bin/python experiments/bench_gemm.py

Last line: JSON with the CPU model, and per thread count and shape the two times and their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from memfit_gpu import onednn

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


@contextmanager
def fp32_precision(mode: str) -> Iterator[None]:
    """torch.backends.mkldnn.matmul.fp32_precision set to `mode` for the block (a process-wide setting)."""
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = mode
    try:
        yield
    finally:
        matmul.fp32_precision = before


def split_bf16(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `t` as hi + lo, each a float32 tensor of bf16 values."""
    hi = t.to(torch.bfloat16).float()
    return hi, (t - hi).to(torch.bfloat16).float()


def stacked_split_weight(weight: torch.Tensor) -> torch.Tensor:
    """[wh | wh | wl] of a float32 weight [out, in]: the right operand of `bf16x3_linear`, [out, 3 * in]."""
    wh, wl = split_bf16(weight)
    return torch.cat([wh, wh, wl], dim=1).contiguous()


def bf16x3_linear(x: torch.Tensor, stacked_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + bias as xh @ wh.T + xl @ wh.T + xh @ wl.T: one GEMM over [xh | xl | xh] and
    `stacked_weight` = [wh | wh | wl] (call under fp32_precision("bf16"))."""
    xh, xl = split_bf16(x)
    return torch.nn.functional.linear(torch.cat([xh, xl, xh], dim=-1), stacked_weight, bias)


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).abs().max() / exact.abs().max())


def split_bf16_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, repeats: int, inner: int,
                    t_onednn: float) -> dict:
    """Split bf16's time and the errors that say whether oneDNN took the bf16 mode (module docstring)."""
    exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    stacked = stacked_split_weight(weight)
    with torch.inference_mode():
        plain_err = relative_error(torch.nn.functional.linear(x, weight, bias), exact)
        with fp32_precision("bf16"):
            fpmath_err = relative_error(torch.nn.functional.linear(x, weight, bias), exact)
            split_err = relative_error(bf16x3_linear(x, stacked, bias), exact)
            t_split = best_of(repeats, inner, lambda: bf16x3_linear(x, stacked, bias))
    return {"bf16x3_ms": round(t_split * 1e3, 3), "onednn_over_bf16x3": round(t_onednn / t_split, 3),
            "fp32_rel_err": plain_err, "fpmath_bf16_rel_err": fpmath_err, "bf16x3_rel_err": split_err,
            "fpmath_bf16_applied": fpmath_err > 10 * plain_err}


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
                   "gflops_bf16": round(2 * tokens * fan_in * fan_out / t_bf16 / 1e9, 1),
                   **split_bf16_rows(x, weight, bias, args.repeats, args.inner, t_onednn)}
            rows.append(row)
            print(f"threads={threads} {row['shape']:>16}: oneDNN {row['onednn_ms']:8.3f} ms  MKL {row['mkl_ms']:8.3f} ms"
                  f"  MKL/oneDNN {row['mkl_over_onednn']:.2f}  bf16 {row['bf16_ms']:8.3f} ms"
                  f"  oneDNN/bf16 {row['onednn_over_bf16']:.2f}  bf16x3 {row['bf16x3_ms']:8.3f} ms"
                  f"  oneDNN/bf16x3 {row['onednn_over_bf16x3']:.2f}"
                  f"  (bf16 mode {'taken' if row['fpmath_bf16_applied'] else 'ignored'})", flush=True)
    result = {"cpu": cpu_model(), "torch": torch.__version__, "rows": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
