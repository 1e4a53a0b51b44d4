"""memfit_gpu/onednn.py: linear layers through oneDNN with their weights packed once (fp32: the encoders; bf16:
the CPU reader), the public F.linear wherever that does not apply, and the same numbers either way."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from memfit_gpu import onednn


def test_cpu_linear_packs_once_and_follows_weight_changes() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(5, 16)
    with torch.inference_mode():
        torch.testing.assert_close(onednn.linear(layer, "w", x, layer.weight, layer.bias), layer(x), atol=1e-5, rtol=0)
    if onednn.available():  # this torch build packs weights: the pack is cached and reused
        first = layer.__dict__["_memfit_gemm"]["w"]
        onednn.linear(layer, "w", x, layer.weight, layer.bias)
        assert layer.__dict__["_memfit_gemm"]["w"] is first
    with torch.no_grad():
        layer.weight.mul_(2.0)  # an in-place change bumps the version: the pack is rebuilt
    torch.testing.assert_close(onednn.linear(layer, "w", x, layer.weight, layer.bias), layer(x), atol=1e-5, rtol=0)
    twin = copy.deepcopy(layer)  # packed tensors cannot be copied: the copy starts without them
    assert not twin.__dict__.get("_memfit_gemm")
    torch.testing.assert_close(onednn.linear(twin, "w", x, twin.weight, twin.bias), layer(x), atol=1e-5, rtol=0)


SHAPES_CHILD = """
import memfit_gpu, torch
from memfit_gpu import onednn
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
layer = torch.nn.Linear(384, 1536)
with torch.inference_mode():
    for rows in range(1, 401):  # a batch of another token count each time, as a served memory's batches are
        onednn.linear(layer, "w", torch.randn(rows, 384), layer.weight, layer.bias)
        if rows == 200:
            half = rss()
print(rss() - half)
"""


@pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN linear ops to cache")
def test_torch_keeps_a_bounded_number_of_cpu_kernels_for_new_shapes() -> None:
    """torch's oneDNN caches held a compiled kernel for each of up to 1,024 shapes each: a served memory grew
    by ~1 GiB over 20,000 requests (bench_soak). Importing memfit_gpu bounds them (a value the environment
    gives wins): over the second 200 of 400 new shapes the process grows by a fraction of what it grows
    with the caches at torch's default."""
    def growth(**env: str) -> float:
        base = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
        done = subprocess.run([sys.executable, "-c", SHAPES_CHILD], env={**base, "OMP_NUM_THREADS": "1", **env},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return float(done.stdout.strip().splitlines()[-1])

    bounded = growth()
    unbounded = growth(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024")
    assert unbounded > 40.0, unbounded  # torch's default keeps every shape: ~0.6 MiB each
    assert bounded < 0.25 * unbounded, (bounded, unbounded)


def test_cpu_linear_keeps_gradients_when_they_are_wanted() -> None:
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    onednn.linear(layer, "w", x, layer.weight, layer.bias).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_bf16_linear_equals_f_linear_bit_for_bit(bias: bool, rows: int) -> None:
    """A reader's layers in bf16 (no bias, a decode step's 1-3 rows, a prompt's many, with a batch dimension):
    packed or not, the same bits as F.linear on this CPU."""
    gen = torch.Generator().manual_seed(rows)
    layer = torch.nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    x = torch.randn(2, rows, 64, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        got = onednn.linear(layer, "weight", x, layer.weight, layer.bias)
        assert got.dtype == torch.bfloat16 and torch.equal(got, F.linear(x, layer.weight, layer.bias))
    assert ("weight" in layer.__dict__.get("_memfit_gemm", {})) == onednn.available(torch.bfloat16)


def test_another_dtype_takes_f_linear() -> None:
    layer = torch.nn.Linear(8, 4).to(torch.float16)
    x = torch.randn(3, 8).to(torch.float16)
    assert not onednn.available(torch.float16)  # fp16 is not probed: never packed
    with torch.inference_mode():
        assert torch.equal(onednn.linear(layer, "weight", x, layer.weight, layer.bias), F.linear(x, layer.weight, layer.bias))
    assert not layer.__dict__.get("_memfit_gemm")


class _Scaled(torch.nn.Linear):
    """A subclass with a forward of its own: pack_linears leaves it alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * super().forward(x)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 48, bias=False), torch.nn.GELU(), _Scaled(48, 16)).to(torch.bfloat16)


def test_pack_linears_switches_the_plain_layers_and_keeps_every_output() -> None:
    model = _model()
    x = torch.randn(4, 32).to(torch.bfloat16)
    with torch.inference_mode():
        before = model(x)
        packed, why = onednn.pack_linears(model)
        if not onednn.available(torch.bfloat16):  # nothing switched, and it says why
            assert (packed, why) == (0, "this torch build packs no bfloat16 weights")
            assert type(model[0]) is torch.nn.Linear and torch.equal(model(x), before)
            return
        assert (packed, why) == (1, "")
        assert type(model[0]) is onednn.PackedLinear and type(model[2]) is _Scaled
        assert torch.equal(model(x), before)
        assert "weight" in model[0].__dict__["_memfit_gemm"]
        twin = copy.deepcopy(model)  # a copy packs its own weight again, from its own tensor
        assert type(twin[0]) is onednn.PackedLinear and not twin[0].__dict__.get("_memfit_gemm")
        twin[0].weight.mul_(0.5)
        assert torch.equal(model(x), before) and not torch.equal(twin(x), before)
        assert onednn.unpack_linears(model) == 1  # undone: F.linear again, the packed copy dropped
        assert type(model[0]) is torch.nn.Linear and not model[0].__dict__.get("_memfit_gemm")
        assert torch.equal(model(x), before)


def test_pack_linears_refuses_what_memory_cannot_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    monkeypatch.setattr(onednn, "_available_memory_bytes", lambda: 4 * 2**20)  # 4 MiB free: 1 MiB allowed
    big = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False).to(torch.bfloat16))  # 2 MiB of weights
    packed, why = onednn.pack_linears(big)
    assert packed == 0 and type(big[0]) is torch.nn.Linear
    if onednn.available(torch.bfloat16):
        assert why == "the packed weights (2 MiB) would take more than 25% of the memory available (4 MiB)"
    assert onednn.pack_linears(torch.nn.Sequential(torch.nn.GELU())) == (0, "no linear layer on the CPU")
    assert onednn.pack_linears(model, memory_share=1.0)[0] == (1 if onednn.available(torch.bfloat16) else 0)
