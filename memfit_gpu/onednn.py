"""The one place that calls torch's private oneDNN ops (`torch.ops.mkldnn._*`), fenced behind a probe.

`linear(owner, name, x, weight, bias)` is `F.linear(x, weight, bias)`. It runs through oneDNN, with
`weight` packed once and cached on `owner`, only for fp32 or bf16 on the CPU without gradients, and only
when `available(dtype)` says this torch build has the ops and they agree with `F.linear` on a small layer.
Everywhere else (a GPU, another dtype, gradients, a torch build whose private ops are missing, renamed
or changed) it is the public `F.linear`, so nothing depends on the private ops to work.

Why bother: torch's own fp32 CPU GEMM is MKL's, which runs 1.1-1.8x slower than oneDNN on the AMD EPYC
CPUs measured here (the encoders: docs/benchmarks/history.md); oneDNN is the kernel library torch.compile
uses for the same layers. In bf16, `F.linear` already calls oneDNN, but with a weight it has not packed,
which it lays out again on every call; for one new token (a reader's decode step) that costs more than the
product. SmolLM2-135M on the EPYC, its weights packed once (`pack_linears`), gives the same bits: one
request's 40 new tokens 1.4x faster, whole answer batches 1.03-1.17x (experiments/bench_reader.py
--reference unpacked).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["PackedLinear", "available", "linear", "pack_linears", "tensor_version", "unpack_linears"]

# The dtypes `linear` packs for (each probed on its own); others always take F.linear.
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def tensor_version(tensor: torch.Tensor) -> int:
    """The in-place version counter of `tensor` (-1 for inference tensors, which keep none): part of a
    cache key, so an in-place change of a weight rebuilds what was derived from it."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


@functools.cache
def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build runs `dtype` linear layers on the CPU through oneDNN with prepacked weights.

    Probed once per dtype on a tiny layer, with the result checked against `F.linear`."""
    if dtype not in PACKED_DTYPES:
        return False
    try:
        probe = torch.Generator().manual_seed(0)  # a private generator: the global RNG stays untouched
        weight, bias = torch.randn(8, 16, generator=probe), torch.randn(8, generator=probe)
        x = torch.randn(4, 16, generator=probe)
        weight, bias, x = weight.to(dtype), bias.to(dtype), x.to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        return bool(torch.allclose(got.float(), torch.nn.functional.linear(x, weight, bias).float(), atol=tolerance,
                                   rtol=tolerance))
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
           bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; fp32 or bf16 on the CPU without gradients through oneDNN with `weight`
    packed once and cached on `owner` under `name` (rebuilt when the weight's storage or version changes)."""
    if (x.device.type != "cpu" or x.dtype != weight.dtype or weight.device.type != "cpu"
            or (bias is not None and bias.dtype != weight.dtype)
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            or not available(weight.dtype)):
        return torch.nn.functional.linear(x, weight, bias)  # the packed kernel has no backward
    key = (weight.data_ptr(), tuple(weight.shape), weight.dtype, tensor_version(weight),
           None if bias is None else (bias.data_ptr(), tensor_version(bias)))
    cache = owner.__dict__.setdefault("_memfit_gemm", _PackedWeights())  # a plain attribute, not a submodule
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        hit = cache[name] = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None),
                             None if bias is None else bias.detach().contiguous())
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), hit[1], hit[2], "none", [], "")


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` whose forward is `linear`: oneDNN with the weight packed once where that applies,
    `F.linear` elsewhere (a copy packs its own weight again, on first use)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self, "weight", x, self.weight, self.bias)


def _available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def pack_linears(module: torch.nn.Module, memory_share: float = 0.25) -> tuple[int, str]:
    """Switch every plain `nn.Linear` of `module` on the CPU to `PackedLinear`, when this torch build packs
    their dtype and the packed copies (as large as the weights: the weights stay for everything else)
    take at most `memory_share` of the memory available now. Returns (layers switched, why not all)."""
    layers = [m for m in module.modules() if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"]
    if not layers:
        return 0, "no linear layer on the CPU"
    dtypes = {m.weight.dtype for m in layers}
    if any(not available(dtype) for dtype in dtypes):
        return 0, f"this torch build packs no {', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))} weights"
    wanted = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    free = _available_memory_bytes()
    if free is not None and wanted > memory_share * free:
        return 0, (f"the packed weights ({wanted / 2**20:.0f} MiB) would take more than {memory_share:.0%} of the "
                   f"memory available ({free / 2**20:.0f} MiB)")
    for layer in layers:
        layer.__class__ = PackedLinear
    return len(layers), ""


def unpack_linears(module: torch.nn.Module) -> int:
    """Undo `pack_linears`: every `PackedLinear` of `module` back to `nn.Linear` (F.linear), its packed copy
    dropped. Returns how many (the benchmark's and the tests' reference: the same model through F.linear)."""
    layers = [m for m in module.modules() if type(m) is PackedLinear]
    for layer in layers:
        layer.__class__ = torch.nn.Linear
        layer.__dict__.pop("_memfit_gemm", None)
    return len(layers)
