"""experiments/bench_online.py (issue 22) on a tiny setting: the first turns of LoCoMo's conv-26, memfit
only, no reader, 1 and 2 concurrent clients, one torch thread (this suite shares its cores). It checks the JSON has every figure (and the targets as
booleans with their thresholds), and that the batched and the one-at-a-time server return the same hits
for the same queries. The figures themselves are docs/benchmarks.md's, not this test's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
import bench_online  # noqa: E402

pytestmark = pytest.mark.slow  # starts two real `memfit serve` processes with real MiniLM weights

PERCENTILES = ("p50_ms", "p95_ms", "p99_ms")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if not bench_online.DEFAULT_DATA.is_file():
        pytest.skip(f"LoCoMo is not at {bench_online.DEFAULT_DATA}")
    out = tmp_path_factory.mktemp("bench") / "online.json"
    return bench_online.main(["--turns", "12", "--methods", "memfit", "--no-reader", "--clients", "1", "2",
                              "--requests", "6", "--threads", "1", "--work-dir", str(out.parent / "work"), "--json-out", str(out)])


def test_every_figure_is_there(result: dict) -> None:
    assert result["turns"] == 12 and result["questions"] >= 2 and result["conversations"] == ["conv-26"]
    for path in ("api", "http"):
        figures = result["replay"]["memfit"][path]
        assert figures["insert"]["n"] == 12 and figures["search"]["n"] == result["questions"]
        for kind in ("insert", "search"):
            assert all(figures[kind][p] > 0 for p in PERCENTILES)
        assert figures["e2e"] is None  # --no-reader
    assert [(r["method"], r["path"]) for r in result["table"]] == [("memfit", "api"), ("memfit", "http")]
    assert all(r[f"{kind}_{p}"] > 0 for r in result["table"] for kind in ("insert", "retrieval") for p in PERCENTILES)
    levels = result["concurrency"]["levels"]
    assert [lv["clients"] for lv in levels] == [1, 2]
    for lv in levels:
        for server in ("batched", "unbatched"):
            assert lv[server]["throughput_rps"] > 0 and all(lv[server][p] > 0 for p in PERCENTILES)
        assert lv["throughput_ratio"] > 0 and lv["p95_ratio"] > 0 and lv["batched"]["mean_batch"] >= 1
    assert set(result["targets"]) == {"memfit/api/insert_p50_ms", "memfit/api/search_p50_ms",
                                      "memfit/api/search_p95_ms"}  # no 16-client level in this setting
    assert all(isinstance(t["held"], bool) and ("target_max" in t or "target_min" in t)
               for t in result["targets"].values())
    assert isinstance(result["targets_held"], bool)


def test_the_batched_and_the_unbatched_server_find_the_same_hits(result: dict) -> None:
    same = result["concurrency"]["identical_results"]
    assert same["queries"] >= 2 and same["identical"] == same["queries"] and result["identical_results"] is True
    assert same["max_score_diff"] < 1e-4
