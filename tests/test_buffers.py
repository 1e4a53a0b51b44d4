"""The one growable buffer (numpy and torch): appends across regrowth keep every value, the tail is the fill."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import memfit_gpu.buffers as buffers
from memfit_gpu.buffers import GrowableArray, GrowableTensor, TextColumn


def test_array_appends_across_regrowth_keep_values():
    column = GrowableArray(np.int64, fill=-1)
    assert column.view.tolist() == [] and column.size == 0
    column.extend([1, 2])
    column.extend(np.arange(3, 200))  # past the first capacity: regrows
    for value in range(200, 330):  # one at a time: regrows again
        column.extend([value])
    assert column.view.tolist() == list(range(1, 330)) and column.size == 329
    column.view[0] = 7  # a view: writes reach the buffer
    assert column.view[0] == 7


def test_array_keeps_its_dtype_and_fill():
    times = GrowableArray("datetime64[s]", np.datetime64("NaT", "s"))
    times.extend([np.datetime64("2023-05-08T13:56:00", "s")])
    assert times.view.dtype == np.dtype("datetime64[s]") and times.view.tolist() == [
        np.datetime64("2023-05-08T13:56:00", "s").astype(object)]
    flags = GrowableArray(np.bool_, False)
    flags.extend([1, 0])
    assert flags.view.dtype == np.bool_ and flags.view.tolist() == [True, False]


def test_tensor_appends_ensure_and_move():
    buffer = GrowableTensor(torch.long, torch.device("cpu"), fill=-5)
    buffer.extend(torch.arange(100))
    buffer.extend(torch.tensor([100], dtype=torch.int32))  # converted to the buffer's dtype
    assert buffer.view.tolist() == list(range(101)) and buffer.view.dtype == torch.long
    buffer.ensure(103)  # grows with the fill value
    buffer.ensure(50)  # never shrinks
    assert buffer.size == 103 and buffer.view[-2:].tolist() == [-5, -5]
    buffer.view[0] = 9
    buffer.to(torch.device("cpu"))
    assert buffer.view[0].item() == 9 and buffer.view.device == torch.device("cpu")


def test_tensor_trim_drops_spare_capacity_and_keeps_values():
    column = GrowableTensor(torch.int32, torch.device("cpu"))
    column.extend(torch.arange(100, dtype=torch.int32))
    assert column.data.numel() == 128
    column.trim()
    assert column.data.numel() == 100 and column.view.tolist() == list(range(100))
    column.extend(torch.tensor([7], dtype=torch.int32))  # grows again after a trim
    assert column.view.tolist() == [*range(100), 7]


def test_growth_is_geometric_and_gentler_when_large():
    assert buffers._grown_capacity(65, 64) == 128
    big = buffers._DOUBLING_LIMIT
    assert buffers._grown_capacity(big + 1, big) == int(big * 1.25)
    assert buffers._grown_capacity(10 * big, big) == 10 * big  # never less than needed


def test_text_column_indexes_like_an_object_column():
    values = ["a", "bé", "", "日本語", "x" * 3000]
    column = TextColumn(values[:2])
    for value in values[2:]:  # one at a time: small blocks are merged, few remain
        column.extend([value])
    column.extend([str(i) for i in range(2000)])
    everything = values + [str(i) for i in range(2000)]
    assert len(column) == len(everything) and column.tolist() == everything and list(column) == everything
    assert column[3] == "日本語" and column[-1] == "1999" and column[np.int64(1)] == "bé"
    assert column[[0, 3]].tolist() == ["a", "日本語"] and column[1:3].tolist() == ["bé", ""]
    mask = np.zeros(len(column), dtype=bool)
    mask[[2, 4]] = True
    assert column[mask].tolist() == ["", "x" * 3000]
    assert len(column._blocks) <= 3
    assert column.nbytes == sum(len(v.encode()) for v in everything) + 8 * (len(everything) + 1)
    column.truncate(4)
    assert column.tolist() == values[:4]
    column.extend(["z"])
    assert column.tolist() == [*values[:4], "z"]
    with pytest.raises(IndexError, match="out of range"):
        column[5]
