"""Batched transformer encoders: a bi-encoder (embeddings) and a cross-encoder (pair scores).

Both share one execution plan (`_BatchedEncoder`):
- all inputs are tokenised once, unpadded, then sorted by their exact token count (longest first, so
  an out-of-memory shows up on the first batch, not the last);
- each batch is padded only to its own longest row, so a length-sorted batch wastes almost no work;
  for BERT models a packed path goes further: the per-token layers never run on padding at all, and
  the cross-encoder's last block runs for the [CLS] row alone (see `_bert_packed`);
- on the CPU a batch is also capped at `max_batch_tokens` (rows x padded width): activations that
  stay in cache run faster than large batches (measured: 16-32 rows of ~64 tokens beat 256 rows);
- one model replica per visible device; batches are handed to the devices from a shared queue by one
  thread per device (the GIL is released inside kernels);
- on CUDA out-of-memory the device halves its batch size and retries the same rows;
- results are written back in the caller's order.

`BiEncoder` reproduces sentence-transformers' `SentenceTransformer.encode(normalize_embeddings=True)`
for BERT-style models (pooling and normalisation read from the model folder's modules.json).
`CrossEncoderModule` reproduces `CrossEncoder.predict` for a one-label sequence classifier, including
its activation choice: the ms-marco cross-encoders declare `Identity` in their config
(`sbert_ce_default_activation_function` / `sentence_transformers.activation_fn`), so their score is the
raw logit; a one-label model that declares nothing gets sentence-transformers' default, the sigmoid.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from memfit_gpu.devices import visible_devices
from memfit_gpu.models import ResolvedModel, resolve

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, devices: Sequence[torch.device]) -> torch.dtype:
    """"auto" = float32 on every device; bf16 / fp16 only when asked.

    fp32 keeps GPU packs equal to the CPU/fp32 packs the paper's numbers come from: in bf16,
    cross-encoder logits in [4, 8) are 1/32 apart, so rounding alone ties or reorders top-10 lists,
    and identical texts in different batches stop getting identical vectors. bf16 is refused on GPUs
    that only emulate it (V100, T4): use fp16 there."""
    if isinstance(dtype, torch.dtype):
        chosen = dtype
    else:
        key = dtype.strip().lower()
        if key == "auto":
            return torch.float32
        if key not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected auto or one of {sorted(_DTYPES)}")
        chosen = _DTYPES[key]
    if chosen == torch.bfloat16:
        for device in devices:
            if device.type == "cuda" and not _native_bf16(device):
                raise ValueError(f"dtype bf16: {torch.cuda.get_device_name(device)} ({device}) has no native bf16 "
                                 "(it would be emulated, slowly); use fp16 or float32")
    return chosen


def _native_bf16(device: torch.device) -> bool:
    with torch.cuda.device(device):
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def _warn_tf32(dtype: torch.dtype, devices: Sequence[torch.device]) -> None:
    """fp32 on a GPU with TF32 matmuls on is not fp32: say so (the process-wide setting is left alone)."""
    if dtype == torch.float32 and any(d.type == "cuda" for d in devices) and (
            torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32):
        logger.warning("float32 encoders with TF32 matmuls enabled (torch.set_float32_matmul_precision=%r): "
                       "vectors and scores will differ from the CPU's beyond the last bits and packs may change",
                       torch.get_float32_matmul_precision())


# Rows x padded width per forward on the CPU; ~2k tokens keeps MiniLM's activations cache-resident.
CPU_BATCH_TOKENS = 2048


def _plan_batches(order: Sequence[int], lengths: Sequence[int], batch_size: int,
                  max_tokens: int | None) -> list[list[int]]:
    """Cut the longest-first `order` into batches of at most `batch_size` rows and `max_tokens` padded
    tokens (a batch's width is its first, longest row); a row longer than the budget goes alone."""
    batches: list[list[int]] = []
    current: list[int] = []
    for row in order:
        width = lengths[current[0]] if current else lengths[row]
        if current and (len(current) >= batch_size
                        or (max_tokens is not None and (len(current) + 1) * width > max_tokens)):
            batches.append(current)
            current = []
        current.append(row)
    if current:
        batches.append(current)
    return batches


def _mask(lengths: Sequence[int], width: int, right: bool) -> torch.Tensor:
    positions = torch.arange(width).unsqueeze(0)
    n = torch.tensor(lengths).unsqueeze(1)
    mask = positions < n if right else positions >= (width - n)
    return mask.long()


# Allocation failures surface from cuBLAS / cuDNN handles as plain RuntimeErrors with these texts.
_OOM_TEXTS = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
              "cudnn_status_not_initialized", "cuda error: out of memory")


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(t in text for t in _OOM_TEXTS)


