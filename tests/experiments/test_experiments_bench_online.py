"""experiments/bench_online.py on a tiny setting: the first turns of LoCoMo's conv-26, memfit and the
live mem0 (its LLM the echo reader), no reader for answers, 1 and 2 concurrent clients, one torch thread (this suite shares its cores). It checks the JSON has every figure (and the targets as
booleans with their thresholds), and that the batched and the one-at-a-time server return the same hits
for the same queries. The figures themselves are docs/benchmarks/history.md's, not this test's."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
import bench_online  # noqa: E402

pytestmark = pytest.mark.slow  # starts two real `memfit serve` processes with real MiniLM weights

PERCENTILES = ("p50_ms", "p95_ms", "p99_ms")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if not bench_online.DEFAULT_DATA.is_file():
        pytest.skip(f"LoCoMo is not at {bench_online.DEFAULT_DATA}")
    out = tmp_path_factory.mktemp("bench") / "online.json"
    # mem0's LLM is the echo reader (tests/seam_echo_backend.py, here and in its server): its extraction replies
    # in no time, so the replay checks the machinery; the figures of a real reader are docs/benchmarks/history.md's
    import seam_echo_backend  # noqa: F401

    plugins = os.environ.get("MEMFIT_PLUGINS"), os.environ.get("PYTHONPATH")
    os.environ["MEMFIT_PLUGINS"] = "seam_echo_backend"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "tests"), plugins[1]) if p)
    try:
        return bench_online.main(["--turns", "12", "--methods", "memfit", "mem0", "--no-reader", "--clients", "1", "2",
                                  "--requests", "6", "--threads", "1", "--work-dir", str(out.parent / "work"),
                                  "--json-out", str(out), "reader.backend=echo"])
    finally:
        for name, value in zip(("MEMFIT_PLUGINS", "PYTHONPATH"), plugins, strict=True):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_every_figure_is_there(result: dict) -> None:
    assert result["turns"] == 12 and result["questions"] >= 2 and result["conversations"] == ["conv-26"]
    for method in ("memfit", "mem0"):
        for path in ("api", "http"):
            figures = result["replay"][method][path]
            assert figures["insert"]["n"] == 12 and figures["search"]["n"] == result["questions"]
            for kind in ("insert", "search"):
                assert all(figures[kind][p] > 0 for p in PERCENTILES)
            assert figures["e2e"] is None  # --no-reader
    assert [(r["method"], r["path"]) for r in result["table"]] == [
        ("memfit", "api"), ("memfit", "http"), ("mem0", "api"), ("mem0", "http")]
    for path in ("api", "http"):  # the peer over our first method, from the same run's percentiles
        ratios, theirs, ours = result["peer_ratios"][f"mem0/{path}"], result["replay"]["mem0"][path], \
            result["replay"]["memfit"][path]
        assert ratios["over"] == "memfit" and set(ratios) == {"over", "insert_p50_x", "insert_p95_x", "search_p50_x",
                                                              "search_p95_x"}
        assert ratios["insert_p50_x"] == round(theirs["insert"]["p50_ms"] / ours["insert"]["p50_ms"], 1)
        assert ratios["search_p95_x"] == round(theirs["search"]["p95_ms"] / ours["search"]["p95_ms"], 1)
    assert all(r[f"{kind}_{p}"] > 0 for r in result["table"] for kind in ("insert", "retrieval") for p in PERCENTILES)
    levels = result["concurrency"]["levels"]
    assert [lv["clients"] for lv in levels] == [1, 2]
    for lv in levels:
        for server in ("batched", "unbatched"):
            assert lv[server]["throughput_rps"] > 0 and all(lv[server][p] > 0 for p in PERCENTILES)
        assert lv["throughput_ratio"] > 0 and lv["p95_ratio"] > 0 and lv["batched"]["mean_batch"] >= 1
    assert set(result["targets"]) == {"memfit/api/insert_p50_ms", "memfit/api/search_p50_ms",
                                      "memfit/api/search_p95_ms"}  # no 16-client level here; the peer has none
    assert all(isinstance(t["held"], bool) and ("target_max" in t or "target_min" in t)
               for t in result["targets"].values())
    assert isinstance(result["targets_held"], bool)


def test_the_batched_and_the_unbatched_server_find_the_same_hits(result: dict) -> None:
    same = result["concurrency"]["identical_results"]
    assert same["queries"] >= 2 and same["identical"] == same["queries"] and result["identical_results"] is True
    assert same["max_score_diff"] < 1e-4
