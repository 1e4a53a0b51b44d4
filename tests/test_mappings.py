"""memfit_gpu.mappings: the one flattener (config check of a run directory, W&B names, aggregate)."""

from __future__ import annotations

from memfit_gpu.config import load_config, to_dict
from memfit_gpu.mappings import flatten, get_path


def test_flatten_keeps_every_leaf_under_joined_keys() -> None:
    data = {"a": {"b": 1, "c": None, "d": {"e": [1, 2]}}, "f": "x", "g": {}}
    assert flatten(data) == {"a.b": 1, "a.c": None, "a.d.e": [1, 2], "f": "x"}
    assert flatten(data, sep="/") == {"a/b": 1, "a/c": None, "a/d/e": [1, 2], "f": "x"}
    assert flatten({"b": 1}, prefix="a") == {"a.b": 1}
    assert list(flatten(data)) == ["a.b", "a.c", "a.d.e", "f"]  # the mapping's own order


def test_flatten_names_config_keys_as_dot_lists_do() -> None:
    flat = flatten(to_dict(load_config(None, ["retrieve.alpha=0.25", "reader.base_urls=[http://h:1/v1]"])))
    assert flat["retrieve.alpha"] == 0.25 and flat["reader.base_urls"] == ["http://h:1/v1"]
    assert flat["tracking.wandb.group"] is None  # an unset optional stays, so a diff can name it


def test_get_path() -> None:
    data = {"a": {"b": {"c": 3}}, "n": None}
    assert get_path(data, "a", "b", "c") == 3
    assert get_path(data, "a", "x") is None and get_path(data, "n", "x") is None and get_path(5, "a") is None
    assert get_path(data) == data
