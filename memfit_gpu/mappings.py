"""Nested mappings (configs, metrics.json) read as one level of joined keys.

`flatten` is the package's one flattener: the config check of a run directory names the dotted keys
that differ (`retrieve.alpha`), W&B logs metrics under slash-joined names (`overall/paper/f1`), and
the sweep aggregate looks values up by path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def flatten(data: Mapping[str, Any], sep: str = ".", prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1, "c": None}}` -> `{"a.b": 1, "a.c": None}`.

    Args:
        data: a mapping whose values may be mappings themselves.
        sep: what joins a parent key to its child's.
        prefix: prepended (with `sep`) to every key; "" for none.

    Returns:
        Every leaf (any value that is not a mapping: None and lists included) under its joined key,
        in the mapping's own order. An empty mapping leaves no key.
    """
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, sep, name))
        else:
            flat[name] = value
    return flat


def get_path(data: Any, *keys: str) -> Any:
    """`data[k1][k2]...`, or None where a key is missing or a level is not a mapping."""
    for key in keys:
        if not isinstance(data, Mapping) or key not in data:
            return None
        data = data[key]
    return data
