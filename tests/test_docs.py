"""The docs site (mkdocs.yml, docs/): it builds with --strict (a broken link, a missing page, a snippet or an API
reference that does not resolve fails it), every configuration key has its reason in config.py, and the
generated CLI reference holds every subcommand."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docs" / "hooks"))
import cli_reference  # noqa: E402
import config_reference  # noqa: E402


def test_the_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs site needs the dev extra (mkdocs, mkdocs-material, mkdocstrings)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    site = tmp_path / "site"
    for page in ("index.html", "reference/cli/index.html", "reference/config/index.html",
                 "reference/api/index.html", "concepts/module-graph/index.html", "benchmarks/history/index.html"):
        assert (site / page).is_file(), page
    api = (site / "reference/api/index.html").read_text()
    assert "memfit_gpu.live.Memory" in api and "memfit_gpu.config.MemFitConfig" in api
    assert "retrieve.prf.docs" in (site / "reference/config/index.html").read_text()
    print(f"mkdocs build --strict: {time.monotonic() - started:.1f} s")


def test_every_config_key_has_its_reason() -> None:
    keys = config_reference.config_keys(config_reference.CONFIG.read_text())
    assert len(keys) > 100 and {"retrieve.prf.docs", "reader.backend", "serve.max_batch"} <= {k.key for k in keys}
    missing = [f"{k.key} (memfit_gpu/config.py:{k.line})" for k in keys if not k.reason]
    assert not missing, ("config fields without a comment giving their reason (above the field or beside it):\n  "
                         + "\n  ".join(missing))


def test_the_reason_check_names_a_field_without_a_comment() -> None:
    source = '''
from dataclasses import dataclass, field

LIMIT = 100_000


@dataclass
class Inner:
    # the reason, on the line above
    depth: int = 2
    width: float = 0.5  # the reason, beside it
    bare: str = "x"


@dataclass
class Root:
    name: str = "memfit"  # the run's label
    inner: Inner = field(default_factory=Inner)
    cap: int = LIMIT  # a module constant, shown as its value
    tags: list[str] = field(default_factory=lambda: ["5"])
'''
    assert config_reference.missing_reasons(source, root="Root") == ["inner.bare", "tags"]
    keys = {k.key: k for k in config_reference.config_keys(source, root="Root")}
    assert list(keys) == ["name", "inner.depth", "inner.width", "inner.bare", "cap", "tags"]
    assert keys["inner.depth"].reason == "the reason, on the line above"
    assert keys["inner.width"].reason == "the reason, beside it"
    assert (keys["cap"].default, keys["tags"].default, keys["name"].default) == ("100000", '["5"]', '"memfit"')


def test_the_cli_reference_lists_every_subcommand() -> None:
    from memfit_gpu.cli import SUBCOMMANDS

    page = cli_reference.render()
    for name in SUBCOMMANDS:
        assert f"\n## memfit {name}\n" in page, name
        assert f"usage: memfit {name}" in page, name


# The word issue followed by a number, or a hash and a number: the project's internal tracker, which readers of
# the code, the configs and the docs do not have. A hex colour or a markdown heading does not match. (The cases
# below are built from parts so that this file passes its own check.)
INTERNAL_ISSUE = re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w&#])#\d{1,3}\b(?![0-9a-fA-F])")


def test_the_internal_issue_pattern_matches_what_it_should() -> None:
    hash_14, word = "#" + "14", "ssue"
    for text in (f"i{word} 23.7: a", f"I{word} 24's acceptance", f"(i{word}s 13 and 19)", f"before {hash_14})",
                 f"i{word} {hash_14}"):
        assert INTERNAL_ISSUE.search(text), text
    for text in ("color: #1f77b4", "## Heading", "see the issue tracker", "x = a[#]", "&#39;"):
        assert not INTERNAL_ISSUE.search(text), text


def test_no_tracked_text_names_an_internal_issue_number() -> None:
    """Docstrings, comments, configs, pages and tests say what a thing does or guards, not which internal
    issue asked for it (CHANGELOG.md included: users read it)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    if not tracked:
        pytest.fail("git ls-files listed nothing: this test needs a checkout")
    suffixes = {".py", ".md", ".yaml", ".yml", ".txt", ".sh", ".toml", ".cfg", ".ini", ".j2", ".html", ".js", ".css"}
    found = []
    for name in tracked:
        path = REPO / name
        if path.suffix not in suffixes and path.name not in ("Makefile", "run"):
            continue
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if INTERNAL_ISSUE.search(line):
                found.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not found, "\n".join(found[:40])
