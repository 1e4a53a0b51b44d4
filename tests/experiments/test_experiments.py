"""The scripts in experiments/ use the package as any user would: public names only, and the
benchmarks read their data through the package's loaders (memfit_gpu.data), never raw JSON."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "experiments").glob("*.py"))


def _private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            found += [f"{path.name}:{node.lineno}: from {node.module} import {alias.name}"
                      for alias in node.names if alias.name.startswith("_")]
    return found


def _json_reads(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("load", "loads")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "json"):
            found.append(f"{path.name}:{node.lineno}: json.{node.func.attr}")
    return found


def _package_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of every import of memfit_gpu in `path`."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "memfit_gpu":
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names if alias.name.split(".")[0] == "memfit_gpu"]
    return found


def _missing(module: str, name: str | None) -> bool:
    if importlib.util.find_spec(module) is None:
        return True
    if name is None:
        return False
    return not hasattr(importlib.import_module(module), name) and importlib.util.find_spec(f"{module}.{name}") is None


def test_every_package_name_the_experiments_import_exists() -> None:
    """A module moved or a name renamed in memfit_gpu breaks no benchmark unseen (most run in no test)."""
    imports = [(path.name, *hit) for path in SCRIPTS for hit in _package_imports(path)]
    assert len(imports) > 50
    assert [f"{script}:{line}: {module} {name or ''}" for script, line, module, name in imports
            if _missing(module, name)] == []


def test_experiments_import_no_private_names() -> None:
    assert len(SCRIPTS) >= 8
    assert [hit for path in SCRIPTS for hit in _private_imports(path)] == []


def test_benchmarks_read_data_through_the_loaders() -> None:
    benchmarks = [p for p in SCRIPTS if p.name.startswith("bench_")]
    assert len(benchmarks) >= 6
    assert [hit for path in benchmarks for hit in _json_reads(path)] == []


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    script = tmp_path / "bench_x.py"
    script.write_text("import json\nfrom memfit_gpu.index.encoders import BiEncoder, _linear\n"
                      "rows = json.loads(open('d.json').read())\n")
    assert _private_imports(script) == ["bench_x.py:2: from memfit_gpu.index.encoders import _linear"]
    assert _json_reads(script) == ["bench_x.py:3: json.loads"]
    moved = tmp_path / "bench_y.py"
    moved.write_text("import memfit_gpu.nowhere\nfrom memfit_gpu.index.encoders import onednn, BiEncoder\n")
    assert _package_imports(moved) == [(1, "memfit_gpu.nowhere", None), (2, "memfit_gpu.index.encoders", "onednn"),
                                       (2, "memfit_gpu.index.encoders", "BiEncoder")]
    assert [_missing(module, name) for _, module, name in _package_imports(moved)] == [True, True, False]
