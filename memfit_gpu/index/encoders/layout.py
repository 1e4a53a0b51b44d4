"""What a model folder declares, read the way sentence-transformers reads it.

    sentence_transformers_layout(folder) -> (pooling modes, normalise?, sentence_bert_config.json)
    activation_from_config(config)       -> "identity" | "sigmoid": CrossEncoder.predict's default

The packed encoders follow these, so they compute what sentence-transformers computes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["activation_from_config", "sentence_transformers_layout"]


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


def sentence_transformers_layout(folder: Path) -> tuple[list[str], bool, dict[str, Any]]:
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


def activation_from_config(config: Any) -> str:
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
