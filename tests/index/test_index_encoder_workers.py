"""How the packed encoders feed their devices: vectorised padding, host-side token positions, token
budgets by device, and one worker process per device (index.encoder_workers=processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memfit_gpu.config import ConfigError, load_config
from memfit_gpu.index.encoders import BiEncoder, CrossEncoderModule, random_cross_encoder
from memfit_gpu.index.encoders.batching import (
    CPU_BATCH_TOKENS,
    GPU_BATCH_TOKENS,
    Workers,
    default_batch_tokens,
)
from memfit_gpu.index.encoders.packed_bert import FLAT_KEY, bert_body, bert_packed
from memfit_gpu.index.encoders.workers import EncoderWorkerError
from memfit_gpu.store import episode_prefix

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def turns(locomo_path: Path) -> list[str]:
    body = json.loads(locomo_path.read_text())[0]["conversation"]
    return [episode_prefix(body[key + "_date_time"], turn["speaker"]) + turn["text"]
            for key, session in body.items() if key.startswith("session_") and isinstance(session, list)
            for turn in session]


def test_collate_pads_like_the_tokenizer(minilm: BiEncoder, turns: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [5, 2, 17, 40]
    texts = [turns[r] for r in rows]
    tokens = minilm._tokenize(turns[:50], None)
    assert len(tokens) == 50 and tokens.lengths.tolist()[:3] == [len(minilm.tokenizer(t)["input_ids"]) for t in turns[:3]]
    batch = minilm._collate(tokens, rows, CPU)
    expected = minilm.tokenizer(texts, padding=True, truncation=True, max_length=minilm.max_length, return_tensors="pt")
    assert torch.equal(batch["input_ids"], expected["input_ids"])
    assert torch.equal(batch["attention_mask"], expected["attention_mask"])
    # the packed path's token positions come with the batch (no nonzero on the device)
    assert torch.equal(batch[FLAT_KEY], expected["attention_mask"].reshape(-1).nonzero().squeeze(1))
    # what a worker process is sent: the same rows, on their own
    alone = minilm._collate(tokens.take(rows), range(len(rows)), CPU)
    assert all(torch.equal(alone[k], batch[k]) for k in batch)
    # left padding, as a left-padding tokenizer pads
    monkeypatch.setattr(minilm, "_padding_right", False)
    monkeypatch.setattr(minilm, "fast_path", False)
    left = minilm._collate(tokens, rows, CPU)
    minilm.tokenizer.padding_side = "left"
    try:
        expected = minilm.tokenizer(texts, padding=True, truncation=True, max_length=minilm.max_length,
                                    return_tensors="pt")
    finally:
        minilm.tokenizer.padding_side = "right"
    assert FLAT_KEY not in left
    assert torch.equal(left["input_ids"], expected["input_ids"]) and torch.equal(left["attention_mask"], expected["attention_mask"])


def test_pairs_collate_with_token_types(tmp_path: Path, turns: list[str]) -> None:
    module = CrossEncoderModule.from_pretrained(str(random_cross_encoder(tmp_path / "ce")), device="cpu")
    pairs = [("What did Caroline research?", turns[3]), ("When?", turns[9]), ("Who moved?", "short")]
    tokens = module._tokenize([q for q, _ in pairs], [p for _, p in pairs])
    batch = module._collate(tokens, [0, 1, 2], CPU)
    expected = module.tokenizer([q for q, _ in pairs], [p for _, p in pairs], padding=True, truncation="longest_first",
                                max_length=module.max_length, return_tensors="pt")
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert torch.equal(batch[key], expected[key]), key
    # the packed forward gives the same [CLS] states with or without the host-side positions
    body = bert_body(module.model)
    with torch.inference_mode():
        with_flat, flat = bert_packed(body, batch, cls_only=True)
        without = {k: v for k, v in batch.items() if k != FLAT_KEY}
        plain, flat_device = bert_packed(body, without, cls_only=True)
    assert torch.equal(flat, flat_device) and torch.equal(with_flat, plain)


def test_token_budget_and_workers_by_device(minilm: BiEncoder) -> None:
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert default_batch_tokens([CPU]) == CPU_BATCH_TOKENS == 2048
    assert default_batch_tokens(gpus) == GPU_BATCH_TOKENS == 65536
    assert Workers.resolve("auto", gpus) is Workers.PROCESSES  # one GIL cannot feed several GPUs
    assert Workers.resolve("auto", gpus[:1]) is Workers.THREADS
    assert Workers.resolve("auto", [CPU, CPU]) is Workers.THREADS
    assert Workers.resolve("processes", [CPU]) is Workers.PROCESSES
    with pytest.raises(ValueError, match="index.encoder_workers='fork' is not one of auto, threads, processes"):
        Workers.resolve("fork", [CPU])
    # a configured budget wins over the device's default; batches respect both caps
    budget = BiEncoder(minilm.model, minilm.tokenizer, minilm.max_length, [CPU], torch.float32, minilm.pooling,
                       minilm.normalize, loaded_from=minilm.loaded_from, batch_tokens=300)
    tokens = budget._tokenize(["word " * n for n in range(1, 60)], None)
    batches = budget._batches(tokens, batch_size=8)
    widths = tokens.lengths
    assert sorted(r for b in batches for r in b) == list(range(59))
    assert all(len(b) <= 8 and len(b) * widths[b[0]] <= 300 for b in batches if len(b) > 1)
    with pytest.raises(ValueError, match="batch_tokens must be >= 0"):
        BiEncoder(minilm.model, minilm.tokenizer, 8, [CPU], torch.float32, ["mean"], True, batch_tokens=-1)


def test_config_names_the_batching_keys(tmp_path: Path) -> None:
    cfg = load_config(None, [])
    assert (cfg.index.encode_batch_size, cfg.index.encode_batch_tokens, cfg.index.encoder_workers) == (1024, 0, "auto")
    with pytest.raises(ConfigError, match="index.encoder_workers"):
        load_config(None, ["index.encoder_workers=fork"])
    with pytest.raises(ConfigError, match="index.encode_batch_tokens"):
        load_config(None, ["index.encode_batch_tokens=-5"])


@pytest.mark.slow
def test_worker_processes_encode_like_one_device(minilm: BiEncoder, turns: list[str]) -> None:
    """Two CPU devices, one process each: the same vectors as one device, both processes used, the pool
    kept between calls; a worker that dies is an error naming its device, not a hang; close stops all."""
    pair = BiEncoder(minilm.model, minilm.tokenizer, minilm.max_length, [CPU, CPU], torch.float32, minilm.pooling,
                     minilm.normalize, loaded_from=minilm.loaded_from, workers="processes")
    assert pair.workers is Workers.PROCESSES and len(pair._replicas) == 1 and pair.info()["workers"] == "processes"
    texts = turns[:240]
    try:
        vectors = pair.encode(texts, batch_size=8)
        pool = pair._pool
        assert pool is not None and len(pool.served) == 2 and sum(pool.served.values()) == len(pair._batches(
            pair._tokenize(texts, None), 8))
        torch.testing.assert_close(vectors, minilm.encode(texts, batch_size=8), atol=1e-6, rtol=0)
        again = pair.encode(texts[:20], batch_size=8)
        assert pair._pool is pool
        torch.testing.assert_close(again, vectors[:20], atol=1e-6, rtol=0)
        os.kill(pool.processes[0].pid, signal.SIGKILL)
        pool.processes[0].join(timeout=30)
        with pytest.raises(EncoderWorkerError, match=r"encoder worker on cpu has died \(exit code -9\)"):
            pair.encode(texts[:20])
    finally:
        processes = list(pair._pool.processes) if pair._pool is not None else []
        pair.close()
    assert processes and not any(p.is_alive() for p in processes) and pair._pool is None


@pytest.mark.slow
def test_worker_processes_score_pairs_like_one_device(tmp_path: Path, turns: list[str]) -> None:
    folder = random_cross_encoder(tmp_path / "ce", seed=5)
    one = CrossEncoderModule.from_pretrained(str(folder), device="cpu")
    two = CrossEncoderModule.from_pretrained(str(folder), device="cpu,cpu", workers="processes")
    pairs = [(q, t) for q in ("What did Caroline research?", "When did Melanie paint?") for t in turns[:60]]
    try:
        torch.testing.assert_close(two.score(pairs, batch_size=16), one.score(pairs, batch_size=16), atol=1e-5, rtol=0)
        assert len(two._pool.served) == 2
    finally:
        two.close()


ORPHAN_PARENT = """
import sys, time, torch
from memfit_gpu.index.encoders import BiEncoder
if __name__ == "__main__":
    one = BiEncoder.from_pretrained("sentence-transformers/all-MiniLM-L6-v2", device="cpu")
    two = BiEncoder(one.model, one.tokenizer, one.max_length, [torch.device("cpu")] * 2, torch.float32, one.pooling,
                    one.normalize, loaded_from=one.loaded_from, workers="processes")
    two.encode(["a first text", "a second one"])
    print(" ".join(str(p.pid) for p in two._pool.processes), flush=True)
    time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie nobody reaps has exited too)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


@pytest.mark.slow
def test_workers_exit_when_their_parent_is_killed(tmp_path: Path) -> None:
    """A parent killed with SIGKILL cannot stop its workers: they notice and exit, freeing their devices."""
    script = tmp_path / "parent.py"
    script.write_text(ORPHAN_PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
    finally:
        parent.kill()
        parent.wait(timeout=30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.5)
    assert all(_gone(p) for p in pids), f"workers {pids} outlived their killed parent"
