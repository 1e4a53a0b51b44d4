"""The docs site (mkdocs.yml, docs/): it builds with --strict (a broken link, a missing page, a snippet or an API
reference that does not resolve fails it), every configuration key has its reason in config.py, and the
generated CLI reference holds every subcommand."""

from __future__ import annotations

import os
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
