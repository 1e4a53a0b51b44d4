"""One vector per text, whatever batch it comes in: the read paths compared (batched against one question at a
time) must see the same question and PRF embeddings, which an encoder's batch composition would change."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def cached_embed(encoder: Any) -> Callable[[list[str]], torch.Tensor]:
    """`embed(texts) -> [n, d]` over `encoder.encode`, each distinct text encoded once and remembered."""
    cache: dict[str, torch.Tensor] = {}

    def embed(texts: list[str]) -> torch.Tensor:
        todo = [text for text in dict.fromkeys(texts) if text not in cache]
        if todo:
            cache.update(zip(todo, encoder.encode(todo), strict=True))
        return torch.stack([cache[text] for text in texts])

    return embed
