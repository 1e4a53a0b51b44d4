"""experiments/bench_gemm.py at its real shapes, one timing each: every row's figures are there, oneDNN's
float32 layer equals F.linear's, and split bf16 (three bf16 products summed in float32) stays near float32's
error whether or not this CPU's oneDNN takes the bf16 mode. The timings themselves are
docs/benchmarks/history.md's."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
import bench_gemm  # noqa: E402


def test_the_gemm_benchmark_reports_every_figure_and_leaves_torchs_precision_as_it_was() -> None:
    before = torch.backends.mkldnn.matmul.fp32_precision
    result = bench_gemm.main(["--threads", "1", "--repeats", "1", "--inner", "1"])
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    assert result["cpu"] and [row["shape"] for row in result["rows"]] == [
        "2048x384->1536", "2048x1536->384", "2048x384->384"]
    for row in result["rows"]:
        assert all(row[key] > 0 for key in ("onednn_ms", "mkl_ms", "bf16_ms", "bf16x3_ms", "onednn_over_bf16x3"))
        assert row["max_abs_diff"] < 1e-3 and row["fp32_rel_err"] < 1e-6
        # 2^-16 of each product at worst (the lo*lo term dropped), bf16 alone is ~2^-9
        assert row["bf16x3_rel_err"] < 2e-5


def test_split_bf16_linear_is_the_three_products() -> None:
    generator = torch.Generator().manual_seed(1)
    x, weight, bias = torch.randn(5, 16, generator=generator), torch.randn(7, 16, generator=generator), torch.randn(7)
    (xh, xl), (wh, wl) = bench_gemm.split_bf16(x), bench_gemm.split_bf16(weight)
    stacked = bench_gemm.stacked_split_weight(weight)
    assert torch.equal(stacked, torch.cat([wh, wh, wl], dim=1))
    expected = (xh.double() @ wh.double().T + xl.double() @ wh.double().T + xh.double() @ wl.double().T
                + bias.double())
    assert torch.allclose(bench_gemm.bf16x3_linear(x, stacked, bias).double(), expected, rtol=0, atol=1e-5)
    assert float((expected - (x.double() @ weight.double().T + bias.double())).abs().max()) < 1e-3


def test_split_bf16_parts_are_bf16_values_that_sum_to_the_float32_value() -> None:
    t = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * 10
    hi, lo = bench_gemm.split_bf16(t)
    assert hi.dtype == lo.dtype == torch.float32
    assert torch.equal(hi, hi.bfloat16().float()) and torch.equal(lo, lo.bfloat16().float())
    # hi carries bf16's 8 bits, lo the next 8: together ~16 bits of t's 24
    assert float(((hi + lo - t).abs() / t.abs()).max()) < 2**-15 < float(((hi - t).abs() / t.abs()).max())
