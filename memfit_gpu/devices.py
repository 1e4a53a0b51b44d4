"""Devices and dtypes: the one module that turns the config's device and dtype strings into torch's.

    visible_devices("auto")          every visible GPU, else [cpu]
    visible_devices("cuda:0,cuda:1") [cuda:0, cuda:1];  "cuda" / "gpu": every GPU (an error without one)
    first_device(spec)               where a single-device structure (the BM25 index) lives: the first one
    visible_gpu_ids()                GPU ids as CUDA_VISIBLE_DEVICES spells them (vLLM engine groups)
    resolve_dtype(dtype, devices)    encoders: "auto" = float32 everywhere (bf16 holds hit rates, not top-10 order)
    reader_dtype(dtype, device)      generation: "auto" = bf16 where it is native (GPU: else fp16; CPU: else fp32)
    cpu_native_bf16()                whether this CPU computes bf16 itself (AVX512-BF16 or AMX tiles)
    cpu_amx()                        whether this CPU has AMX tiles (auto's log says what bf16 would give there)
    warn_tf32(dtype, devices)        fp32 on a GPU with TF32 matmuls on is not fp32: say so
    device_guard(device)             the context a kernel launch runs under (the tensors' GPU)
    synchronize(device)              wait for a GPU's queued work (stage clocks); a no-op elsewhere
    is_oom(exc)                      a device out of memory (torch's error or a CUDA library's)
    describe()                       the CPU and the visible GPUs (name, memory, capability, driver, CUDA)
    in_fresh_thread(call, *args)     run CPU torch work that is not the process's own on a thread that then ends

The encoders and the readers want different "auto" dtypes on purpose: encoders reproduce the paper's
fp32 packs on every CPU, an AMX one included, where bf16 encodes 2.7x faster but keeps fp32's top-10 order on
65 % of LoCoMo's questions only (docs/benchmarks/history.md "Encoders in bf16"); a reader generates text, where
bf16's range matters more than its last bits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

__all__ = ["DTYPES", "cpu_amx", "cpu_native_bf16", "describe", "in_fresh_thread", "device_guard", "driver_version", "first_device", "gpu_count", "parse_dtype", "reader_dtype",
           "resolve_dtype", "is_oom", "synchronize", "visible_devices", "visible_gpu_ids", "warn_tf32"]

logger = logging.getLogger(__name__)

# Every spelling the config accepts for a dtype ("auto" aside).
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


def gpu_count() -> int:
    """GPUs torch can use in this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def visible_devices(device: str | torch.device | Sequence[str] = "auto", gpus: int | None = None) -> list[torch.device]:
    """Devices to place replicas on: "auto" = every visible GPU, else the CPU.

    Also accepts "cpu", "cuda" or "gpu" (every GPU), "cuda:1", a comma list "cuda:0,cuda:2" or a list.
    gpus: how many GPUs there are (the device plan's described node); None = the GPUs torch sees.
    """
    if isinstance(device, torch.device):
        return [device]
    if not isinstance(device, str):
        return [d for item in device for d in visible_devices(item, gpus)]
    spec = device.strip().lower()
    if "," in spec:
        return [d for item in spec.split(",") if item.strip() for d in visible_devices(item, gpus)]
    seen = "torch sees" if gpus is None else "the node has"
    if spec in ("auto", "cuda", "gpu"):
        count = gpu_count() if gpus is None else gpus
        if count:
            return [torch.device("cuda", i) for i in range(count)]
        if spec != "auto":
            raise RuntimeError(f"device={device!r} asked for GPUs but {seen} none")
        return [torch.device("cpu")]
    parsed = torch.device(spec)
    if parsed.type == "cuda":
        count = gpu_count() if gpus is None else gpus
        index = 0 if parsed.index is None else parsed.index
        if index >= count:
            raise RuntimeError(f"device={device!r}: {seen} {count} GPU(s)")
        return [torch.device("cuda", index)]
    return [parsed]


def first_device(device: str | torch.device | Sequence[str] = "auto") -> torch.device:
    """The device of a structure that lives on one device only (the BM25 index): the first listed.

    "gpu" and "cuda:0,cuda:1" are valid `index.device` values (the encoders replicate over them),
    so they must not reach `torch.device` as they are."""
    devices = visible_devices(device)
    if not devices:
        raise RuntimeError(f"device={device!r} names no device")
    return devices[0]


