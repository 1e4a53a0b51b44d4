"""What every encoder backend offers (packed and sentence-transformers alike), and the inputs it accepts.

    TextEncoder.encode(texts, batch_size, progress) -> [n, dim] float32 on the CPU, rows in input order
    PairScorer.score(pairs, batch_size, progress)    -> [n] float32 on the CPU, one per (query, passage)
    .info()                                          -> what ran: weights, dtype, devices (recorded in outputs)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class TextEncoder(Protocol):
    """A bi-encoder: text -> embedding (L2-normalised when the model says so)."""

    dtype: torch.dtype
    devices: list[torch.device]

    @property
    def dim(self) -> int: ...

    def encode(self, texts: Sequence[str], batch_size: int = 128, progress: bool = False) -> torch.Tensor: ...

    def info(self) -> dict[str, Any]: ...


@runtime_checkable
class PairScorer(Protocol):
    """A cross-encoder: (query, passage) -> one score, after the model's default activation."""

    dtype: torch.dtype
    devices: list[torch.device]

    def score(self, pairs: Sequence[tuple[str, str]], batch_size: int = 256,
              progress: bool = False) -> torch.Tensor: ...

    def info(self) -> dict[str, Any]: ...


def checked_texts(texts: Sequence[str], who: str) -> list[str]:
    """`texts` as a list; TypeError naming `who` and the index of the first item that is not a str."""
    out = list(texts)
    for i, text in enumerate(out):
        if not isinstance(text, str):
            raise TypeError(f"{who}: texts[{i}] is {type(text).__name__}, not str")
    return out


def split_pairs(pairs: Sequence[tuple[str, str]], who: str) -> tuple[list[str], list[str]]:
    """(queries, passages) of `pairs`; TypeError naming `who` and the first item that is not a (str, str)."""
    firsts: list[str] = []
    seconds: list[str] = []
    for i, pair in enumerate(pairs):
        if len(pair) != 2 or not isinstance(pair[0], str) or not isinstance(pair[1], str):
            raise TypeError(f"{who}: pairs[{i}] is not a (str, str) pair")
        firsts.append(pair[0])
        seconds.append(pair[1])
    return firsts, seconds