class _BatchedEncoder(torch.nn.Module):
    """Shared plan: tokenise once, sort by length, pad per batch, spread batches over replicas."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_length: int,
                 devices: Sequence[torch.device], dtype: torch.dtype,
                 loaded_from: ResolvedModel | None) -> None:
        super().__init__()
        self.model = model.to(device=devices[0], dtype=dtype).eval()
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.devices = list(devices)
        self.dtype = dtype
        self.loaded_from = loaded_from
        # Replicas live in a plain list: registering them would duplicate every parameter in state_dict.
        self._replicas: list[torch.nn.Module] = [self.model] + [
            copy.deepcopy(self.model).to(d).eval() for d in self.devices[1:]
        ]
        self._input_names = [n for n in tokenizer.model_input_names if n in ("input_ids", "attention_mask",
                                                                                "token_type_ids")]
        pad = tokenizer.pad_token_id
        self._pad_id = 0 if pad is None else int(pad)
        self._padding_right = getattr(tokenizer, "padding_side", "right") != "left"
        # The packed BERT path (no work on padding) when the architecture is one it reproduces exactly;
        # other architectures run through their own transformers forward.
        self.fast_path = bool(self._padding_right and self._fast_path_supported(self.model))
        # GPUs want the largest batch that fits (OOM halves it); CPUs want cache-sized ones.
        self.max_batch_tokens: int | None = (
            CPU_BATCH_TOKENS if all(d.type == "cpu" for d in self.devices) else None
        )

    def _fast_path_supported(self, model: torch.nn.Module) -> bool:
        return _bert_body(model) is not None

    @property
    def device(self) -> torch.device:
        return self.devices[0]

    def info(self) -> dict[str, Any]:
        """What encoded: the weights that loaded, the compute dtype, the devices (recorded in outputs)."""
        weights = self.loaded_from.to_dict() if self.loaded_from is not None else {}
        return {**weights, "dtype": str(self.dtype).removeprefix("torch."),
                "devices": [str(d) for d in self.devices], "packed_bert": self.fast_path}

    # -- tokenisation --------------------------------------------------------------------------
    def _tokenize(self, first: list[str], second: list[str] | None) -> dict[str, list[list[int]]]:
        encoded = self.tokenizer(
            first, second, padding=False, truncation="longest_first" if second is not None else True,
            max_length=self.max_length, return_attention_mask=False,
            return_token_type_ids="token_type_ids" in self._input_names,
        )
        return {k: encoded[k] for k in ("input_ids", "token_type_ids") if k in encoded}

    def _collate(self, tokens: dict[str, list[list[int]]], rows: Sequence[int],
                 device: torch.device) -> dict[str, torch.Tensor]:
        """Pad the rows to their own longest length (one tensor build per field)."""
        ids = tokens["input_ids"]
        lengths = [len(ids[r]) for r in rows]
        width = max(lengths)

        def padded(field: list[list[int]], fill: int) -> torch.Tensor:
            if self._padding_right:
                rows_out = [field[r] + [fill] * (width - n) for r, n in zip(rows, lengths, strict=True)]
            else:
                rows_out = [[fill] * (width - n) + field[r] for r, n in zip(rows, lengths, strict=True)]
            return torch.tensor(rows_out, dtype=torch.long)

        batch = {"input_ids": padded(ids, self._pad_id)}
        batch["attention_mask"] = _mask(lengths, width, self._padding_right)
        if "token_type_ids" in tokens and "token_type_ids" in self._input_names:
            batch["token_type_ids"] = padded(tokens["token_type_ids"], 0)
        non_blocking = device.type == "cuda"
        return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}

    # -- execution -----------------------------------------------------------------------------
    def _run(self, tokens: dict[str, list[list[int]]], batch_size: int,
             forward: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor],
             out: torch.Tensor, progress: bool, desc: str) -> torch.Tensor:
        """Fill `out[row]` for every row, longest inputs first, one worker per replica."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        n = len(tokens["input_ids"])
        if n == 0:
            return out
        order = sorted(range(n), key=lambda r: -len(tokens["input_ids"][r]))
        batches = _plan_batches(order, [len(ids) for ids in tokens["input_ids"]], batch_size,
                                self.max_batch_tokens)
        bar = tqdm(total=n, desc=desc, disable=not progress, unit="item")
        lock = threading.Lock()

        def work(replica: torch.nn.Module, device: torch.device, rows: list[int], size: list[int]) -> None:
            start = 0
            while start < len(rows):
                chunk = rows[start:start + size[0]]
                try:
                    with torch.inference_mode():
                        result = forward(replica, self._collate(tokens, chunk, device))
                except Exception as exc:
                    if not (device.type == "cuda" and _is_oom(exc)) or size[0] == 1:
                        raise
                    del exc
                    torch.cuda.empty_cache()
                    size[0] = max(1, size[0] // 2)
                    logger.warning("CUDA out of memory on %s: batch size halved to %d", device, size[0])
                    continue
                out[torch.tensor(chunk)] = result.float().cpu()
                start += len(chunk)
                with lock:
                    bar.update(len(chunk))

        try:
            if len(self._replicas) == 1:
                size = [batch_size]
                for rows in batches:
                    work(self._replicas[0], self.devices[0], rows, size)
            else:
                self._run_threads(batches, batch_size, work)
        finally:
            bar.close()
        return out

    def _run_threads(self, batches: list[list[int]], batch_size: int,
                     work: Callable[[torch.nn.Module, torch.device, list[int], list[int]], None]) -> None:
        pending: queue.Queue[list[int]] = queue.Queue()
        for rows in batches:
            pending.put(rows)
        errors: list[BaseException] = []

        def worker(replica: torch.nn.Module, device: torch.device) -> None:
            size = [batch_size]  # each device halves its own size on OOM
            if device.type == "cuda":
                torch.cuda.set_device(device)
            try:
                while not errors:
                    try:
                        rows = pending.get_nowait()
                    except queue.Empty:
                        return
                    work(replica, device, rows, size)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(r, d), daemon=True)
                   for r, d in zip(self._replicas, self.devices, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]


