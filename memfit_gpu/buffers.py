"""Growable 1-D buffers: append-only columns whose capacity doubles, so one-row appends stay O(1) amortised.

The store's metadata columns and the dense index's row maps are numpy (`GrowableArray`); the BM25
postings and statistics are torch tensors on the index's device (`GrowableTensor`). Both keep the
unused tail filled with their `fill` value and expose the used part as `view` (no copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_FIRST_CAPACITY = 64


def _grown_capacity(need: int, capacity: int) -> int:
    """Doubling: a run of n appends copies O(n) entries in all."""
    return max(need, 2 * capacity)


class GrowableArray:
    """A numpy column that grows by doubling."""

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

    @property
    def view(self) -> np.ndarray:
        """The used entries (a view: writes go to the buffer)."""
        return self._data[: self.size]


class GrowableTensor:
    """A 1-D torch tensor on one device that grows by doubling."""

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
