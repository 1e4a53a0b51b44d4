"""`CrossEncoderModule`: sentence-transformers' `CrossEncoder.predict` for a one-label classifier, batched.

Including its activation choice: the ms-marco cross-encoders declare `Identity` in their config
(`sbert_ce_default_activation_function` / `sentence_transformers.activation_fn`), so their score is the
raw logit; a one-label model that declares nothing gets sentence-transformers' default, the sigmoid.
For BertForSequenceClassification the packed path runs the last block for the [CLS] row alone
(packed_bert.py), and in bf16 / fp16 its head (pooler and classifier) in float32, so that scores are not
rounded to the dtype's grid. `random_cross_encoder` builds the seeded test/benchmark model (no trained one ships
offline).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from memfit_gpu.devices import resolve_dtype, visible_devices, warn_tf32
from memfit_gpu.index.encoders.batching import BatchedEncoder
from memfit_gpu.index.encoders.layout import activation_from_config
from memfit_gpu.index.encoders.packed_bert import bert_body, bert_packed
from memfit_gpu.index.encoders.protocols import split_pairs
from memfit_gpu.models import ResolvedModel, resolve
from memfit_gpu.onednn import tensor_version

__all__ = ["CrossEncoderModule", "random_cross_encoder"]

logger = logging.getLogger(__name__)


class CrossEncoderModule(BatchedEncoder):
    """A one-label sequence classifier scoring (query, passage) pairs, batched and length-sorted.

    `score` returns what `CrossEncoder.predict` returns with its default activation: raw logits for the
    ms-marco models (their config declares Identity), sigmoid probabilities for a model that declares
    nothing. `activation` records which.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_length: int,
                 devices: Sequence[torch.device], dtype: torch.dtype, activation: str,
                 loaded_from: ResolvedModel | None = None, batch_tokens: int = 0, workers: str = "auto") -> None:
        super().__init__(model, tokenizer, max_length, devices, dtype, loaded_from, batch_tokens, workers)
        if int(getattr(model.config, "num_labels", 1)) != 1:
            raise ValueError(f"CrossEncoderModule needs a one-label model; "
                             f"{getattr(loaded_from, 'path', 'model')} has {model.config.num_labels} labels")
        if activation not in ("identity", "sigmoid"):
            raise ValueError(f"activation must be identity or sigmoid, got {activation!r}")
        self.activation = activation

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str | torch.device = "auto", max_length: int = 384,
                        dtype: str | torch.dtype = "auto", activation: str | None = None,
                        setting: str = "dtype", workers: str = "auto") -> CrossEncoderModule:
        """Load through `models.resolve("cross-encoder", name_or_path)`.

        Args:
            device: devices.visible_devices spec; one replica per device.
            max_length: tokens per pair (capped at the model's positions).
            dtype: devices.resolve_dtype spec ("auto" = float32); `setting` names it in errors.
            activation: None = what the config declares (layout.activation_from_config).
            workers: threads | processes | auto, for replicas on several devices (batching.Workers).
        """
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        resolved = resolve("cross-encoder", str(name_or_path))
        devices = visible_devices(device)
        torch_dtype = resolve_dtype(dtype, devices, setting)
        warn_tf32(torch_dtype, devices)
        model = AutoModelForSequenceClassification.from_pretrained(resolved.path, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(resolved.path)
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions:
            max_length = min(int(max_length), int(positions))
        chosen = activation or activation_from_config(model.config)
        module = cls(model, tokenizer, max_length, devices, torch_dtype, chosen, resolved, workers=workers)
        logger.info("CrossEncoderModule %s on %s (%s), max_length %d, activation %s", resolved.name,
                    [str(d) for d in devices], torch_dtype, max_length, chosen)
        return module

    def _fast_path_supported(self, model: torch.nn.Module) -> bool:
        body = bert_body(model)
        return (
            body is not None and body is not model and getattr(body, "pooler", None) is not None
            and isinstance(getattr(model, "classifier", None), torch.nn.Linear)
            and type(model).__name__ == "BertForSequenceClassification"
        )

    def _replica_kwargs(self) -> dict[str, Any]:
        return {"activation": self.activation}

    def _logits(self, replica: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        body = bert_body(replica) if self.fast_path else None
        if body is not None:
            cls, _ = bert_packed(body, batch, cls_only=True)
            if cls.dtype not in (torch.bfloat16, torch.float16):
                pooled = body.pooler.activation(body.pooler.dense(cls))
                scores = replica.classifier(pooled).float().squeeze(-1)
            else:
                # bf16 / fp16: the head (pooler + classifier, 0.2 % of the work) in float32, so the scores are
                # not rounded to the dtype's grid (bf16 logits in [4, 8) are 1/32 apart: ties, reordered top-10s)
                dense, classifier = _float32_head(replica, body)
                scores = classifier(body.pooler.activation(dense(cls.float()))).squeeze(-1)
        else:
            scores = replica(**batch).logits.float().squeeze(-1)
        return torch.sigmoid(scores) if self.activation == "sigmoid" else scores

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._logits(self.model, batch)

    def score(self, pairs: Sequence[tuple[str, str]], batch_size: int = 256, progress: bool = False) -> torch.Tensor:
        """Scores [n] float32 on the CPU, one per (query, passage) pair, in input order."""
        firsts, seconds = split_pairs(pairs, "CrossEncoderModule.score")
        out = torch.empty(len(firsts), dtype=torch.float32)
        if not firsts:
            return out
        tokens = self._tokenize(firsts, seconds)
        return self._run(tokens, batch_size, self._logits, out, progress, "rerank")


def _float32_head(replica: torch.nn.Module, body: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """float32 copies of `replica`'s pooler dense layer and classifier, made once per replica (a plain
    attribute, not a submodule: state_dict and .to() never see them) and remade when the weights change."""
    sources = (body.pooler.dense, replica.classifier)
    key = tuple((p.data_ptr(), tensor_version(p), p.dtype, p.device) for m in sources for p in m.parameters())
    cached = replica.__dict__.get("_memfit_float32_head")
    if cached is None or cached[0] != key:
        cached = (key, *(copy.deepcopy(m).float().eval() for m in sources))
        replica.__dict__["_memfit_float32_head"] = cached
    return cached[1], cached[2]


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
