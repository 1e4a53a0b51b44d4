"""The sentence-transformers backend (`index.encoder_backend: sentence-transformers`): the reference the
packed encoders are held to, selectable at run time.

`ReferenceBiEncoder` wraps `SentenceTransformer.encode`, `ReferenceCrossEncoder` wraps
`CrossEncoder.predict`, behind the same interface as the packed modules (protocols.py): same weights
(`models.resolve`), devices and dtype (devices.py), float32 CPU tensors in input order, the same input
checks, and an `info()` with the same keys plus `"encoder_backend": "sentence-transformers"`. Several
devices go to sentence-transformers' own multi-process pool. sentence_transformers is imported on first
load: the import alone takes seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from memfit_gpu.devices import resolve_dtype, visible_devices, warn_tf32
from memfit_gpu.index.encoders.protocols import checked_texts, split_pairs
from memfit_gpu.models import ResolvedModel, resolve

__all__ = ["BACKEND", "ReferenceBiEncoder", "ReferenceCrossEncoder"]

logger = logging.getLogger(__name__)

BACKEND = "sentence-transformers"


def _info(loaded_from: ResolvedModel, dtype: torch.dtype, devices: Sequence[torch.device]) -> dict[str, Any]:
    return {**loaded_from.to_dict(), "dtype": str(dtype).removeprefix("torch."),
            "devices": [str(d) for d in devices], "packed_bert": False,
            # several devices: sentence-transformers' own multi-process pool; batches of batch_size rows
            "workers": "processes" if len(devices) > 1 else "threads", "batch_tokens": None,
            "encoder_backend": BACKEND}


def _device_arg(devices: Sequence[torch.device]) -> list[str] | None:
    """`device=` for encode / predict: a list starts sentence-transformers' multi-process pool."""
    return [str(d) for d in devices] if len(devices) > 1 else None


class ReferenceBiEncoder:
    """`SentenceTransformer.encode` as a `TextEncoder`: text -> float32 embedding."""

    def __init__(self, model: Any, devices: Sequence[torch.device], dtype: torch.dtype, normalize: bool,
                 loaded_from: ResolvedModel) -> None:
        self.model = model
        self.devices = list(devices)
        self.dtype = dtype
        # A folder without modules.json has no Normalize module, but the SPEC recipe (and BiEncoder)
        # normalises it: only then is it asked of encode.
        self.normalize = bool(normalize)
        self.loaded_from = loaded_from
        dimension = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        self._dim = int(dimension())

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str | torch.device = "auto",
                        dtype: str | torch.dtype = "auto", setting: str = "dtype") -> ReferenceBiEncoder:
        """Load through `models.resolve("encoder", name_or_path)`; device and dtype as `BiEncoder`'s."""
        from sentence_transformers import SentenceTransformer

        resolved = resolve("encoder", str(name_or_path))
        devices = visible_devices(device)
        torch_dtype = resolve_dtype(dtype, devices, setting)
        warn_tf32(torch_dtype, devices)
        model = SentenceTransformer(resolved.path, device=str(devices[0]), local_files_only=True,
                                    model_kwargs={"dtype": torch_dtype})
        model.eval()
        plain_folder = not (Path(resolved.path) / "modules.json").is_file()
        encoder = cls(model, devices, torch_dtype, plain_folder, resolved)
        logger.info("ReferenceBiEncoder (sentence-transformers) %s on %s (%s), dim %d", resolved.name,
                    [str(d) for d in devices], torch_dtype, encoder.dim)
        return encoder

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def device(self) -> torch.device:
        return self.devices[0]

    def info(self) -> dict[str, Any]:
        """What encoded (recorded in outputs): the packed modules' keys plus encoder_backend."""
        return _info(self.loaded_from, self.dtype, self.devices)

    def encode(self, texts: Sequence[str], batch_size: int = 128, progress: bool = False) -> torch.Tensor:
        """Embeddings [n, dim], float32 on the CPU, rows in the order of `texts`."""
        texts = checked_texts(texts, "ReferenceBiEncoder.encode")
        if not texts:
            return torch.empty((0, self.dim), dtype=torch.float32)
        vectors = self.model.encode(texts, batch_size=batch_size, show_progress_bar=progress, convert_to_tensor=True,
                                    normalize_embeddings=self.normalize, device=_device_arg(self.devices))
        return vectors.float().cpu()


class ReferenceCrossEncoder:
    """`CrossEncoder.predict` (its default activation) as a `PairScorer`."""

    def __init__(self, model: Any, devices: Sequence[torch.device], dtype: torch.dtype,
                 loaded_from: ResolvedModel) -> None:
        self.model = model
        self.devices = list(devices)
        self.dtype = dtype
        self.loaded_from = loaded_from

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str | torch.device = "auto", max_length: int = 384,
                        dtype: str | torch.dtype = "auto", setting: str = "dtype") -> ReferenceCrossEncoder:
        """Load through `models.resolve("cross-encoder", name_or_path)`; arguments as `CrossEncoderModule`'s."""
        from sentence_transformers import CrossEncoder
        from transformers import AutoConfig

        resolved = resolve("cross-encoder", str(name_or_path))
        devices = visible_devices(device)
        torch_dtype = resolve_dtype(dtype, devices, setting)
        warn_tf32(torch_dtype, devices)
        positions = getattr(AutoConfig.from_pretrained(resolved.path), "max_position_embeddings", None)
        if positions:
            max_length = min(int(max_length), int(positions))
        model = CrossEncoder(resolved.path, device=str(devices[0]), max_length=max_length, local_files_only=True,
                             model_kwargs={"dtype": torch_dtype})
        model.eval()
        logger.info("ReferenceCrossEncoder (sentence-transformers) %s on %s (%s), max_length %d", resolved.name,
                    [str(d) for d in devices], torch_dtype, max_length)
        return cls(model, devices, torch_dtype, resolved)

    @property
    def device(self) -> torch.device:
        return self.devices[0]

    def info(self) -> dict[str, Any]:
        """What scored (recorded in outputs): the packed modules' keys plus encoder_backend."""
        return _info(self.loaded_from, self.dtype, self.devices)

    def score(self, pairs: Sequence[tuple[str, str]], batch_size: int = 256, progress: bool = False) -> torch.Tensor:
        """Scores [n] float32 on the CPU, one per (query, passage) pair, in input order."""
        firsts, seconds = split_pairs(pairs, "ReferenceCrossEncoder.score")
        if not firsts:
            return torch.empty(0, dtype=torch.float32)
        scores = self.model.predict(list(zip(firsts, seconds, strict=True)), batch_size=batch_size,
                                    show_progress_bar=progress, convert_to_tensor=True,
                                    device=_device_arg(self.devices))
        return scores.float().cpu().reshape(-1)
