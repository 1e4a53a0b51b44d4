"""readers/cpu_attention.py: a bf16/fp16 reader's one-new-token attention on the CPU, against SDPA in float32,
and the real SmolLM2 switched to it by the transformers backend; the CPU's generate batches (similar lengths)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from memfit_gpu.config import ReaderConfig
from memfit_gpu.readers import cpu_attention
from memfit_gpu.readers.transformers import CPU_PADDED_PER_REAL, TransformersBackend, length_batches
from memfit_gpu.readers.types import Request

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


class _Module(torch.nn.Module):
    """What an attention function reads of its module (transformers' Llama attention)."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _qkv(dtype: torch.dtype, batch: int = 3, heads: int = 9, kv_heads: int = 3, positions: int = 1,
         length: int = 70, dim: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(shape, generator=gen).to(dtype) for shape in
                 ((batch, heads, positions, dim), (batch, kv_heads, length, dim), (batch, kv_heads, length, dim)))


def _reference(query, key, value, keep: torch.Tensor | None) -> torch.Tensor:
    """float64 attention of the same (rounded) inputs, [B, Q, H, D]."""
    groups = query.shape[1] // key.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (key, value))
    scores = query.double() @ k.transpose(-1, -2) / math.sqrt(query.shape[-1])
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_one_new_token_equals_attention_in_float64_within_the_dtype(dtype, mask) -> None:
    query, key, value = _qkv(dtype)
    keep = torch.ones(3, 1, 1, 70, dtype=torch.bool)
    keep[0, ..., :25] = False  # a left-padded row
    keep[2, ..., :3] = False
    given = {"none": None, "bool": keep,
             "float": torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)}[mask]
    out, weights = cpu_attention.attention(_Module(3), query, key, value, given, scaling=64 ** -0.5)
    want = _reference(query, key, value, None if mask == "none" else keep)
    assert weights is None and out.shape == (3, 1, 9, 64) and out.dtype == dtype and out.is_contiguous()
    # the output is rounded once to the dtype (8 bits of mantissa for bf16, 11 for fp16); |values| < 4 here
    tolerance = 4 * 2 ** -8 if dtype == torch.bfloat16 else 4 * 2 ** -11
    assert (out.double() - want).abs().max().item() < tolerance
    # and the kept positions are exactly the mask's: a padded key changes nothing
    if mask != "none":
        changed = key.clone()
        changed[0, :, :25] = 100
        again, _ = cpu_attention.attention(_Module(3), query, changed, value, given, scaling=64 ** -0.5)
        assert torch.equal(again, out)


@pytest.mark.parametrize("case", ["prefill", "float32", "dropout"])
def test_every_other_case_is_transformers_sdpa_bit_for_bit(case) -> None:
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    query, key, value = _qkv(dtype, positions=5 if case == "prefill" else 1)
    kwargs = {"dropout": 0.5} if case == "dropout" else {}
    torch.manual_seed(1)
    ours, _ = cpu_attention.attention(_Module(3), query, key, value, None, scaling=0.125, **kwargs)
    torch.manual_seed(1)
    theirs, _ = sdpa_attention_forward(_Module(3), query, key, value, None, scaling=0.125, **kwargs)
    assert torch.equal(ours, theirs)


def test_the_decode_case_differs_from_sdpa_only_by_rounding() -> None:
    query, key, value = _qkv(torch.bfloat16, length=1500)
    ours, _ = cpu_attention.attention(_Module(3), query, key, value, None, scaling=0.125)
    sdpa = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), scale=0.125,
                                          enable_gqa=True).transpose(1, 2)
    assert (ours.float() - sdpa).abs().max().item() < 2 ** -7


