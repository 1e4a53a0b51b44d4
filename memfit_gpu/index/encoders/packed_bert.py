"""The packed BERT forward: transformers' BertModel arithmetic without any work on padding.

Same arithmetic as BertModel (post-LayerNorm blocks, scaled dot-product attention) with two exact
savings: the per-token layers (projections, feed-forward) never run on padding, and for a sequence
classifier the last block computes its attention query, output and feed-forward for the [CLS] row alone
(keys and values still come from every token). `bert_body` says which models it reproduces; everything
else runs through its own transformers forward. Its linear layers go through `onednn.linear` (the
private-op fast path on the CPU, the public F.linear everywhere else).
"""

from __future__ import annotations

import torch

from memfit_gpu.onednn import linear, tensor_version

__all__ = ["FLAT_KEY", "bert_body", "bert_packed"]

# the key under which a collated batch carries the positions of its real tokens in [b * L] (computed on
# the host, so that the device never syncs on a `nonzero`)
FLAT_KEY = "_flat"


def bert_body(model: torch.nn.Module) -> torch.nn.Module | None:
    """The BertModel inside `model` when the packed fast path reproduces it exactly, else None."""
    body = getattr(model, "bert", model)
    config = getattr(body, "config", None)
    if config is None or getattr(config, "model_type", None) != "bert":
        return None
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return None
    if getattr(config, "position_embedding_type", "absolute") not in (None, "absolute"):
        return None
    needed = ("embeddings", "encoder")
    if not all(hasattr(body, n) for n in needed) or not hasattr(body.encoder, "layer"):
        return None
    layer = body.encoder.layer[0]
    try:
        layer.attention.self.query, layer.attention.output.LayerNorm  # noqa: B018
        layer.intermediate.dense, layer.intermediate.intermediate_act_fn, layer.output.LayerNorm  # noqa: B018
    except AttributeError:
        return None
    return body


def _fused_qkv(attention: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """One [3d, d] weight for the three projections: one GEMM instead of three (cached per module)."""
    # Keyed on the source tensors' storage and version: moving, casting or reloading the weights
    # rebuilds it.
    key = tuple((p.data_ptr(), tensor_version(p), p.dtype, p.device)
                for lin in (attention.query, attention.key, attention.value) for p in (lin.weight, lin.bias))
    cached = getattr(attention, "_memfit_qkv", None)
    if cached is None or cached[2] != key:
        cached = (
            torch.cat([attention.query.weight, attention.key.weight, attention.value.weight]).detach(),
            torch.cat([attention.query.bias, attention.key.bias, attention.value.bias]).detach(),
            key,
        )
        object.__setattr__(attention, "_memfit_qkv", cached)  # a plain attribute, not a parameter
    return cached[0], cached[1]


def bert_packed(body: torch.nn.Module, batch: dict[str, torch.Tensor], cls_only: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT encoder over real tokens only; returns (hidden [T, d] or CLS [b, d], flat token index).

    Same arithmetic as transformers' BertModel (post-LayerNorm blocks, scaled dot-product attention)
    with two exact savings: the per-token layers (projections, feed-forward) never run on padding,
    and with `cls_only` the last block computes its attention query, output and feed-forward for the
    [CLS] row alone (keys and values still come from every token), which is all a sequence classifier
    reads. Attention itself runs on the padded [b, L] layout under the mask.
    """
    ids = batch["input_ids"]
    mask = batch["attention_mask"].bool()
    b, width = ids.shape
    types = batch.get("token_type_ids")
    if types is None:
        types = torch.zeros_like(ids)
    flat = batch.get(FLAT_KEY)  # positions of real tokens in [b * L], computed on the host when collated
    if flat is None:
        flat = mask.reshape(-1).nonzero().squeeze(1)
    # No padding (one text, or texts of one length): the packed and the padded layouts are the same rows,
    # so the gathers and scatters below would copy every row to where it already is.
    dense = flat.numel() == b * width
    x = body.embeddings(input_ids=ids, token_type_ids=types).reshape(b * width, -1)
    if not dense:
        x = x[flat]
    d = x.shape[-1]
    key_mask = mask[:, None, None, :]
    layers = body.encoder.layer
    for i, layer in enumerate(layers):
        attention = layer.attention.self
        heads, head_dim = attention.num_attention_heads, attention.attention_head_size
        weight, bias = _fused_qkv(attention)
        last = cls_only and i == len(layers) - 1
        if last:
            kv = linear(attention, "kv", x, weight[d:], bias[d:])
            if dense:
                padded = kv
            else:
                padded = x.new_zeros((b * width, 2 * d))
                padded[flat] = kv
            k, v = padded.view(b, width, 2, heads, head_dim).permute(2, 0, 3, 1, 4)
            # Right padding: each row's [CLS] is its first real token.
            lengths = mask.sum(1)
            residual = x[lengths.cumsum(0) - lengths]
            q = linear(attention, "q", residual, weight[:d], bias[:d]).view(b, heads, 1, head_dim)
            context = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
            context = context.reshape(b, d)
        else:
            qkv = linear(attention, "qkv", x, weight, bias)
            if dense:
                padded = qkv
            else:
                padded = x.new_zeros((b * width, 3 * d))
                padded[flat] = qkv
            q, k, v = padded.view(b, width, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            context = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
            context = context.transpose(1, 2).reshape(b * width, d)
            if not dense:
                context = context[flat]
            residual = x
        out = layer.attention.output
        hidden = out.LayerNorm(linear(out, "dense", context, out.dense.weight, out.dense.bias) + residual)
        inner = layer.intermediate
        up = inner.intermediate_act_fn(linear(inner, "dense", hidden, inner.dense.weight, inner.dense.bias))
        down = layer.output
        x = down.LayerNorm(linear(down, "dense", up, down.dense.weight, down.dense.bias) + hidden)
    return x, flat
