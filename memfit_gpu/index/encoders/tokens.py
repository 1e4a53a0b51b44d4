"""`Tokens`: tokenised encoder inputs as one flat id array with row offsets.

A list of Python int lists costs ~50 B a word piece and a Python loop per padded batch; a flat array
costs 8 B and pads with one vectorised gather (batching.BatchedEncoder._collate), and a slice of rows
pickles cheaply to a worker process (workers.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Tokens"]


@dataclass
class Tokens:
    """Tokenised inputs: row r's ids are `ids[offsets[r]:offsets[r + 1]]` (token type ids alike)."""

    ids: np.ndarray  # int64 [total tokens]
    offsets: np.ndarray  # int64 [n + 1]
    types: np.ndarray | None = None  # int64 [total tokens], for models with token_type_ids

    @classmethod
    def from_lists(cls, ids: Sequence[Sequence[int]], types: Sequence[Sequence[int]] | None) -> Tokens:
        lengths = np.fromiter((len(row) for row in ids), dtype=np.int64, count=len(ids))
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])

        def flat(rows: Sequence[Sequence[int]]) -> np.ndarray:
            return np.fromiter((t for row in rows for t in row), dtype=np.int64, count=int(offsets[-1]))

        return cls(flat(ids), offsets, None if types is None else flat(types))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def take(self, rows: Sequence[int]) -> Tokens:
        """The given rows, in that order, as their own Tokens (what a worker process is sent)."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths = self.lengths[rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        gather = _positions(self.offsets[rows], lengths)
        return Tokens(self.ids[gather], offsets, None if self.types is None else self.types[gather])


def _positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Flat positions of every token of rows starting at `starts` with `lengths`, concatenated."""
    total = int(lengths.sum())
    row_of = np.repeat(np.arange(len(lengths)), lengths)
    first = np.cumsum(lengths) - lengths
    return starts[row_of] + (np.arange(total) - first[row_of])
