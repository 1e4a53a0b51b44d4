"""memfit_gpu.kernels.segmented_scatter: torch reference by hand, Triton kernel (interpreter) vs reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import memfit_gpu.kernels.segmented_scatter as scatter_module
import pytest
import torch
from memfit_gpu.kernels.segmented_scatter import segmented_scatter_add, segmented_scatter_add_torch

# 3 terms in CSR: term 0 -> cols (1, 3) weights (0.5, 2.0); term 1 -> nothing; term 2 -> col 0 weight 4.0
TERM_PTR = torch.tensor([0, 2, 2, 3])
POST_COL = torch.tensor([1, 3, 0], dtype=torch.int32)
POST_WEIGHT = torch.tensor([0.5, 2.0, 4.0])


def test_torch_reference_by_hand():
    out = torch.zeros(2, 4)
    # (row, term, scale): row 0 gets term 0 twice (scale 1 and 3) and term 1; row 1 gets term 2 and term 0
    segmented_scatter_add_torch(
        out,
        torch.tensor([0, 0, 0, 1, 1]),
        torch.tensor([0, 1, 0, 2, 0]),
        torch.tensor([1.0, 1.0, 3.0, 0.5, 1.0]),
        TERM_PTR,
        POST_COL,
        POST_WEIGHT,
    )
    assert out.tolist() == [[0.0, 2.0, 0.0, 8.0], [2.0, 0.5, 0.0, 2.0]]


def test_no_pairs_and_empty_terms_leave_out_untouched():
    out = torch.full((1, 4), 7.0)
    segmented_scatter_add_torch(out, torch.tensor([0]), torch.tensor([1]), torch.ones(1), TERM_PTR, POST_COL, POST_WEIGHT)
    empty = torch.empty(0, dtype=torch.long)
    segmented_scatter_add_torch(out, empty, empty, torch.empty(0), TERM_PTR, POST_COL, POST_WEIGHT)
    assert out.tolist() == [[7.0] * 4]


def test_selector_uses_torch_on_cpu(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton kernel must not run on CPU tensors under backend='auto'")

    monkeypatch.setattr(scatter_module, "segmented_scatter_add_triton", refuse)
    out = segmented_scatter_add(
        torch.zeros(1, 4), torch.tensor([0]), torch.tensor([2]), torch.ones(1), TERM_PTR, POST_COL, POST_WEIGHT
    )
    assert out.tolist() == [[4.0, 0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="unknown segmented_scatter_add backend 'cuda'"):
        segmented_scatter_add(out, torch.tensor([0]), torch.tensor([2]), torch.ones(1), TERM_PTR, POST_COL, POST_WEIGHT, backend="cuda")


def test_shape_errors_are_named():
    with pytest.raises(ValueError, match="one entry per pair"):
        segmented_scatter_add_torch(
            torch.zeros(1, 4), torch.tensor([0, 0]), torch.tensor([0]), torch.ones(1), TERM_PTR, POST_COL, POST_WEIGHT
        )
    with pytest.raises(ValueError, match="float32"):
        segmented_scatter_add_torch(
            torch.zeros(1, 4, dtype=torch.float64), torch.tensor([0]), torch.tensor([0]), torch.ones(1),
            TERM_PTR, POST_COL, POST_WEIGHT,
        )


# TRITON_INTERPRET must be set before triton is first imported, so the kernel runs in a fresh process.
_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from memfit_gpu.kernels.segmented_scatter import (
        segmented_scatter_add_torch, segmented_scatter_add_triton)
    g = torch.Generator().manual_seed(0)
    n_terms, width, n_rows = 40, 300, 9
    # posting lists of varied length, up to 2.5 kernel blocks (block=128); one posting per (term, col)
    lengths = torch.randint(0, 300, (n_terms,), generator=g)
    lengths[3] = 0
    cols = torch.cat([torch.randperm(width, generator=g)[: int(n)] for n in lengths]).to(torch.int32)
    term_ptr = torch.zeros(n_terms + 1, dtype=torch.long)
    term_ptr[1:] = torch.cumsum(lengths, 0)
    weights = torch.rand(cols.numel(), generator=g)
    n_pairs = 120
    pair_row = torch.randint(0, n_rows, (n_pairs,), generator=g)
    pair_term = torch.randint(0, n_terms, (n_pairs,), generator=g)
    pair_term[:4] = 3  # pairs on an empty posting list
    pair_scale = torch.rand(n_pairs, generator=g) + 0.5
    args = (pair_row, pair_term, pair_scale, term_ptr, cols, weights)
    ref = segmented_scatter_add_torch(torch.zeros(n_rows, width), *args)
    got = segmented_scatter_add_triton(torch.zeros(n_rows, width), *args)
    print(json.dumps({"max_abs_diff": float((ref - got).abs().max()), "ref_sum": float(ref.sum()),
                      "nonzero": int((ref != 0).sum()), "nonzero_match": bool(torch.equal(ref != 0, got != 0))}))
    """
)


def test_triton_kernel_matches_torch_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["nonzero"] > 1000  # the case exercises many blocks and overlapping rows
    assert result["nonzero_match"]
    # the kernel's atomics add in another order than index_add_: float32 rounding only
    assert result["max_abs_diff"] <= 1e-5 * max(1.0, result["ref_sum"] / result["nonzero"])