def _bert_body(model: torch.nn.Module) -> torch.nn.Module | None:
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


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # inference tensors (created under inference_mode) keep no version counter
        return -1


def _fused_qkv(attention: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """One [3d, d] weight for the three projections: one GEMM instead of three (cached per module)."""
    # Keyed on the source tensors' storage and version: moving, casting or reloading the weights
    # rebuilds it.
    key = tuple((p.data_ptr(), _version(p), p.dtype, p.device)
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


@functools.lru_cache(maxsize=1)
def onednn_gemm() -> bool:
    """Whether this torch build runs fp32 linear layers through oneDNN with prepacked weights.

    torch's own fp32 CPU GEMM is MKL's, which runs 1.1-1.8x slower than oneDNN on the AMD EPYC CPUs
    measured here (docs/benchmarks.md); oneDNN is the kernel library torch.compile uses for the same
    layers. Probed once on a tiny layer, with the result checked against `F.linear`."""
    try:
        probe = torch.Generator().manual_seed(0)  # a private generator: the global RNG stays untouched
        weight, bias = torch.randn(8, 16, generator=probe), torch.randn(8, generator=probe)
        x = torch.randn(4, 16, generator=probe)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return bool(torch.allclose(got, torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5))
    except (AttributeError, RuntimeError):
        return False


class _PackedWeights(dict):
    """oneDNN-packed weights cached on a module. A copied or pickled module starts without them:
    packed (mkldnn) tensors can be neither, and they are rebuilt on first use."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _PackedWeights:
        return _PackedWeights()

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (_PackedWeights, ())


def _linear(owner: torch.nn.Module, name: str, x: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; fp32 on the CPU without gradients through oneDNN with `weight` packed
    once and cached on `owner` under `name` (rebuilt when the weight's storage or version changes)."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) or not onednn_gemm()):
        return torch.nn.functional.linear(x, weight, bias)  # the packed kernel has no backward
    key = (weight.data_ptr(), tuple(weight.shape), _version(weight), bias.data_ptr(), _version(bias))
    cache = owner.__dict__.setdefault("_memfit_gemm", _PackedWeights())  # a plain attribute, not a submodule
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        hit = cache[name] = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None),
                             bias.detach().contiguous())
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), hit[1], hit[2], "none", [], "")


def _bert_packed(body: torch.nn.Module, batch: dict[str, torch.Tensor], cls_only: bool
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
    flat = mask.reshape(-1).nonzero().squeeze(1)  # positions of real tokens in [b * L]
    x = body.embeddings(input_ids=ids, token_type_ids=types).reshape(b * width, -1)[flat]
    d = x.shape[-1]
    key_mask = mask[:, None, None, :]
    layers = body.encoder.layer
    for i, layer in enumerate(layers):
        attention = layer.attention.self
        heads, head_dim = attention.num_attention_heads, attention.attention_head_size
        weight, bias = _fused_qkv(attention)
        last = cls_only and i == len(layers) - 1
        if last:
            kv = _linear(attention, "kv", x, weight[d:], bias[d:])
            padded = x.new_zeros((b * width, 2 * d))
            padded[flat] = kv
            k, v = padded.view(b, width, 2, heads, head_dim).permute(2, 0, 3, 1, 4)
            # Right padding: each row's [CLS] is its first real token.
            lengths = mask.sum(1)
            residual = x[lengths.cumsum(0) - lengths]
            q = _linear(attention, "q", residual, weight[:d], bias[:d]).view(b, heads, 1, head_dim)
            context = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
            context = context.reshape(b, d)
        else:
            qkv = _linear(attention, "qkv", x, weight, bias)
            padded = x.new_zeros((b * width, 3 * d))
            padded[flat] = qkv
            q, k, v = padded.view(b, width, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            context = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
            context = context.transpose(1, 2).reshape(b * width, d)[flat]
            residual = x
        out = layer.attention.output
        hidden = out.LayerNorm(_linear(out, "dense", context, out.dense.weight, out.dense.bias) + residual)
        inner = layer.intermediate
        up = inner.intermediate_act_fn(_linear(inner, "dense", hidden, inner.dense.weight, inner.dense.bias))
        down = layer.output
        x = down.LayerNorm(_linear(down, "dense", up, down.dense.weight, down.dense.bias) + hidden)
    return x, flat


def _read_json(path: Path) -> dict[str, Any] | list[Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from exc


_POOLING_KEYS = {
    "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len", "pooling_mode_lasttoken": "lasttoken",
}


def _sentence_transformers_layout(folder: Path) -> tuple[list[str], bool, dict[str, Any]]:
    """(pooling modes, normalise?, sentence_bert_config) from a sentence-transformers folder.

    A plain transformers folder (no modules.json) gets mean pooling + normalisation, the SPEC's
    bi-encoder recipe.
    """
    modules = _read_json(folder / "modules.json")
    st_config = _read_json(folder / "sentence_bert_config.json") or {}
    if modules is None:
        return ["mean"], True, st_config  # type: ignore[return-value]
    pooling: list[str] = []
    normalize = False
    for module in modules:  # type: ignore[union-attr]
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            cfg = _read_json(folder / module.get("path", "") / "config.json") or {}
            pooling = [mode for key, mode in _POOLING_KEYS.items() if cfg.get(key)]
            unsupported = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v
                           and k not in _POOLING_KEYS]
            if unsupported or not pooling:
                raise ValueError(f"{folder / module.get('path', '')}/config.json: unsupported pooling "
                                 f"{unsupported or 'none enabled'}")
            if cfg.get("include_prompt") is False:
                raise ValueError(f"{folder}/{module.get('path')}: include_prompt=false is not supported")
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{folder}/modules.json: module {module.get('name')} of type "
                             f"{module.get('type')} is not supported by BiEncoder")
    if not pooling:
        raise ValueError(f"{folder}/modules.json: no Pooling module")
    return pooling, normalize, st_config  # type: ignore[return-value]


def _pool(hidden: torch.Tensor, mask: torch.Tensor, modes: Sequence[str], right_padded: bool) -> torch.Tensor:
    """Pool token states [b, L, d] under mask [b, L] the way sentence-transformers' Pooling does."""
    hidden = hidden.float()  # pool in fp32 whatever the compute dtype
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(hidden[:, 0])
        elif mode in ("mean", "mean_sqrt_len"):
            summed = (hidden * weights).sum(1)
            count = weights.sum(1).clamp(min=1e-9)
            parts.append(summed / (count if mode == "mean" else count.sqrt()))
        elif mode == "max":
            parts.append(hidden.masked_fill(weights == 0, -1e9).max(1).values)
        elif mode == "lasttoken":
            if right_padded:
                last = mask.sum(1).clamp(min=1) - 1
                parts.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])
            else:
                parts.append(hidden[:, -1])
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    return torch.cat(parts, dim=-1)


