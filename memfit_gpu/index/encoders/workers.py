"""One worker process per device for the packed encoders (`index.encoder_workers=processes`).

Threads that feed several GPUs from one process share its GIL: the collation, the op dispatch of a
small model's forward and the copy back of every device take turns on one core, so four GPUs encode
little faster than one. Here each device gets its own process, which builds the same encoder on its
device from the parent's weights (shared memory, torch.multiprocessing), takes batches of token ids
from one shared queue (the longest first, as the parent planned them) and sends back float32 results;
the parent tokenises and plans once and writes each result to its rows. sentence-transformers'
multi-process pool works this way too, but sends raw texts (each process tokenises its share) in
fixed-size chunks.

Processes are spawned (CUDA cannot be re-initialised in a forked child), started on the first encode
that needs them and kept for the encoder's life (`BatchedEncoder.close`, or the end of this process,
stops them). A worker that fails to load or dies mid-run is an error naming its device, never a hang.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import queue
import time
import traceback
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
import torch.multiprocessing

from memfit_gpu.index.encoders.tokens import Tokens

logger = logging.getLogger(__name__)

# how long a worker may take to import torch/transformers and load the model before it counts as failed
START_TIMEOUT_S = 600.0
# how often a waiting parent checks that every worker is still alive
POLL_S = 1.0
# how often an idle worker checks that its parent is still alive: a parent killed with SIGKILL cannot
# stop its workers, and the task queue never reaches EOF while a sibling worker holds it open
ORPHAN_CHECK_S = 2.0

_run_ids = itertools.count()


class PoolEncoder(Protocol):
    """What a pool needs of an encoder (batching.BatchedEncoder): its parts to rebuild it in a worker,
    and the loop that runs batches on one device."""

    model: torch.nn.Module
    tokenizer: Any
    max_length: int
    devices: list[torch.device]
    dtype: torch.dtype
    loaded_from: Any
    max_batch_tokens: int | None
    fast_path: bool

    def _replica_kwargs(self) -> dict[str, Any]: ...

    def _device_loop(self, replica: torch.nn.Module, device: torch.device, tokens: Tokens,
                     next_rows: Callable[[], list[int] | None], batch_size: int, forward: Callable[..., torch.Tensor],
                     deliver: Callable[[list[int], torch.Tensor], None]) -> None: ...


class EncoderWorkerError(RuntimeError):
    """A worker process failed to start, raised while encoding, or died (the message names its device)."""


class ProcessPool:
    """One process per device of `encoder`, each holding its own copy of the model."""

    def __init__(self, encoder: PoolEncoder) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self.devices = [str(d) for d in encoder.devices]
        self.tasks = context.Queue()
        self.results = context.Queue()
        self.served: Counter[int] = Counter()  # batches encoded, by worker pid
        # CPU workers split this process's threads (several "cpu" devices: tests, CPU-only nodes)
        cpu_workers = sum(1 for d in encoder.devices if d.type == "cpu")
        threads = max(1, torch.get_num_threads() // cpu_workers) if cpu_workers else 1
        # a CPU copy: its tensors move into shared memory when the spawn pickles them (the parent's own
        # model stays where it is)
        spec = {
            "cls": type(encoder), "model": copy.deepcopy(encoder.model).to("cpu"), "tokenizer": encoder.tokenizer,
            "max_length": encoder.max_length, "dtype": encoder.dtype, "loaded_from": encoder.loaded_from,
            "batch_tokens": encoder.max_batch_tokens, "kwargs": encoder._replica_kwargs(),
            "fast_path": encoder.fast_path,
        }
        self.processes = [
            context.Process(target=_worker_main, args=(spec, device, threads, self.tasks, self.results, os.getpid()),
                            name=f"memfit-encoder-{device}", daemon=True)
            for device in self.devices
        ]
        for process in self.processes:
            process.start()
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.tasks)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        logger.info("encoder worker processes: one per device on %s (%d CPU thread(s) each on CPU devices)",
                    self.devices, threads)

    def _wait_ready(self) -> None:
        ready = 0  # counted, not named: several workers may share a device name (CPU devices)
        deadline = time.monotonic() + START_TIMEOUT_S
        while ready < len(self.devices):
            message = self._next(deadline, "starting")
            if message[0] == "failed":
                raise EncoderWorkerError(f"encoder worker on {message[1]} failed to load the model:\n{message[2]}")
            if message[0] == "ready":
                ready += 1

    def _next(self, deadline: float, doing: str) -> tuple:
        """The next message from any worker; EncoderWorkerError if a worker died or the deadline passed."""
        while True:
            try:
                return self.results.get(timeout=POLL_S)
            except queue.Empty:
                pass
            for device, process in zip(self.devices, self.processes, strict=True):
                if not process.is_alive():
                    raise EncoderWorkerError(f"encoder worker on {device} died while {doing} "
                                             f"(exit code {process.exitcode}); see the log above")
            if time.monotonic() > deadline:
                raise EncoderWorkerError(f"encoder workers on {self.devices}: no reply while {doing} "
                                         f"after {START_TIMEOUT_S:.0f} s")

    def run(self, tokens: Tokens, batches: list[list[int]], batch_size: int, forward_name: str,
            deliver: Callable[[list[int], torch.Tensor], None]) -> None:
        """Encode every batch on whichever worker is free; `deliver(rows, float32 CPU result)` each."""
        for device, process in zip(self.devices, self.processes, strict=True):
            if not process.is_alive():  # fewer devices than configured would be a silent slowdown
                raise EncoderWorkerError(f"encoder worker on {device} has died (exit code {process.exitcode})")
        run_id = next(_run_ids)
        for index, rows in enumerate(batches):
            self.tasks.put((run_id, index, tokens.take(rows), batch_size, forward_name))
        done = 0
        try:
            while done < len(batches):
                message = self._next(float("inf"), "encoding")
                if message[1] != run_id:
                    continue  # a result of an earlier run that stopped on an error
                if message[0] == "error":
                    raise EncoderWorkerError(f"encoder worker on {message[3]} failed:\n{message[4]}")
                index, result = message[2], message[3]
                deliver(batches[index], torch.from_numpy(result))
                self.served[message[4]] += 1
                done += 1
        except BaseException:
            _drain(self.tasks)  # the other workers stop at once instead of finishing a failed run
            raise

    def close(self) -> None:
        self._finalizer()


def _drain(tasks: Any) -> None:
    while True:
        try:
            tasks.get_nowait()
        except queue.Empty:
            return


def _stop(processes: list[Any], tasks: Any) -> None:
    _drain(tasks)
    for process in processes:
        if process.is_alive():
            tasks.put(None)
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)


def _worker_main(spec: dict[str, Any], device_name: str, threads: int, tasks: Any, results: Any,
                 parent_pid: int) -> None:
    """A worker process: build the encoder on `device_name`, then encode batches until told to stop or
    until its parent is gone (it then exits, freeing its device)."""
    device = torch.device(device_name)
    try:
        if device.type == "cpu":
            torch.set_num_threads(threads)
        else:
            torch.cuda.set_device(device)
        encoder = spec["cls"](spec["model"], spec["tokenizer"], spec["max_length"], [device], spec["dtype"],
                              loaded_from=spec["loaded_from"], batch_tokens=spec["batch_tokens"], workers="threads",
                              **spec["kwargs"])
        encoder.fast_path = spec["fast_path"]
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put(("failed", device_name, traceback.format_exc()))
        return
    results.put(("ready", device_name))
    while True:
        try:
            task = tasks.get(timeout=ORPHAN_CHECK_S)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return
            continue
        if task is None:
            return
        run_id, index, tokens, batch_size, forward_name = task
        try:
            result = _encode_batch(encoder, device, tokens, batch_size, forward_name)
            results.put(("done", run_id, index, result, os.getpid()))
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
            results.put(("error", run_id, index, device_name, traceback.format_exc()))


def _encode_batch(encoder: PoolEncoder, device: torch.device, tokens: Tokens, batch_size: int,
                  forward_name: str) -> np.ndarray:
    """One planned batch on this worker's device, as float32 rows in the batch's order."""
    pieces: list[torch.Tensor] = []
    handed = iter([list(range(len(tokens)))])
    # the chunks of one batch come back in order (slices of 0..n-1), so they concatenate
    encoder._device_loop(encoder.model, device, tokens, lambda: next(handed, None), batch_size,
                         getattr(encoder, forward_name), lambda _chunk, result: pieces.append(result))
    return np.ascontiguousarray(torch.cat(pieces).numpy())
