"""Growable buffers: append-only columns whose capacity grows geometrically, so one-row appends stay O(1)
amortised, and a compact column of strings.

The store's metadata columns and the dense index's row maps are numpy (`GrowableArray`); the BM25
postings and statistics are torch tensors on the index's device (`GrowableTensor`). Both keep the
unused tail filled with their `fill` value and expose the used part as `view` (no copy). Capacity
doubles while a buffer is small and grows by a quarter once it holds more than `_DOUBLING_LIMIT`
entries, so the copy made while growing a large buffer (old and new side by side) costs at most
2.25 x its size instead of 3 x; `trim()` drops the spare capacity (before a snapshot is written).

`TextColumn` holds strings as UTF-8 bytes in a few numpy blocks with one int64 offset per string: a
million episode texts cost their bytes plus 8 bytes each, not a Python object each.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

_FIRST_CAPACITY = 64
_DOUBLING_LIMIT = 1 << 24


def _grown_capacity(need: int, capacity: int) -> int:
    """Geometric growth (x2 while small, x1.25 when large): a run of n appends copies O(n) entries in all."""
    factor = 2.0 if capacity < _DOUBLING_LIMIT else 1.25
    return max(need, int(capacity * factor))


class GrowableArray:
    """A numpy column that grows geometrically."""

    def __init__(self, dtype: Any, fill: Any = 0):
        self._data = np.full(_FIRST_CAPACITY, fill, dtype=dtype)
        self._fill = fill
        self.size = 0

    def extend(self, values: Sequence[Any] | np.ndarray) -> None:
        values = np.asarray(values, dtype=self._data.dtype)
        need = self.size + len(values)
        if need > len(self._data):
            grown = np.full(_grown_capacity(need, len(self._data)), self._fill, dtype=self._data.dtype)
            grown[: self.size] = self._data[: self.size]
            self._data = grown
        self._data[self.size : need] = values
        self.size = need

    def truncate(self, size: int) -> None:
        """Forget every entry from `size` on (the tail is refilled with the fill value)."""
        if size < self.size:
            self._data[size : self.size] = self._fill
            self.size = size

    @property
    def view(self) -> np.ndarray:
        """The used entries (a view: writes go to the buffer)."""
        return self._data[: self.size]


class GrowableTensor:
    """A 1-D torch tensor on one device that grows geometrically."""

    def __init__(self, dtype: torch.dtype, device: torch.device, fill: int | float | bool = 0):
        self._fill = fill
        self._data = torch.full((_FIRST_CAPACITY,), fill, dtype=dtype, device=device)
        self.size = 0

    def extend(self, values: torch.Tensor) -> None:
        need = self.size + values.numel()
        if need > self._data.numel():
            grown = torch.full((_grown_capacity(need, self._data.numel()),), self._fill, dtype=self._data.dtype,
                               device=self._data.device)
            grown[: self.size] = self._data[: self.size]
            self._data = grown
        self._data[self.size : need] = values.to(self._data.device, self._data.dtype)
        self.size = need

    def ensure(self, size: int) -> None:
        """Grow (with the fill value) to at least ``size`` entries."""
        if size > self.size:
            self.extend(torch.full((size - self.size,), self._fill, dtype=self._data.dtype))

    def trim(self) -> None:
        """Drop the spare capacity: afterwards `view` is the whole storage (torch.save writes no more)."""
        if self._data.numel() != self.size:
            self._data = self._data[: self.size].clone()

    @property
    def dtype(self) -> torch.dtype:
        return self._data.dtype

    @property
    def data(self) -> torch.Tensor:
        """The whole storage, spare capacity included (its device and bytes)."""
        return self._data

    @property
    def view(self) -> torch.Tensor:
        """The used entries (a view: writes go to the buffer)."""
        return self._data[: self.size]

    @property
    def device(self) -> torch.device:
        return self._data.device

    @property
    def capacity_bytes(self) -> int:
        """Bytes held on the device, spare capacity included (what a memory budget must count)."""
        return self._data.nbytes

    def to(self, device: torch.device) -> None:
        """Move the buffer to ``device`` (in place)."""
        self._data = self._data.to(device)


_MERGE_BELOW = 1 << 20  # TextColumn: blocks smaller than this are merged with the next one appended


class TextColumn:
    """An append-only column of strings stored as UTF-8 bytes: a few uint8 blocks and an int64 offset per string.

    Indexing follows a numpy object column: `column[i]` is a str; a slice, an index array or a boolean
    mask gives an object ndarray (with `.tolist()`); `tolist()` decodes every string.
    """

    def __init__(self, values: Iterable[str] = ()):
        self._blocks: list[np.ndarray] = []
        self._block_start: list[int] = []  # first byte of each block
        self._offsets = GrowableArray(np.int64)
        self._offsets.extend([0])
        self.extend(values)

    def __len__(self) -> int:
        return self._offsets.size - 1

    @property
    def nbytes(self) -> int:
        """Bytes held: the UTF-8 text and the offsets."""
        return int(sum(b.nbytes for b in self._blocks)) + 8 * self._offsets.size

    def sizes(self, rows: np.ndarray) -> np.ndarray:
        """UTF-8 bytes of the strings at `rows` (int64), without decoding them."""
        offsets = self._offsets.view
        rows = np.asarray(rows, dtype=np.int64)
        return offsets[rows + 1] - offsets[rows]

    def extend(self, values: Iterable[str]) -> None:
        encoded = [v.encode("utf-8") for v in values]
        if not encoded:
            return
        ends = np.cumsum([len(e) for e in encoded], dtype=np.int64)
        first = int(self._offsets.view[-1])
        self._offsets.extend(first + ends)
        block = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        # merge small trailing blocks so that appending one string at a time keeps few blocks
        while self._blocks and self._blocks[-1].nbytes < max(_MERGE_BELOW, block.nbytes):
            block = np.concatenate([self._blocks.pop(), block])
            first = self._block_start.pop()
        self._blocks.append(block)
        self._block_start.append(first)

    def truncate(self, size: int) -> None:
        """Forget every string from `size` on."""
        if size >= len(self):
            return
        end = int(self._offsets.view[size])
        while self._blocks and self._block_start[-1] >= end:
            self._blocks.pop()
            self._block_start.pop()
        if self._blocks:
            self._blocks[-1] = self._blocks[-1][: end - self._block_start[-1]].copy()
        self._offsets.truncate(size + 1)

    def _get(self, i: int) -> str:
        offsets = self._offsets.view
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        if lo == hi:
            return ""
        b = bisect.bisect_right(self._block_start, lo) - 1
        start = self._block_start[b]
        return self._blocks[b][lo - start : hi - start].tobytes().decode("utf-8")

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, np.integer)):
            i = int(key)
            n = len(self)
            if not -n <= i < n:
                raise IndexError(f"TextColumn index {i} out of range ({n} strings)")
            return self._get(i % n if i < 0 else i)
        rows = np.arange(len(self))[key]
        out = np.empty(len(rows), dtype=object)
        out[:] = [self._get(int(r)) for r in rows]
        return out

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self)):
            yield self._get(i)

    def tolist(self) -> list[str]:
        return list(self)