class BiEncoder(_BatchedEncoder):
    """HF AutoModel + sentence-transformers pooling (+ L2 norm): text -> float32 embedding."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_length: int,
                 devices: Sequence[torch.device], dtype: torch.dtype, pooling: Sequence[str],
                 normalize: bool, do_lower_case: bool = False, loaded_from: ResolvedModel | None = None) -> None:
        super().__init__(model, tokenizer, max_length, devices, dtype, loaded_from)
        self.pooling = list(pooling)
        self.normalize = bool(normalize)
        self.do_lower_case = bool(do_lower_case)
        hidden = int(getattr(model.config, "hidden_size", 0) or model.get_input_embeddings().embedding_dim)
        self._dim = hidden * len(self.pooling)

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
                        normalize: bool | None = None, max_length: int | None = None) -> BiEncoder:
        from transformers import AutoModel, AutoTokenizer

        resolved = resolve("encoder", str(name_or_path))
        folder = Path(resolved.path)
        pooling, st_normalize, st_config = _sentence_transformers_layout(folder)
        devices = visible_devices(device)
        torch_dtype = resolve_dtype(dtype, devices)
        _warn_tf32(torch_dtype, devices)
        model = AutoModel.from_pretrained(str(folder), dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        if max_length is None:
            max_length = int(st_config.get("max_seq_length") or tokenizer.model_max_length)
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions:
            max_length = min(max_length, int(positions))
        encoder = cls(model, tokenizer, max_length, devices, torch_dtype, pooling,
                      st_normalize if normalize is None else normalize,
                      bool(st_config.get("do_lower_case", False)), resolved)
        logger.info("BiEncoder %s on %s (%s), dim %d, max_seq_length %d, pooling %s%s", resolved.name,
                    [str(d) for d in devices], torch_dtype, encoder.dim, max_length, "+".join(pooling),
                    ", normalised" if encoder.normalize else "")
        return encoder

    @property
    def dim(self) -> int:
        return self._dim

    def _embed(self, replica: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        body = _bert_body(replica) if self.fast_path else None
        if body is not None:
            packed, flat = _bert_packed(body, batch, cls_only=False)
            b, width = batch["input_ids"].shape
            hidden = packed.new_zeros((b * width, packed.shape[-1]))
            hidden[flat] = packed
            hidden = hidden.view(b, width, -1)
        else:
            hidden = replica(**batch).last_hidden_state
        pooled = _pool(hidden, batch["attention_mask"], self.pooling, self._padding_right)
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._embed(self.model, batch)

    def encode(self, texts: Sequence[str], batch_size: int = 128, progress: bool = False) -> torch.Tensor:
        """Embeddings [n, dim], float32 on the CPU, rows in the order of `texts`."""
        texts = [t.lower() for t in texts] if self.do_lower_case else list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"BiEncoder.encode: texts[{i}] is {type(text).__name__}, not str")
        out = torch.empty((len(texts), self.dim), dtype=torch.float32)
        if not texts:
            return out
        tokens = self._tokenize(texts, None)
        return self._run(tokens, batch_size, self._embed, out, progress, "encode")


def _activation_from_config(config: Any) -> str:
    """The activation sentence-transformers' CrossEncoder applies by default: identity | sigmoid."""
    path = None
    st = getattr(config, "sentence_transformers", None)
    if isinstance(st, dict) and st.get("activation_fn"):
        path = st["activation_fn"]
    elif getattr(config, "sbert_ce_default_activation_function", None):
        path = config.sbert_ce_default_activation_function
    if path is not None:
        name = str(path).rsplit(".", 1)[-1].lower()
        if name in ("identity", "sigmoid"):
            return name
        raise ValueError(f"cross-encoder config declares activation {path!r}; only Identity and Sigmoid are "
                         "supported")
    return "sigmoid" if int(getattr(config, "num_labels", 1)) == 1 else "identity"