@pytest.mark.slow
def test_the_transformers_reader_runs_bf16_with_it_on_the_cpu_and_answers(monkeypatch) -> None:
    monkeypatch.setattr("memfit_gpu.devices.cpu_native_bf16", lambda: True)  # as on this project's CPUs
    reader = TransformersBackend(ReaderConfig(backend="transformers", model=MODEL, max_new_tokens=12), device="cpu")
    reader.load()
    assert reader.net.dtype == torch.bfloat16 and reader.attention == cpu_attention.NAME
    question = Request([{"role": "user", "content": "What is the capital of France?"}], role="answer", key="q")
    answer = reader.generate([question])[0]
    assert "Paris" in answer.text, answer.text
    # the same model in SDPA gives the same next-token distribution up to bf16 rounding
    ids = torch.tensor([reader._prompt_ids(question)])

    def decode_step_logits() -> torch.Tensor:  # the prompt's last token as a decode step over the cached rest
        with torch.inference_mode():
            cache = reader.net(input_ids=ids[:, :-1], use_cache=True).past_key_values
            return reader.net(input_ids=ids[:, -1:], past_key_values=cache).logits[0, -1].float()

    ours = decode_step_logits()
    reader.net.set_attn_implementation("sdpa")
    sdpa = decode_step_logits()
    print(f"decode-step logits: max |ours - sdpa| {(ours - sdpa).abs().max().item():.4f}, range {sdpa.min():.1f}..{sdpa.max():.1f}")
    assert ours.argmax() == sdpa.argmax()
    assert (ours - sdpa).abs().max().item() < 0.05 * (sdpa.max() - sdpa.min()).item()  # 1.8 % measured
    # float32 asked: plain SDPA, as before
    fp32 = TransformersBackend(ReaderConfig(backend="transformers", model=MODEL, dtype="float32"), device="cpu")
    fp32.load()
    assert fp32.net.dtype == torch.float32 and fp32.attention == "sdpa"


def test_cpu_batches_hold_prompts_of_similar_length_and_a_gpu_batch_any() -> None:
    lengths = [1700, 900, 1300, 2300, 1500, 1500, 40, 41]
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    cpu = length_batches(lengths, order, 8, CPU_PADDED_PER_REAL)
    assert cpu == [[6, 7], [1, 2, 4, 5, 0], [3]]  # 2,300 beside the rest would pad 23 % more
    assert sorted(i for batch in cpu for i in batch) == list(range(8))  # every prompt once
    for batch in cpu:  # padded width x rows within the slack of the real tokens
        assert len(batch) * max(lengths[i] for i in batch) <= CPU_PADDED_PER_REAL * sum(lengths[i] for i in batch)
    assert length_batches(lengths, order, 3, None) == [[6, 7, 1], [2, 4, 5], [0, 3]]  # by count only
    assert length_batches(lengths, order, 2, CPU_PADDED_PER_REAL) == [[6, 7], [1, 2], [4, 5], [0, 3]]
    assert length_batches([40, 400], [0, 1], 8, CPU_PADDED_PER_REAL) == [[0], [1]]  # 800 padded for 440 real
    assert length_batches([], [], 4, CPU_PADDED_PER_REAL) == []


@pytest.mark.slow
def test_a_cpu_batch_is_read_row_by_row_then_decoded_together(monkeypatch) -> None:
    """Each prompt of a CPU batch but its last token is read alone (no padding, causal attention); the caches,
    left-padded, hold exactly those rows; the batch then decodes together, each row as if read alone."""
    reader = TransformersBackend(ReaderConfig(backend="transformers", model=MODEL, dtype="float32",
                                              max_new_tokens=6, batch_size=4), device="cpu")
    questions = ["What is the capital of France?", "Name three colours of the rainbow, please, in order.",
                 "Say hello."]
    requests = [Request([{"role": "user", "content": q}], role="answer", key=f"q{i}") for i, q in enumerate(questions)]
    reader.load()
    assert reader.rows_alone  # SmolLM2's cache is plain keys and values
    prompts = [reader._prompt_ids(r) for r in requests]
    width = max(len(p) for p in prompts)
    with torch.inference_mode():
        merged = reader._prefilled_rows(prompts, width)
        for row, ids in enumerate(prompts):
            alone = reader.net(input_ids=torch.tensor([ids[:-1]]), use_cache=True).past_key_values
            for layer in (0, len(alone.layers) - 1):
                keys = merged.layers[layer].keys[row]
                pad = width - len(ids)
                assert keys.shape[-2] == width - 1 and not keys[:, :pad].any()
                assert torch.equal(keys[:, pad:], alone.layers[layer].keys[0])
                assert torch.equal(merged.layers[layer].values[row, :, pad:], alone.layers[layer].values[0])
    calls: list[int] = []
    original = reader._prefilled_rows
    monkeypatch.setattr(reader, "_prefilled_rows", lambda p, w: calls.append(len(p)) or original(p, w))
    together = reader.generate(requests)
    assert calls == [3]  # one batch (similar lengths), read row by row
    alone = [reader.generate([r])[0] for r in requests]
    assert calls == [3]  # a batch of one is never padded: read as it is
    assert [r.text for r in together] == [r.text for r in alone]
    assert [r.input_tokens for r in together] == [len(p) for p in prompts]
