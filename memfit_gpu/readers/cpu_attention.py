"""Attention for an in-process reader computing in bf16 or fp16 on the CPU: transformers' SDPA but one case.

torch's CPU flash-attention kernel is slow for ONE query position in reduced precision: a decode step of
SmolLM2-135M (9 query heads over 3 key/value heads, 64 dims) against 1,500 cached tokens, 5 sequences,
one thread, takes 8.5 ms a layer in bf16 against 0.9 ms in fp32 (2026-12-02, AMD EPYC with AVX512-BF16),
so in bf16 generation spent most of each new token there. For that case this computes the grouped-query
product itself (0.9 ms): scores = q . K^T in the model's dtype (each query head against its group's
key/value head, no copy of the cache), softmax in float32 over the kept positions, then . V. Every other
case (a prompt's prefill, float32, GPUs, dropout) goes to transformers' own `sdpa_attention_forward`.

`use_for(net)` switches a loaded model to it when the model runs SDPA on the CPU in bf16/fp16; the mask
it receives is SDPA's (boolean, True = attend), so padding is handled the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "memfit_cpu_sdpa"
REDUCED = (torch.bfloat16, torch.float16)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [B, H, Q, D], key/value [B, KVH, L, D] -> ([B, Q, H, Dv], None), as `sdpa_attention_forward`."""
    batch, heads, positions, dim = query.shape
    kv_heads = key.shape[1]
    own_case = (positions == 1 and query.device.type == "cpu" and query.dtype in REDUCED and not dropout
                and heads % kv_heads == 0 and kwargs.get("position_bias") is None and kwargs.get("cache") is None
                and not kwargs.get("output_attentions", False))
    if not own_case:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = dim ** -0.5 if scaling is None else scaling
    # [B, KVH, G, D] x [B, KVH, D, L]: the G query heads of a group share their key head, as in GQA
    scores = torch.matmul(query.reshape(batch, kv_heads, heads // kv_heads, dim), key.transpose(-1, -2)).float()
    scores.mul_(scale)
    if attention_mask is not None:
        mask = attention_mask[..., -1:, -scores.shape[-1]:]  # [B or 1, 1, 1, L]: this position's row
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask.float())
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value).reshape(batch, heads, 1, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make NAME an attention implementation transformers knows (idempotent); returns NAME."""
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def use_for(net: Any) -> bool:
    """Switch `net` to this attention when it runs transformers' SDPA on the CPU in bf16/fp16; whether it did."""
    config = getattr(net, "config", None)
    if (config is None or getattr(config, "_attn_implementation", None) != "sdpa" or net.device.type != "cpu"
            or net.dtype not in REDUCED):
        return False
    net.set_attn_implementation(register())
    return True
