"""`memfit data fetch`: download the official benchmark files, verify sha256, cache them.

The list of files (URL, cache path, sha256, size) is checksums.json beside this module. A file is
streamed to `<name>.part`, hashed while it arrives, and renamed into place only when the hash
matches, so the cache never holds a partial or wrong file: a failed or corrupted download leaves
nothing behind. A catalogue entry whose sha256 could not be computed when it was written carries the
git blob id its pinned commit's tree names instead (`git_blob`, BEAM's largest files), checked on the
same `.part` before it is renamed. An entry of a benchmark with splits that names no split (BEAM's
judge and answer prompts, src/prompts.py) belongs to every split. A mirror (a URL or folder laid out like the cache, e.g. ../shared/data) can stand in
for the official hosts.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import re
import urllib.error
import urllib.request
from functools import lru_cache
from pathlib import Path
from typing import Any

from tqdm import tqdm

from memfit_gpu.config import ConfigError
from memfit_gpu.data import cache_dir
from memfit_gpu.data.registry import benchmark_spec, split_benchmarks
from memfit_gpu.data.schema import DataError

log = logging.getLogger(__name__)

CHECKSUMS_FILE = Path(__file__).with_name("checksums.json")
CHUNK_BYTES = 1 << 20


class FetchError(DataError):
    """A download that failed or did not match its checksum (nothing was left in the cache)."""

    def __init__(self, where: str, reason: str):
        super().__init__(where, None, None, reason)


@lru_cache(maxsize=1)
def _catalogue() -> tuple[dict[str, Any], ...]:
    with open(CHECKSUMS_FILE, encoding="utf-8") as handle:
        return tuple(json.load(handle)["files"])


def files_for(name: str, split: str | None = None) -> list[dict[str, Any]]:
    """Catalogue entries of one benchmark (one with splits, LongMemEval: of one split, default its spec's)."""
    spec = benchmark_spec(name)
    entries = [dict(e) for e in _catalogue() if e["benchmark"] == spec.name]
    if not spec.fetchable or not entries:
        known = sorted({e["benchmark"] for e in _catalogue()})
        raise ConfigError(f"{spec.name} has no official files to fetch (fetchable: {', '.join(known)}); pass its "
                          "file as --path / data.path")
    if spec.splits:
        wanted = split or spec.default_split
        if not any(e.get("split") == wanted for e in entries):
            splits = sorted({e["split"] for e in _catalogue() if e["benchmark"] == spec.name and e.get("split")})
            raise ValueError(f"unknown {spec.title} split {wanted!r}: choose one of {', '.join(splits)}")
        entries = [e for e in entries if e.get("split") in (wanted, None)]
    elif split is not None:
        raise ValueError(f"--split applies to {' or '.join(split_benchmarks())} only, not {spec.name}")
    return entries


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def git_blob_of(path: Path) -> str:
    """The id git gives the file's bytes as a blob: sha1 of `blob <size>\\0` + the bytes."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def _matches(path: Path, entry: dict[str, Any]) -> bool:
    """Whether a file is the catalogue entry's: its sha256, else (no sha256 recorded) its git blob id."""
    return sha256_of(path) == entry["sha256"] if "sha256" in entry else git_blob_of(path) == entry["git_blob"]


def _mirror_url(mirror: str, relative: str) -> str:
    """A mirror is a URL (http://, file://) or a local folder; both are laid out like the cache."""
    base = mirror if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", mirror) else Path(mirror).resolve().as_uri()
    return base.rstrip("/") + "/" + relative


def download_verified(
    url: str,
    target: Path,
    sha256: str | None,
    size: int | None = None,
    progress: bool = True,
    timeout_s: float = 60.0,
    git_blob: str | None = None,
) -> Path:
    """Stream `url` into `target` through `target.part`; keep it only if its sha256 is `sha256` (or, when no
    sha256 is known, its git blob id is `git_blob`)."""
    if (sha256 is None) == (git_blob is None):
        raise ValueError("download_verified needs exactly one of sha256 and git_blob")
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    received = 0
    request = urllib.request.Request(url, headers={"User-Agent": "memfit-data-fetch"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response, open(part, "wb") as out:
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else size
            with tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc=target.name,
                disable=not progress or None,
                leave=False,
            ) as bar:
                for block in iter(lambda: response.read(CHUNK_BYTES), b""):
                    out.write(block)
                    digest.update(block)
                    received += len(block)
                    bar.update(len(block))
            if length and length.isdigit() and received != int(length):
                # http.client ends a short body quietly instead of raising: check it here.
                raise OSError(f"connection closed after {received} of {length} bytes")
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        part.unlink(missing_ok=True)
        raise FetchError(url, f"download failed: {exc}") from exc
    except BaseException:
        part.unlink(missing_ok=True)  # Ctrl-C included: never leave a partial file
        raise
    kind, expected = ("sha256", sha256) if sha256 is not None else ("git blob id", git_blob)
    try:
        got = digest.hexdigest() if sha256 is not None else git_blob_of(part)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    if got != expected:
        part.unlink(missing_ok=True)
        raise FetchError(
            url,
            f"{kind} mismatch: expected {expected}, got {got} ({received} bytes"
            + (f", expected {size}" if size is not None else "")
            + f"); the download was deleted, {target} was not written",
        )
    os.replace(part, target)
    return target


def fetch_benchmark(
    name: str,
    dest: str | Path | None = None,
    split: str | None = None,
    mirror: str | None = None,
    progress: bool = True,
) -> list[Path]:
    """Fetch every file of `name` into `dest` (default: the cache load_benchmark reads), verified.

    Files already present with the right sha256 are not downloaded again. Returns the file paths.
    """
    root = Path(dest).expanduser() if dest is not None else cache_dir()
    written: list[Path] = []
    for entry in files_for(name, split):
        target = root / entry["path"]
        if target.is_file():
            if _matches(target, entry):
                log.info("%s: already cached and verified", target)
                written.append(target)
                continue
            log.warning("%s: cached copy does not match its checksum: downloading it again", target)
        url = _mirror_url(mirror, entry["path"]) if mirror else entry["url"]
        log.info("fetching %s -> %s", url, target)
        written.append(download_verified(url, target, entry.get("sha256"), entry.get("size"), progress=progress,
                                         git_blob=None if "sha256" in entry else entry["git_blob"]))
    return written
