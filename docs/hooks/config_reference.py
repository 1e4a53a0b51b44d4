"""The configuration reference page, generated from memfit_gpu/config.py's source (ast + tokenize).

    python docs/hooks/config_reference.py        # prints the page (Markdown)

Every field of a config dataclass carries its reason as a comment: a comment block on the lines right
above it, a comment beside it, or both. `config_keys` pairs each field with that comment and walks the
nested dataclasses from the root (`MemFitConfig`) to dotted keys (`retrieve.prf.docs`), with the type and
the default as written. A field without a comment has an empty reason: tests/test_docs.py fails on it.
"""

from __future__ import annotations

import ast
import io
import json
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "memfit_gpu" / "config.py"
ROOT = "MemFitConfig"


@dataclass(frozen=True)
class ConfigKey:
    key: str  # dotted: retrieve.prf.docs
    type: str  # the annotation as written
    default: str  # the default, as YAML writes it where it is a literal, else as written
    reason: str  # the field's comments (above, then beside), joined; "" when it has none
    line: int  # the field's line in the source
    section: str  # the dataclass that declares it


def _comments(source: str) -> tuple[dict[int, str], set[int]]:
    """line -> comment text (without '#'), and the lines holding nothing but a comment."""
    comments: dict[int, str] = {}
    alone: set[int] = set()
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            comments[line] = tok.string.lstrip("#").strip()
            if not lines[line - 1][: tok.start[1]].strip():
                alone.add(line)
    return comments, alone


def _is_dataclass(node: ast.ClassDef) -> bool:
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if (isinstance(target, ast.Name) and target.id == "dataclass") or (
                isinstance(target, ast.Attribute) and target.attr == "dataclass"):
            return True
    return False


def _shown(node: ast.expr, constants: dict[str, ast.expr]) -> str:
    """A default as a user writes it in YAML or a dot-list override."""
    if isinstance(node, ast.Name) and node.id in constants:
        return _shown(constants[node.id], constants)
    try:
        return json.dumps(ast.literal_eval(node))
    except ValueError:
        return ast.unparse(node)


def _default(value: ast.expr | None, classes: dict[str, ast.ClassDef],
             constants: dict[str, ast.expr]) -> tuple[str, str | None]:
    """(the default shown, the nested dataclass's name when the field is a section)."""
    if value is None:
        return "(required)", None
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                return _shown(kw.value, constants), None
            if kw.arg == "default_factory":
                factory = kw.value
                if isinstance(factory, ast.Name) and factory.id in classes:
                    return "", factory.id
                if isinstance(factory, ast.Name) and factory.id in ("list", "dict", "set", "tuple"):
                    return {"list": "[]", "dict": "{}", "set": "[]", "tuple": "[]"}[factory.id], None
                if isinstance(factory, ast.Lambda):
                    return _shown(factory.body, constants), None
                return ast.unparse(factory) + "()", None
        return ast.unparse(value), None
    return _shown(value, constants), None


def config_keys(source: str, root: str = ROOT) -> list[ConfigKey]:
    """Every leaf key of the root dataclass in `source`, in declaration order, with its reason."""
    tree = ast.parse(source)
    comments, alone = _comments(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef) and _is_dataclass(n)}
    constants = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name)}
    keys: list[ConfigKey] = []

    def walk(cls: str, prefix: str) -> None:
        for stmt in classes[cls].body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            name = prefix + stmt.target.id
            default, nested = _default(stmt.value, classes, constants)
            annotation = ast.unparse(stmt.annotation)
            if nested is None and annotation in classes:
                nested = annotation
            if nested is not None:
                walk(nested, name + ".")
                continue
            above = []
            line = stmt.lineno - 1
            while line in alone:
                above.insert(0, comments[line])
                line -= 1
            beside = [comments[n] for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
                      if n in comments and n not in alone]
            reason = " ".join(part for part in above + beside if part)
            keys.append(ConfigKey(name, annotation, default, reason, stmt.lineno, cls))

    walk(root, "")
    return keys


def missing_reasons(source: str, root: str = ROOT) -> list[str]:
    """The keys whose field has no comment."""
    return [k.key for k in config_keys(source, root) if not k.reason]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(path: Path = CONFIG) -> str:
    keys = config_keys(path.read_text())
    lines = [
        "# Configuration keys",
        "",
        "<!-- generated by docs/hooks/config_reference.py from memfit_gpu/config.py; do not edit -->",
        "",
        "Generated from `memfit_gpu/config.py` each time the site is built "
        "(`python docs/hooks/config_reference.py` prints this page): every key of `MemFitConfig` with its "
        "type, its default and the reason the source gives for it. Set a key in a YAML file "
        "(`configs/memfit.yaml` names every default) or on the command line after the command's arguments "
        "(`memfit run --config C --out DIR retrieve.scan_top_k=30`); an unknown key, a badly typed value "
        "or one out of its range is refused naming the key. The dataclasses themselves are in the "
        "[Python API](api.md#configuration).",
        "",
    ]
    section = None
    for key in keys:
        top = key.key.split(".")[0] if "." in key.key else "(top level)"
        if top != section:
            section = top
            lines += ["", f"## {section}", "", "| key | type | default | reason |", "| --- | --- | --- | --- |"]
        default = f"`{_cell(key.default)}`" if key.default else ""
        lines.append(f"| `{key.key}` | `{_cell(key.type)}` | {default} | {_cell(key.reason)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
