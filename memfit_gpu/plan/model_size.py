"""Model sizes: from the weights on disk, else the known-model table, else unknown (said loudly)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memfit_gpu.devices import parse_dtype
from memfit_gpu.models import find_local
from memfit_gpu.plan.sizes import _DTYPE_BYTES, KNOWN_MODELS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSize:
    name: str
    weight_bytes: int | None  # in the dtype it runs in; None = unknown
    source: str  # "on disk (PATH)" | "from the known-model table ..." | "UNKNOWN ..."
    shape: dict[str, Any] = field(default_factory=dict)  # config.json fields (hidden_size, num_hidden_layers, ...)

    @property
    def known(self) -> bool:
        return self.weight_bytes is not None

    @property
    def origin(self) -> str:
        """Where the size came from, in a word: disk | table | UNKNOWN."""
        return "disk" if self.source.startswith("on disk") else "table" if self.known else "UNKNOWN"

    def get(self, key: str, default: int = 0) -> int:
        value = self.shape.get(key)
        return int(value) if isinstance(value, (int, float)) and value else default

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token (full attention; sliding windows would need less)."""
        heads = self.get("num_attention_heads", 1)
        head_dim = self.get("head_dim", self.get("hidden_size") // max(1, heads))
        return 2 * self.get("num_hidden_layers") * self.get("num_key_value_heads", heads) * head_dim * dtype_bytes


def _weights_on_disk(folder: Path) -> int:
    index = next(iter(sorted(folder.glob("*.safetensors.index.json"))), None)
    if index is not None:
        files = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return sum((folder / f).stat().st_size for f in files if (folder / f).is_file())
    for pattern in ("*.safetensors", "pytorch_model*.bin", "model*.bin"):
        files = sorted(folder.glob(pattern))
        if files:
            return sum(f.stat().st_size for f in files)
    return 0


def _shape_of(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json's sizing fields; a multimodal model's text model (text_config) first."""
    text = config.get("text_config") or config.get("llm_config") or {}
    merged = {**config, **text}
    merged["dtype"] = str(merged.get("torch_dtype") or merged.get("dtype") or "")
    if config.get("quantization_config") or text.get("quantization_config"):
        merged["dtype"] = "quantised"
    return merged


def _scaled(weight_bytes: int, stored: str, runtime: torch.dtype | None) -> int:
    """Weights stored in `stored` (config.json's dtype) as they sit in memory in `runtime`."""
    try:
        stored_dtype = parse_dtype(stored) if stored else None
    except ValueError:  # quantised or unnamed: what is stored is what is held
        return weight_bytes
    if stored_dtype is None or runtime is None or stored_dtype not in _DTYPE_BYTES or runtime not in _DTYPE_BYTES:
        return weight_bytes
    return weight_bytes * _DTYPE_BYTES[runtime] // _DTYPE_BYTES[stored_dtype]


def model_size(name: str, runtime: torch.dtype | None = None) -> ModelSize:
    """`name`'s weights in `runtime` (None: as stored): from the weights on disk when they are there,
    else the known-model table, else unknown (logged as a warning)."""
    folder = find_local(name)
    if folder is not None and folder.is_dir() and (folder / "config.json").is_file():
        shape = _shape_of(json.loads((folder / "config.json").read_text()))
        st_config = folder / "sentence_bert_config.json"  # sentence-transformers' own max_seq_length
        if st_config.is_file():
            shape["max_seq_length"] = json.loads(st_config.read_text()).get("max_seq_length")
        stored = _weights_on_disk(folder)
        if stored:
            return ModelSize(name, _scaled(stored, shape["dtype"], runtime), f"on disk ({folder})", shape)
    known = KNOWN_MODELS.get(name)
    if known is not None:
        return ModelSize(name, _scaled(int(known["weight_bytes"]), str(known["dtype"]), runtime),
                         "from the known-model table (no weights on disk)", dict(known))
    log.warning("plan: model %s: no weights on disk and not in the known-model table: its size is UNKNOWN and "
                "not counted", name)
    return ModelSize(name, None, "UNKNOWN (no weights on disk, not in the known-model table)", {})
