"""What is left on disk: the files under a folder that hold a text (erasure checks)."""

from __future__ import annotations

from pathlib import Path


def files_holding(folder: Path, words: list[str]) -> dict[str, list[str]]:
    """Per file under `folder` (every byte, any file), the words found in it."""
    found: dict[str, list[str]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        hits = [w for w in words if w.encode() in data]
        if hits:
            found[str(path.relative_to(folder))] = hits
    return found
