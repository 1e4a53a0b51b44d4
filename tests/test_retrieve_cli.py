"""`memfit retrieve` end to end on one real LoCoMo conversation (real encoder, real indexes)."""

from __future__ import annotations

import json

import pytest

from memfit_gpu.cli import main
from memfit_gpu.models import MissingWeightsError, resolve

pytestmark = pytest.mark.slow


def _cross_encoder_available() -> bool:
    try:
        resolve("cross-encoder", "cross-encoder/ms-marco-MiniLM-L-6-v2")
    except MissingWeightsError:
        return False
    return True


def test_retrieve_writes_packs_and_diagnostics(tmp_path, locomo_path, capsys) -> None:
    out = tmp_path / "r"
    rc = main(["retrieve", "--config", "configs/memfit.yaml", "--benchmark", "locomo", "--data", str(locomo_path),
               "--out", str(out), "--limit-memories", "1", "--limit-questions", "12", "rerank.backend=none"])
    assert rc == 0
    lines = [json.loads(line) for line in (out / "packs.jsonl").read_text().splitlines()]
    diagnostics = json.loads((out / "diagnostics.json").read_text())
    assert len(lines) == 12 and {row["memory_id"] for row in lines} == {"conv-26"}
    overall = diagnostics["overall"]
    assert diagnostics["questions_total"] == 12
    assert overall["questions"] + diagnostics["questions_without_evidence"] \
        + diagnostics["questions_with_only_unmatched_evidence"] == 12
    assert overall["hit@30"] >= overall["pack_hit"] > 0
    assert overall["pack_hit_window"] >= overall["pack_hit"]
    assert diagnostics["reranker"]["backend"] == "none" and diagnostics["summaries_used"] is False
    first = lines[0]
    assert first["question"] == "When did Caroline go to the LGBTQ support group?"
    assert first["excerpts"].startswith("EXCERPT 1 (recorded ")
    assert first["ranked"][0]["kind"] == "episode" and first["ranked"][0]["source"] == "pool"
    assert len(first["pack"]["selected"]) == 10
    # the one gold turn of this question (D1:3, "I went to a LGBTQ support group yesterday") is ranked first
    assert first["evidence"] == ["D1:3"] and first["ranked"][0]["turn_id"] == "D1:3"
    assert "yesterday (7 May 2023)" in first["excerpts"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["reranker"] == "none"


def test_retrieve_without_cross_encoder_weights_fails_clearly(tmp_path, locomo_path, capsys) -> None:
    if _cross_encoder_available():
        pytest.fail("cross-encoder weights are present here: this test expects an offline machine without them")
    rc = main(["retrieve", "--config", "configs/memfit.yaml", "--benchmark", "locomo", "--data", str(locomo_path),
               "--out", str(tmp_path / "r"), "--limit-memories", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "cross-encoder/ms-marco-MiniLM-L-6-v2" in err and "rerank.backend=none" in err
    assert not (tmp_path / "r").exists()