def visible_gpu_ids() -> list[str]:
    """GPU ids this process may use, as CUDA_VISIBLE_DEVICES spells them (empty without CUDA).

    A child process given CUDA_VISIBLE_DEVICES=<some of these> sees exactly those GPUs."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = None
    if env is not None:
        ids = [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
        if not ids:
            return []
    try:
        count = gpu_count()
    except Exception:  # noqa: BLE001 - a broken CUDA install means no GPU for us
        count = 0
    if count == 0:
        return []
    return ids[:count] if ids is not None else [str(i) for i in range(count)]


def describe() -> dict[str, Any]:
    """The machine a run computes on, for its record (provenance.json): the CPU (model, cores, RAM) and
    every GPU this process sees (name, memory, compute capability), with torch's CUDA version and the
    driver's (nvidia-smi; None when it is not there)."""
    gpus = []
    for index in range(gpu_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": str(props.name), "memory_bytes": int(props.total_memory),
                     "capability": f"{props.major}.{props.minor}"})
    return {
        "cpu": {"model": _cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
        "gpus": gpus,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "torch_cuda": torch.version.cuda,
        "driver": driver_version() if gpus else None,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def driver_version() -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it; None without nvidia-smi or when it fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines() if done.returncode == 0 else []
    return lines[0].strip() if lines else None


def parse_dtype(dtype: str | torch.dtype, setting: str = "dtype") -> torch.dtype | None:
    """`dtype` as a torch dtype; None for "auto" (the caller's policy decides).

    Raises ValueError naming `setting` (e.g. "index.dtype") for a name that is not a float dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).strip().lower()
    if key == "auto":
        return None
    if key not in DTYPES:
        raise ValueError(f"{setting}={dtype!r} is not a dtype: use auto or one of {', '.join(DTYPES)}")
    return DTYPES[key]


def _native_bf16(device: torch.device) -> bool:
    with torch.cuda.device(device):
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def resolve_dtype(dtype: str | torch.dtype, devices: Sequence[torch.device], setting: str = "dtype",
                  amx: bool | None = None) -> torch.dtype:
    """The encoders' compute dtype: "auto" = float32 on every device; float32 / bf16 / fp16 when asked.

    fp32 keeps packs equal to the CPU/fp32 packs the paper's numbers come from. bf16 was measured over
    LoCoMo's 1,540 questions (docs/benchmarks/history.md "Encoders in bf16"): hit@5 / hit@10 / pack hit stay within
    0.15 point of fp32's, but a top-10 list equals fp32's in order on 63-65 % of the questions (89 % as a
    set), far from the 97 % a default must keep, and a question encoded alone gets the batched pack on 99 %
    only; the noise is the GEMM inputs' rounding to bf16, measured on an AMX CPU too. So bf16 is a choice
    (`index.dtype: bf16`: 1.6x the encode rate on an AVX512-BF16 CPU, 2.7x on an AMX one), and on a
    CPU with AMX tiles "auto" says so once in the log. In bf16 the cross-encoder's logits in [4, 8) are 1/32
    apart, so its head runs in float32 (index/encoders/cross_encoder.py). bf16 is refused on GPUs that only
    emulate it (V100, T4): use fp16 there.

    amx: whether the CPU has AMX tiles, for that log line (the tests' probe); None = cpu_amx()."""
    chosen = parse_dtype(dtype, setting)
    if chosen is None:
        cpu_only = bool(devices) and all(torch.device(d).type == "cpu" for d in devices)
        if cpu_only and (cpu_amx() if amx is None else amx):
            _hint_amx(setting)
        return torch.float32
    if chosen == torch.bfloat16:
        for device in devices:
            if device.type == "cuda" and not _native_bf16(device):
                raise ValueError(f"{setting} bf16: {torch.cuda.get_device_name(device)} ({device}) has no native "
                                 "bf16 (it would be emulated, slowly); use fp16 or float32")
    return chosen


_hinted: set[str] = set()


def _hint_amx(setting: str) -> None:
    """Say once per process and setting that this CPU would run the encoders in bf16 about 2.7x faster,
    and what that costs (auto keeps float32)."""
    if setting in _hinted:
        return
    _hinted.add(setting)
    logger.info("%s=auto: float32. This CPU has AMX tiles, where the encoders run about 2.7x faster in bf16: %s=bf16 holds "
                "LoCoMo's hit rates but not fp32's top-10 order (docs/benchmarks/history.md \"Encoders in bf16\")", setting, setting)


def cpu_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Xeon 4th generation and later), where oneDNN runs bf16 GEMMs
    about six times faster than fp32's (experiments/bench_gemm.py)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def cpu_native_bf16() -> bool:
    """Whether this CPU computes bf16 matrix products in hardware (AVX512-BF16 or AMX tiles), where oneDNN
    runs them at about twice fp32's rate; elsewhere torch emulates bf16, slower than fp32."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, probe, lambda: False)()) for probe in probes)


def reader_dtype(dtype: str | torch.dtype, device: str | torch.device, setting: str = "reader.dtype",
                 bf16: bool | None = None) -> torch.dtype:
    """An in-process reader's weights dtype: "auto" = bf16 where the device computes it natively, i.e. a GPU
    with bf16 (fp16 on one without) or a CPU with AVX512-BF16 or AMX (float32 on one without). Generated
    text wants bf16's range more than fp32's last bits; the models are trained (and the packaged SmolLM2 is
    converted) in bf16, and on such a CPU a prompt is read about twice as fast as in fp32
    (experiments/bench_reader.py). `reader.dtype=float32` keeps fp32 anywhere.

    bf16: whether the device runs bf16 natively (the device plan's described node); None = ask torch."""
    chosen = parse_dtype(dtype, setting)
    if chosen is not None:
        return chosen
    if torch.device(device).type == "cuda":
        supported = torch.cuda.is_bf16_supported() if bf16 is None else bf16
        return torch.bfloat16 if supported else torch.float16
    supported = cpu_native_bf16() if bf16 is None else bf16
    return torch.bfloat16 if supported else torch.float32


def warn_tf32(dtype: torch.dtype, devices: Sequence[torch.device]) -> None:
    """fp32 on a GPU with TF32 matmuls on is not fp32: say so (the process-wide setting is left alone)."""
    if dtype == torch.float32 and any(d.type == "cuda" for d in devices) and (
            torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32):
        logger.warning("float32 encoders with TF32 matmuls enabled (torch.set_float32_matmul_precision=%r): "
                       "vectors and scores will differ from the CPU's beyond the last bits and packs may change",
                       torch.get_float32_matmul_precision())


def device_guard(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current while a kernel launches: Triton launches on the current CUDA device
    and its current stream, so without this a tensor on cuda:1 would be touched by a launch on
    cuda:0 (an illegal access), or race the torch work queued on cuda:1's stream."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def synchronize(device: torch.device | None) -> None:
    """Wait until `device` has finished the work queued on it (CUDA only; None and the CPU return at
    once). Only the named device: synchronising every GPU would create contexts on GPUs meant for the
    reader engines."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


# What CUDA libraries raise instead of torch.OutOfMemoryError when an allocation fails.
_OOM_TEXTS = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
              "cudnn_status_not_initialized", "cuda error: out of memory")


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` is a device running out of memory (torch's own error or a CUDA library's)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(t in text for t in _OOM_TEXTS)


Result = TypeVar("Result")


def in_fresh_thread(call: Callable[..., Result], *args: Any, **kwargs: Any) -> Result:
    """call(*args, **kwargs) on a new thread that ends when it returns; its result, or its exception here.

    Why: torch's CPU ops run on OpenMP (libgomp in the PyPI wheels), and every thread that runs one gets a
    team of torch.get_num_threads() threads that lives as long as that thread. Once the teams together
    hold more threads than the machine has CPUs, libgomp stops spinning between parallel regions and puts
    its threads to sleep after each one (its "throttled" spin), and every small op pays a futex wake-up:
    measured on the 2-core machine, one MiniLM encode 5.1 ms on the main thread, 9.6 ms while a thread
    pool's thread that had encoded once was still alive, 5.0 ms again once it had ended. So a process
    runs its torch work on ONE long-lived thread (memfit serve: its memory worker), and work that must
    run beside it (background consolidation) runs here, on a thread whose team goes when it ends.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = call(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"memfit-{getattr(call, '__name__', 'call')}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
