"""`memfit data fetch`: real downloads from a local http.server and file:// URLs (no network here),
checksum enforcement, no partial files, and the catalogue against ../shared/data/SHA256SUMS."""

from __future__ import annotations

import functools
import hashlib
import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from memfit_gpu.data import load_benchmark
from memfit_gpu.data.fetch import FetchError, download_verified, fetch_benchmark, files_for, sha256_of

LOCOMO_SHA256 = "79fa87e90f04081343b8c8debecb80a9a6842b76a7aa537dc9fdf651ea698ff4"


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.endswith("/truncated.json"):
            # Promise 1000 bytes, send 10, hang up: the client sees an incomplete body.
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b"[1,2,3,4,5")
            self.wfile.flush()
            self.close_connection = True
            return
        super().do_GET()


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An http.server on 127.0.0.1 serving tmp_path/www; yields (base URL, folder)."""
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Handler, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _leftovers(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def test_fetch_over_http_verifies_and_caches(
    served: tuple[str, Path], locomo_path: Path, tmp_path: Path
) -> None:
    base, root = served
    (root / "locomo").mkdir()
    shutil.copyfile(locomo_path, root / "locomo" / "locomo10.json")
    dest = tmp_path / "cache"
    paths = fetch_benchmark("locomo", dest, mirror=base, progress=False)
    assert paths == [dest / "locomo" / "locomo10.json"]
    assert sha256_of(paths[0]) == LOCOMO_SHA256
    assert _leftovers(dest) == paths  # no .part left behind
    assert len(load_benchmark("locomo", dest).memories) == 10

    # Already cached and verified: not downloaded again (the server no longer has it).
    (root / "locomo" / "locomo10.json").unlink()
    assert fetch_benchmark("locomo", dest, mirror=base, progress=False) == paths


def test_fetch_rejects_a_corrupted_download(
    served: tuple[str, Path], locomo_path: Path, tmp_path: Path
) -> None:
    base, root = served
    (root / "locomo").mkdir()
    corrupted = bytearray(locomo_path.read_bytes())
    corrupted[100] ^= 0x01  # one flipped bit
    (root / "locomo" / "locomo10.json").write_bytes(bytes(corrupted))
    dest = tmp_path / "cache"
    with pytest.raises(FetchError) as info:
        fetch_benchmark("locomo", dest, mirror=base, progress=False)
    message = str(info.value)
    assert message.startswith(f"{base}/locomo/locomo10.json: sha256 mismatch: expected {LOCOMO_SHA256}, got ")
    assert hashlib.sha256(bytes(corrupted)).hexdigest() in message
    assert "the download was deleted" in message
    assert _leftovers(dest) == []


def test_corrupted_cache_copy_is_replaced(
    served: tuple[str, Path], locomo_path: Path, tmp_path: Path
) -> None:
    base, root = served
    (root / "locomo").mkdir()
    shutil.copyfile(locomo_path, root / "locomo" / "locomo10.json")
    stale = tmp_path / "cache" / "locomo" / "locomo10.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("[]")
    fetch_benchmark("locomo", tmp_path / "cache", mirror=base, progress=False)
    assert sha256_of(stale) == LOCOMO_SHA256


def test_failed_downloads_leave_nothing(served: tuple[str, Path], tmp_path: Path) -> None:
    base, _ = served
    target = tmp_path / "out" / "x.json"
    with pytest.raises(FetchError, match=r"missing\.json: download failed: HTTP Error 404"):
        download_verified(f"{base}/missing.json", target, "0" * 64, progress=False)
    with pytest.raises(
        FetchError, match=r"truncated\.json: download failed: connection closed after 10 of 1000 bytes"
    ):
        download_verified(f"{base}/truncated.json", target, "0" * 64, progress=False)
    with pytest.raises(FetchError, match="download failed"):
        download_verified(
            "http://127.0.0.1:9/nothing-listens-here", target, "0" * 64, progress=False, timeout_s=5
        )
    assert _leftovers(tmp_path / "out") == []


def test_fetch_from_a_file_url_mirror_into_the_cache(shared_data: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "memfit"))
    monkeypatch.delenv("MEMFIT_DATA_DIR", raising=False)
    paths = fetch_benchmark("memgallery", mirror=shared_data.as_uri(), progress=False)
    cache = tmp_path / "memfit" / "data"
    assert len(paths) == 25  # 20 dialog files + 5 prompt files
    assert {p.parent for p in paths} == {cache / "memgallery" / "dialog", cache / "memgallery" / "prompt"}
    assert _leftovers(cache) == sorted(paths)
    benchmark = load_benchmark("memgallery")  # found in the cache
    assert benchmark.source == str(cache / "memgallery" / "dialog")
    assert len(benchmark.memories) == 20


def test_catalogue_matches_the_shared_checksums(shared_data: Path) -> None:
    shared = {}
    for line in (shared_data / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        shared[name.removeprefix("./")] = digest
    entries = files_for("locomo") + files_for("memgallery")
    assert len(entries) == 26
    for entry in entries:
        assert entry["sha256"] == shared[entry["path"]], entry["path"]
        assert entry["size"] == (shared_data / entry["path"]).stat().st_size
    assert (
        entries[0]["url"] == "https://raw.githubusercontent.com/snap-research/LoCoMo/main/data/locomo10.json"
    )

    (s_split,) = files_for("longmemeval")
    assert s_split["path"] == "longmemeval/longmemeval_s_cleaned.json"
    assert s_split["sha256"] == "d6f21ea9d60a0d56f34a05b609c79c88a451d2ae03597821ea3d5a9678c3a442"
    assert s_split["size"] == 277_383_467
    assert s_split["url"].startswith(
        "https://huggingface.co/datasets/xiaowu0162/longmemeval-cleaned/resolve/main/"
    )
    assert [e["path"] for e in files_for("longmemeval", "oracle")] == ["longmemeval/longmemeval_oracle.json"]
    assert [e["path"] for e in files_for("longmemeval", "m")] == ["longmemeval/longmemeval_m_cleaned.json"]
    with pytest.raises(ValueError, match="unknown LongMemEval split 'xl'"):
        files_for("longmemeval", "xl")
    with pytest.raises(ValueError, match="applies to longmemeval or beam only"):
        files_for("locomo", "s")
