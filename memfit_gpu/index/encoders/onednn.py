"""The one place that calls torch's private oneDNN ops (`torch.ops.mkldnn._*`), fenced behind a probe.

`linear(owner, name, x, weight, bias)` is `F.linear(x, weight, bias)`. It runs through oneDNN, with
`weight` packed once and cached on `owner`, only for fp32 on the CPU without gradients, and only when
`available()` says this torch build has the ops and they agree with `F.linear` on a small layer.
Everywhere else (a GPU, another dtype, gradients, a torch build whose private ops are missing, renamed
or changed) it is the public `F.linear`, so the encoders never depend on the private ops to work.

Why bother: torch's own fp32 CPU GEMM is MKL's, which runs 1.1-1.8x slower than oneDNN on the AMD EPYC
CPUs measured here (docs/benchmarks/history.md); oneDNN is the kernel library torch.compile uses for the same
layers.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["available", "linear", "tensor_version"]


def tensor_version(tensor: torch.Tensor) -> int:
    """The in-place version counter of `tensor` (-1 for inference tensors, which keep none): part of a
    cache key, so an in-place change of a weight rebuilds what was derived from it."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether this torch build runs fp32 linear layers through oneDNN with prepacked weights.

    Probed once on a tiny layer, with the result checked against `F.linear`."""
    try:
        probe = torch.Generator().manual_seed(0)  # a private generator: the global RNG stays untouched
        weight, bias = torch.randn(8, 16, generator=probe), torch.randn(8, generator=probe)
        x = torch.randn(4, 16, generator=probe)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return bool(torch.allclose(got, torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5))
    except (AttributeError, RuntimeError, TypeError):
        return False


class _PackedWeights(dict):
    """oneDNN-packed weights cached on a module. A copied or pickled module starts without them:
    packed (mkldnn) tensors can be neither, and they are rebuilt on first use."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _PackedWeights:
        return _PackedWeights()

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (_PackedWeights, ())


def linear(owner: torch.nn.Module, name: str, x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; fp32 on the CPU without gradients through oneDNN with `weight` packed
    once and cached on `owner` under `name` (rebuilt when the weight's storage or version changes)."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) or not available()):
        return torch.nn.functional.linear(x, weight, bias)  # the packed kernel has no backward
    key = (weight.data_ptr(), tuple(weight.shape), tensor_version(weight), bias.data_ptr(), tensor_version(bias))
    cache = owner.__dict__.setdefault("_memfit_gemm", _PackedWeights())  # a plain attribute, not a submodule
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        hit = cache[name] = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None),
                             bias.detach().contiguous())
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), hit[1], hit[2], "none", [], "")