class CrossEncoderModule(_BatchedEncoder):
    """A one-label sequence classifier scoring (query, passage) pairs, batched and length-sorted.

    `score` returns what `CrossEncoder.predict` returns with its default activation: raw logits for the
    ms-marco models (their config declares Identity), sigmoid probabilities for a model that declares
    nothing. `activation` records which.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_length: int,
                 devices: Sequence[torch.device], dtype: torch.dtype, activation: str,
                 loaded_from: ResolvedModel | None = None) -> None:
        super().__init__(model, tokenizer, max_length, devices, dtype, loaded_from)
        if int(getattr(model.config, "num_labels", 1)) != 1:
            raise ValueError(f"CrossEncoderModule needs a one-label model; "
                             f"{getattr(loaded_from, 'path', 'model')} has {model.config.num_labels} labels")
        if activation not in ("identity", "sigmoid"):
            raise ValueError(f"activation must be identity or sigmoid, got {activation!r}")
        self.activation = activation

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str | torch.device = "auto", max_length: int = 384,
                        dtype: str | torch.dtype = "auto", activation: str | None = None) -> CrossEncoderModule:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        resolved = resolve("cross-encoder", str(name_or_path))
        devices = visible_devices(device)
        torch_dtype = resolve_dtype(dtype, devices)
        _warn_tf32(torch_dtype, devices)
        model = AutoModelForSequenceClassification.from_pretrained(resolved.path, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(resolved.path)
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions:
            max_length = min(int(max_length), int(positions))
        chosen = activation or _activation_from_config(model.config)
        module = cls(model, tokenizer, max_length, devices, torch_dtype, chosen, resolved)
        logger.info("CrossEncoderModule %s on %s (%s), max_length %d, activation %s", resolved.name,
                    [str(d) for d in devices], torch_dtype, max_length, chosen)
        return module

    def _fast_path_supported(self, model: torch.nn.Module) -> bool:
        body = _bert_body(model)
        return (
            body is not None and body is not model and getattr(body, "pooler", None) is not None
            and isinstance(getattr(model, "classifier", None), torch.nn.Linear)
            and type(model).__name__ == "BertForSequenceClassification"
        )

    def _logits(self, replica: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        body = _bert_body(replica) if self.fast_path else None
        if body is not None:
            cls, _ = _bert_packed(body, batch, cls_only=True)
            pooled = body.pooler.activation(body.pooler.dense(cls))
            scores = replica.classifier(pooled).float().squeeze(-1)
        else:
            scores = replica(**batch).logits.float().squeeze(-1)
        return torch.sigmoid(scores) if self.activation == "sigmoid" else scores

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._logits(self.model, batch)

    def score(self, pairs: Sequence[tuple[str, str]], batch_size: int = 256, progress: bool = False) -> torch.Tensor:
        """Scores [n] float32 on the CPU, one per (query, passage) pair, in input order."""
        firsts: list[str] = []
        seconds: list[str] = []
        for i, pair in enumerate(pairs):
            if len(pair) != 2 or not isinstance(pair[0], str) or not isinstance(pair[1], str):
                raise TypeError(f"CrossEncoderModule.score: pairs[{i}] is not a (str, str) pair")
            firsts.append(pair[0])
            seconds.append(pair[1])
        out = torch.empty(len(firsts), dtype=torch.float32)
        if not firsts:
            return out
        tokens = self._tokenize(firsts, seconds)
        return self._run(tokens, batch_size, self._logits, out, progress, "rerank")


def random_cross_encoder(folder: str | Path, base: str = "sentence-transformers/all-MiniLM-L6-v2",
                         seed: int = 0, activation: str = "identity") -> Path:
    """Save a one-label BERT cross-encoder with a seeded random head on a real encoder body.

    No trained cross-encoder ships on PyPI, so tests and benchmarks use this: the body is the real
    `base` encoder (realistic activations and cost), the pooler and classifier are drawn from
    `torch.manual_seed(seed)`. Its scores mean nothing. The config declares `activation` the way the
    ms-marco cross-encoders do (`sbert_ce_default_activation_function`), so sentence-transformers'
    CrossEncoder and `CrossEncoderModule` agree on what `predict` / `score` return.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    source = resolve("encoder", base)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(source.path, num_labels=1, dtype=torch.float32)
    names = {"identity": "torch.nn.modules.linear.Identity", "sigmoid": "torch.nn.modules.activation.Sigmoid"}
    model.config.sbert_ce_default_activation_function = names[activation]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(source.path).save_pretrained(str(folder))
    return folder
