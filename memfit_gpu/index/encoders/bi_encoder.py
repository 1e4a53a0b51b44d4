"""`BiEncoder`: sentence-transformers' `SentenceTransformer.encode` for BERT-style models, batched.

Pooling and normalisation come from the model folder (modules.json, layout.py); the forward is the
packed BERT path (packed_bert.py) where it reproduces the model, else the model's own transformers
forward; batching, replicas and OOM halving are batching.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from memfit_gpu.devices import resolve_dtype, visible_devices, warn_tf32
from memfit_gpu.index.encoders.batching import BatchedEncoder
from memfit_gpu.index.encoders.layout import sentence_transformers_layout
from memfit_gpu.index.encoders.packed_bert import bert_body, bert_packed
from memfit_gpu.index.encoders.protocols import checked_texts
from memfit_gpu.models import ResolvedModel, resolve

__all__ = ["BiEncoder", "pool"]

logger = logging.getLogger(__name__)


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: Sequence[str], right_padded: bool) -> torch.Tensor:
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


class BiEncoder(BatchedEncoder):
    """HF AutoModel + sentence-transformers pooling (+ L2 norm): text -> float32 embedding."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_length: int,
                 devices: Sequence[torch.device], dtype: torch.dtype, pooling: Sequence[str],
                 normalize: bool, do_lower_case: bool = False, loaded_from: ResolvedModel | None = None,
                 batch_tokens: int = 0, workers: str = "auto") -> None:
        super().__init__(model, tokenizer, max_length, devices, dtype, loaded_from, batch_tokens, workers)
        self.pooling = list(pooling)
        self.normalize = bool(normalize)
        self.do_lower_case = bool(do_lower_case)
        hidden = int(getattr(model.config, "hidden_size", 0) or model.get_input_embeddings().embedding_dim)
        self._dim = hidden * len(self.pooling)

    def _fast_path_supported(self, model: torch.nn.Module) -> bool:
        return bert_body(model) is not None

    def _replica_kwargs(self) -> dict[str, Any]:
        return {"pooling": self.pooling, "normalize": self.normalize, "do_lower_case": self.do_lower_case}

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
                        normalize: bool | None = None, max_length: int | None = None,
                        setting: str = "dtype", batch_tokens: int = 0, workers: str = "auto") -> BiEncoder:
        """Load through `models.resolve("encoder", name_or_path)`.

        Args:
            device: devices.visible_devices spec; one replica per device.
            dtype: devices.resolve_dtype spec ("auto" = float32); `setting` names it in errors.
            normalize / max_length: None = what the folder says (modules.json, sentence_bert_config.json).
            batch_tokens: padded tokens per forward (0 = by device, batching.default_batch_tokens).
            workers: threads | processes | auto, for replicas on several devices (batching.Workers).
        """
        from transformers import AutoModel, AutoTokenizer

        resolved = resolve("encoder", str(name_or_path))
        folder = Path(resolved.path)
        pooling, st_normalize, st_config = sentence_transformers_layout(folder)
        devices = visible_devices(device)
        torch_dtype = resolve_dtype(dtype, devices, setting)
        warn_tf32(torch_dtype, devices)
        model = AutoModel.from_pretrained(str(folder), dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        if max_length is None:
            max_length = int(st_config.get("max_seq_length") or tokenizer.model_max_length)
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions:
            max_length = min(max_length, int(positions))
        encoder = cls(model, tokenizer, max_length, devices, torch_dtype, pooling,
                      st_normalize if normalize is None else normalize,
                      bool(st_config.get("do_lower_case", False)), resolved, batch_tokens, workers)
        logger.info("BiEncoder %s on %s (%s), dim %d, max_seq_length %d, pooling %s%s; batches of <= %d tokens%s",
                    resolved.name, [str(d) for d in devices], torch_dtype, encoder.dim, max_length, "+".join(pooling),
                    ", normalised" if encoder.normalize else "", encoder.max_batch_tokens,
                    f", {encoder.workers.value}" if len(devices) > 1 else "")
        return encoder

    @property
    def dim(self) -> int:
        return self._dim

    def _embed(self, replica: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        body = bert_body(replica) if self.fast_path else None
        if body is not None:
            packed, flat = bert_packed(body, batch, cls_only=False)
            b, width = batch["input_ids"].shape
            if packed.shape[0] == b * width:  # no padding: the packed rows are the padded layout already
                hidden = packed.view(b, width, -1)
            else:
                hidden = packed.new_zeros((b * width, packed.shape[-1]))
                hidden[flat] = packed
                hidden = hidden.view(b, width, -1)
        else:
            hidden = replica(**batch).last_hidden_state
        pooled = pool(hidden, batch["attention_mask"], self.pooling, self._padding_right)
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._embed(self.model, batch)

    def encode(self, texts: Sequence[str], batch_size: int = 128, progress: bool = False) -> torch.Tensor:
        """Embeddings [n, dim], float32 on the CPU, rows in the order of `texts`."""
        texts = checked_texts(texts, "BiEncoder.encode")
        if self.do_lower_case:
            texts = [t.lower() for t in texts]
        out = torch.empty((len(texts), self.dim), dtype=torch.float32)
        if not texts:
            return out
        tokens = self._tokenize(texts, None)
        return self._run(tokens, batch_size, self._embed, out, progress, "encode")
