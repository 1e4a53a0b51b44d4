"""Summary rows of a store: their own row space, which the summary indexes share."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from memfit_gpu.buffers import GrowableArray


@dataclass(frozen=True)
class Summary:
    row: int
    text: str
    memory_idx: int
    members: np.ndarray  # episode rows (provenance), time order
    event_time: np.datetime64  # first member's timestamp
    recorded_time: np.datetime64  # last member's timestamp
    deleted: bool  # retired (a member was deleted); its index rows are tombstoned
    replaces: int  # the summary row this one rebuilt, -1 for none


@dataclass
class SummaryTable:
    """Summary rows (their own row space; the summary indexes use the same numbers)."""

    text: list[str] = field(default_factory=list)
    memory_idx: GrowableArray = field(default_factory=lambda: GrowableArray(np.int32))
    members: list[np.ndarray] = field(default_factory=list)  # episode rows, in time order (provenance)
    event_time: GrowableArray = field(default_factory=lambda: GrowableArray("datetime64[s]", np.datetime64("NaT", "s")))
    recorded_time: GrowableArray = field(default_factory=lambda: GrowableArray("datetime64[s]", np.datetime64("NaT", "s")))
    deleted: GrowableArray = field(default_factory=lambda: GrowableArray(np.bool_, False))  # replaced or retired
    replaces: GrowableArray = field(default_factory=lambda: GrowableArray(np.int64, -1))  # the summary this one rebuilt

    def __len__(self) -> int:
        return len(self.text)

    def __getitem__(self, row: int) -> Summary:
        return Summary(
            row=int(row), text=self.text[row], memory_idx=int(self.memory_idx.view[row]), members=self.members[row],
            event_time=self.event_time.view[row], recorded_time=self.recorded_time.view[row],
            deleted=bool(self.deleted.view[row]), replaces=int(self.replaces.view[row]),
        )

    def __iter__(self) -> Iterator[Summary]:
        """Every summary row, retired ones included (their index rows are tombstoned)."""
        return (self[row] for row in range(len(self)))

    def live_rows(self, memory_idx: int | None = None) -> np.ndarray:
        live = ~self.deleted.view
        if memory_idx is not None:
            live &= self.memory_idx.view == memory_idx
        return np.flatnonzero(live)
