"""The one growable buffer (numpy and torch): appends across regrowth keep every value, the tail is the fill."""

from __future__ import annotations

import numpy as np
import torch

from memfit_gpu.buffers import GrowableArray, GrowableTensor


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
