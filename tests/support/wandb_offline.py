"""Reads back what an offline W&B run recorded (`WANDB_MODE=offline`), without a server: the tests'
way to check what memfit_gpu.run.tracking logged. W&B's own readers need its service process; this one
decodes the `run-<id>.wandb` transaction log directly with W&B's protobuf classes.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2


@dataclass
class OfflineRun:
    """What a `run-<id>.wandb` file holds, decoded: enough to check a run without a server."""

    run_id: str = ""
    project: str = ""
    group: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    artifacts: list[dict[str, Any]] = field(default_factory=list)  # name, type, files (manifest paths)
    files: list[str] = field(default_factory=list)
    exited: bool = False


def _records(data: bytes) -> Iterable[bytes]:
    """LevelDB-log framing of W&B's transaction log: 7-byte file header (`:W&B`, magic, version), then
    32 KiB blocks of chunks [crc32c:4][length:2][type:1][payload]; types 1 full, 2 first, 3 middle, 4 last."""
    if data[:4] != b":W&B":
        raise ValueError("not a W&B transaction log (missing ':W&B' header)")
    block = 32768
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield payload
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            yield pending + payload
            pending = b""


def _set_nested(target: dict[str, Any], item: Any) -> None:
    keys = list(item.nested_key) or [item.key]
    node = target
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = json.loads(item.value_json)


def read_offline_run(path: str | Path, wait_s: float = 0.0) -> OfflineRun:
    """Decode an offline W&B run: `path` is the `.wandb` file or its `offline-run-*` folder.

    `run.finish()` returns before W&B's service process has flushed the log; `wait_s` > 0 re-reads
    until the exit record is there (or the time is up).
    """
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("run-*.wandb"))
        if not found:
            raise FileNotFoundError(f"{path}: no run-*.wandb file")
        path = found[0]
    deadline = time.monotonic() + wait_s
    while True:
        out = _decode(path)
        if out.exited or time.monotonic() >= deadline:
            return out
        time.sleep(0.1)


def _decode(path: Path) -> OfflineRun:
    out = OfflineRun()
    for payload in _records(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.run_id, out.project, out.group = record.run.run_id, record.run.project, record.run.run_group
            out.tags = list(record.run.tags)
            for item in record.run.config.update:
                out.config[item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                out.config[item.key] = json.loads(item.value_json)
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                _set_nested(row, item)
            out.history.append(row)
        elif kind == "summary":
            for item in record.summary.update:
                _set_nested(out.summary, item)
        elif kind == "artifact":
            art = record.artifact
            out.artifacts.append(
                {"name": art.name, "type": art.type, "files": [e.path for e in art.manifest.contents],
                 "digests": {e.path: e.digest for e in art.manifest.contents}}
            )
        elif kind == "files":
            out.files += [f.path for f in record.files.files]
        elif kind == "exit":
            out.exited = True
    return out
