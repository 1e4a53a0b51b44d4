"""Triton kernels for the retrieval hot path, each with a torch reference (packaged as memfit_gpu.kernels).

    segmented_scatter  BM25 scoring from CSR postings: float64 sums, padded or ragged per question
    segment_topk       top-k of each question's own score segment, exact tie order
    hybrid_topk        union + min-max + alpha fusion + boosts + top-k of a batch, one launch

`resolve_backend` turns the `retrieve.kernels` setting into the path a run takes.
"""

from __future__ import annotations

import torch

from ._launch import interpreting, triton_available

__all__ = ["BACKENDS", "resolve_backend"]

BACKENDS = ("torch", "triton", "auto")


def resolve_backend(setting: str, device: torch.device, supported: bool = True) -> str:
    """"torch" or "triton" for data on ``device``: auto = Triton on CUDA (when installed), torch elsewhere.

    supported: whether the structures involved have a kernel path at all (the readable
    ReferenceBM25 has none); auto then takes torch and an explicit triton is an error."""
    if setting not in BACKENDS:
        raise ValueError(f"retrieve.kernels={setting!r} is not one of {', '.join(BACKENDS)}")
    if setting == "auto":
        return "triton" if supported and device.type == "cuda" and triton_available() else "torch"
    if setting == "triton":
        if not supported:
            raise ValueError("retrieve.kernels=triton needs index.bm25_backend=torch (the reference BM25 has no kernels)")
        if not triton_available():
            raise ValueError("retrieve.kernels=triton needs the triton package (pip install -e '.[dev]' or a CUDA torch)")
        if device.type != "cuda" and not interpreting():
            raise ValueError(f"retrieve.kernels=triton: the indexes are on {device}; Triton runs on CUDA tensors "
                             "(set index.device to a GPU, or TRITON_INTERPRET=1 to run the kernels' interpreter)")
    return setting
