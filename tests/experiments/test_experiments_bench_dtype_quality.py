"""experiments/bench_dtype_quality.py on a tiny setting (the first sessions of LoCoMo's conv-26, a dozen
questions, a few rerank pairs, one torch thread): every figure is there, in range, float32's batched =
one-at-a-time identity holds and bf16's stays within bf16's noise. The figures themselves are docs/benchmarks/history.md's ("Encoders in bf16")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support.data import write_small_locomo

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
import bench_dtype_quality  # noqa: E402

pytestmark = pytest.mark.slow  # loads the real MiniLM weights four times (~10 s)


def test_the_dtype_quality_benchmark_reports_every_figure(tmp_path: Path, shared_data: Path) -> None:
    if not (shared_data / "locomo" / "locomo10.json").is_file():
        pytest.skip(f"LoCoMo is not under {shared_data}")
    data = write_small_locomo(shared_data, tmp_path, questions=12)
    result = bench_dtype_quality.main(["--data", str(data), "--ce-questions", "2", "--ce-candidates", "12",
                                       "--ce-one-at-a-time", "4", "--threads", "1"])
    bi, ce = result["bi_encoder"], result["cross_encoder"]
    assert result["cpu"] and (bi["float32"]["dtype"], bi["other"]["dtype"]) == ("float32", "bfloat16")
    assert bi["float32"]["questions"] == bi["other"]["questions"] == 12
    for run in (bi["float32"], bi["other"]):
        assert all(0 <= run[key] <= 1 for key in ("hit@5", "hit@10", "pack_hit", "one_at_a_time_equal_packs",
                                                   "one_at_a_time_equal_top10"))
    for key in ("hit@5", "hit@10", "pack_hit"):
        assert bi[f"{key}_diff_points"] == pytest.approx(100 * (bi["other"][key] - bi["float32"][key]), abs=1e-3)
    assert 0 <= bi["equal_top10"] <= bi["equal_top10_set"] <= 1 and 0 < bi["episode_vectors_max_abs_diff"] < 0.05
    # float32: one text at a time gives the batched embeddings (to GEMM blocking's last bits) and the same packs
    assert bi["float32"]["one_at_a_time_max_abs_diff"] < 1e-5 and bi["float32"]["one_at_a_time_equal_packs"] == 1
    # bf16: the identity is replaced by bf16's noise (docs/benchmarks/history.md: 1.5e-3 over LoCoMo, 99 % of packs equal)
    assert bi["other"]["one_at_a_time_max_abs_diff"] < 5e-3
    assert ce["pairs"] == 24 and ce["questions"] == 2 and ce["dtype"] == "bfloat16" and ce["one_at_a_time_pairs"] == 4
    assert 0 < ce["max_abs_score_diff"] < 1 and 0 <= ce["equal_top10"] <= ce["equal_top10_set"] <= 1
    assert ce["float32_one_at_a_time_max_abs_diff"] < 1e-4 and ce["other_one_at_a_time_max_abs_diff"] < 4e-3


def test_split_bf16_keeps_float32s_figures_on_the_tiny_setting(tmp_path: Path, shared_data: Path) -> None:
    """--dtype bf16x3: the encoders' linear layers as three bf16 products summed in float32. Its noise is two
    orders below bf16's, so even a dozen questions keep float32's packs and the pairs' top-10s."""
    if not (shared_data / "locomo" / "locomo10.json").is_file():
        pytest.skip(f"LoCoMo is not under {shared_data}")
    data = write_small_locomo(shared_data, tmp_path, questions=12)
    result = bench_dtype_quality.main(["--data", str(data), "--dtype", "bf16x3", "--ce-questions", "2",
                                       "--ce-candidates", "12", "--ce-one-at-a-time", "4", "--threads", "1"])
    bi, ce = result["bi_encoder"], result["cross_encoder"]
    assert (bi["float32"]["dtype"], bi["other"]["dtype"], ce["dtype"]) == ("float32", "bf16x3 (emulated)",
                                                                           "bf16x3 (emulated)")
    # the split changed the arithmetic (not float32 again), by far less than bf16's 2.8e-3
    assert 0 < bi["episode_vectors_max_abs_diff"] < 5e-5 and 0 < ce["max_abs_score_diff"] < 1e-5
    assert bi["equal_packs"] == bi["equal_top10"] == 1 and ce["equal_top10"] == 1
    assert bi["other"]["one_at_a_time_equal_packs"] == 1 and bi["other"]["one_at_a_time_max_abs_diff"] < 5e-5
    assert all(bi[f"{key}_diff_points"] == 0 for key in ("hit@5", "hit@10", "pack_hit"))

