"""`memfit run` refuses what cannot work with one line and exit code 2, before any work, leaving the run
directory free for the corrected command."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from memfit_gpu.cli import main
from memfit_gpu.files import read_jsonl
from memfit_gpu.readers.prompts import bounded_answer_messages, prompt_chars

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke.yaml")


@pytest.fixture(autouse=True)
def _data(shared_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))


def _refused(out: Path, overrides: list[str], capsys: pytest.CaptureFixture[str], command: str = "run") -> str:
    """Run `memfit run` (or retrieve), expect exit code 2 and one error line; return that line."""
    args = ["run", "--config", SMOKE, "--out", str(out), "--quiet"] if command == "run" else \
        ["retrieve", "--config", SMOKE, "--benchmark", "locomo", "--out", str(out)]
    assert main(args + overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"memfit {command}: error: "), err
    # nothing that would make the corrected command refuse this directory
    assert not (out / "config.yaml").exists() and not (out / "store").exists()
    return err[0]


@pytest.mark.parametrize(
    "override, message",
    [
        ("pack.k=-1", "pack.k=-1 is out of range: it must be >= 1"),
        ("retrieve.alpha=1.5", "retrieve.alpha=1.5 is out of range: it must be in [0, 1]"),
        ("retrieve.scan_top_k=0", "retrieve.scan_top_k=0 is out of range: it must be >= 1"),
        ("retrieve.prf.docs=-1", "retrieve.prf.docs=-1 is out of range: it must be >= 1"),
        ("rerank.rerank_pool=-1", "rerank.rerank_pool=-1 is out of range: it must be >= 1"),
        ("data.limit_questions=-1", "data.limit_questions=-1 is out of range: it must be >= 1 or null"),
        ("data.benchmark=locomoo", "data.benchmark='locomoo' is not one of locomo, longmemeval, memgallery"),
        ("reader.backend=openai", "reader.backend=openai needs reader.base_urls"),
    ],
)
def test_bad_values_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str,
                                        message: str) -> None:
    line = _refused(tmp_path / "r", [override], capsys)
    assert f"overrides ['{override}']: {message}" in line
    assert not (tmp_path / "r").exists()  # refused while reading the configuration: nothing made


def test_gpu_device_without_that_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(tmp_path / "r", [f"index.device=cuda:{torch.cuda.device_count() + 1}"], capsys)
    assert "index.device='cuda:" in line and "cannot be used here" in line and "torch sees" in line


def test_cuda_device_on_a_machine_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # fault: this machine has no CUDA
    line = _refused(tmp_path / "r", ["index.device=cuda"], capsys)
    assert line == ("memfit run: error: index.device='cuda' cannot be used here: device='cuda' asked for GPUs but "
                    "torch sees none (index.device=auto takes every visible GPU, else the CPU)")
    assert _refused(tmp_path / "q", ["index.device=cuda"], capsys, command="retrieve") == line.replace(
        "memfit run", "memfit retrieve")


def test_missing_cross_encoder_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(tmp_path / "r", ["rerank.backend=cross-encoder", "rerank.model=memfit-tests/no-such-reranker"],
                    capsys)
    assert "No weights found for cross-encoder model 'memfit-tests/no-such-reranker'" in line
    assert "rerank.backend=none" in line  # the way out is in the message


def test_missing_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(tmp_path / "r", [f"data.path={tmp_path / 'nowhere.json'}"], capsys)
    assert "nowhere.json does not exist" in line


def test_unreachable_openai_server_fails_before_the_store_is_built(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    line = _refused(tmp_path / "r", ["reader.backend=openai", f"reader.base_urls=[{dead}]"], capsys)
    assert f"reader.base_urls[0]='{dead}' is not reachable: GET {dead}/models failed" in line
    assert "ConnectError" in line


def test_prompt_bound_below_the_template(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(tmp_path / "r", ["reader.max_prompt_chars=100"], capsys)
    assert "reader.max_prompt_chars=100 leaves no room for excerpts: the answer prompt answer.txt alone holds" in line


@pytest.mark.slow
def test_corrected_rerun_in_the_same_directory_finishes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r"
    few = ["data.limit_questions=1", "reader.max_new_tokens=4"]
    _refused(out, ["pack.k=-1", *few], capsys)
    # a selection naming a category by its name (LoCoMo's are selected by id) was refused after config.yaml was written
    line = _refused(out, ["data.include_categories=[multi-hop]", *few], capsys)
    assert line.endswith("data.include_categories: 'multi-hop' is no category of locomo: its categories are "
                         "1 (multi-hop), 2 (temporal), 3 (open-domain), 4 (single-hop), 5 (adversarial); did you mean "
                         "'1' instead of 'multi-hop'?")
    # one that names categories and selects nothing all the same, likewise
    line = _refused(out, ["data.include_categories=[5]", "data.exclude_categories=[5]", *few], capsys)
    assert line.endswith("select no question (its questions' categories: 1, 2, 3, 4, 5)")
    _refused(out, ["rerank.backend=cross-encoder", "rerank.model=memfit-tests/no-such-reranker", *few], capsys)
    # corrected, and with a prompt bound that cuts: the prediction row records what was cut
    assert main(["run", "--config", SMOKE, "--out", str(out), "--quiet", "pack.k=3", "reader.max_prompt_chars=1200",
                 *few]) == 0
    assert (out / "DONE").is_file()
    (row,) = read_jsonl(out / "predictions.jsonl")
    (pack,) = read_jsonl(out / "packs.jsonl")
    messages, cut = bounded_answer_messages(row["question"], pack["excerpts"], None, row["category"],
                                            max_prompt_chars=1200)
    assert row["prompt_chars_cut"] == cut > 0 and prompt_chars(messages) == 1200
