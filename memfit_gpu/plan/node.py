"""The node: the GPUs and host memory of this machine or of a described one (`memfit plan --gpus N`)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from memfit_gpu.config import ConfigError
from memfit_gpu.devices import gpu_count
from memfit_gpu.plan.sizes import GIB

try:  # faiss is an either/or extra; the plan only asks whether this build has GPU support
    import faiss
except ImportError:  # pragma: no cover - memfit's install always has one of them
    faiss = None


@dataclass(frozen=True)
class Gpu:
    index: int  # torch's index: cuda:<index>
    name: str
    total_bytes: int


@dataclass(frozen=True)
class Node:
    gpus: tuple[Gpu, ...]
    host_bytes: int
    source: str  # "this machine" or the description given
    faiss_gpu: bool  # the FAISS build has GPU support

    def describe(self) -> str:
        if self.gpus:
            sizes = Counter(f"{g.name} {g.total_bytes / GIB:.1f} GiB" for g in self.gpus)
            gpus = ", ".join(f"{n} x {what}" for what, n in sizes.items())
        else:
            gpus = "no GPU"
        return f"{gpus}; host {self.host_bytes / GIB:.1f} GiB; FAISS {'GPU' if self.faiss_gpu else 'CPU'} ({self.source})"


def host_memory_bytes() -> int:
    """Physical RAM, or the cgroup's memory limit when lower (a SLURM job's --mem)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return int(total)


def _faiss_has_gpu() -> bool:
    return faiss is not None and hasattr(faiss, "StandardGpuResources")


def describe_node() -> Node:
    """This machine: the GPUs torch sees (CUDA_VISIBLE_DEVICES applies), their memory, host RAM."""
    gpus = []
    for i in range(gpu_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(Gpu(i, str(props.name), int(props.total_memory)))
    return Node(tuple(gpus), host_memory_bytes(), "this machine", _faiss_has_gpu())


def described_node(gpus: int | None = None, gpu_mem_gib: float | None = None, host_mem_gib: float | None = None,
                   faiss_gpu: bool | None = None) -> Node:
    """This machine with some of its description replaced (`memfit plan --gpus 4 --gpu-mem-gib 96`).

    A node described with --gpus is assumed to have the [gpu] install (GPU FAISS) unless told otherwise."""
    here = describe_node()
    words = []
    node_gpus = list(here.gpus)
    if gpus is not None:
        words.append(f"--gpus {gpus}")
        size = node_gpus[0].total_bytes if node_gpus else 0
        node_gpus = [Gpu(i, "GPU", size) for i in range(gpus)]
    if gpu_mem_gib is not None:
        if not node_gpus:  # it would describe nothing, and the node line would still name it
            raise ConfigError("memfit plan: --gpu-mem-gib on a machine without GPUs describes no GPU: give --gpus "
                              "too (e.g. --gpus 4 --gpu-mem-gib 96)")
        words.append(f"--gpu-mem-gib {gpu_mem_gib:g}")
        node_gpus = [Gpu(g.index, g.name, int(gpu_mem_gib * GIB)) for g in node_gpus]
    if node_gpus and any(g.total_bytes <= 0 for g in node_gpus):
        raise ConfigError("memfit plan: --gpus without --gpu-mem-gib on a machine whose GPUs are unknown: "
                          "give --gpu-mem-gib")
    host = here.host_bytes
    if host_mem_gib is not None:
        words.append(f"--host-mem-gib {host_mem_gib:g}")
        host = int(host_mem_gib * GIB)
    if faiss_gpu is None:
        faiss_gpu = True if gpus is not None else here.faiss_gpu
    source = f"described: {' '.join(words)}" if words else "this machine"
    return Node(tuple(node_gpus), host, source, bool(faiss_gpu))
