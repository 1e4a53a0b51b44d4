"""The MkDocs hook (mkdocs.yml `hooks:`) that adds the generated pages to the site at build time.

- concepts/module-graph.md: module_graph.py, from the package's imports (ast);
- reference/cli.md: cli_reference.py, from memfit_gpu.cli.build_parser();
- reference/config.md: config_reference.py, from memfit_gpu/config.py's source.

Each generator also runs alone (`python docs/hooks/NAME.py` prints its page). The package is imported from
this checkout (the repository root goes first on sys.path), never from another installed copy.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import cli_reference  # noqa: E402
import config_reference  # noqa: E402
import module_graph  # noqa: E402
from mkdocs.structure.files import File, Files  # noqa: E402

PAGES = {
    "concepts/module-graph.md": module_graph.render,
    "reference/cli.md": cli_reference.render,
    "reference/config.md": config_reference.render,
}


def on_files(files: Files, config) -> Files:
    for uri, render in PAGES.items():
        if files.get_file_from_path(uri) is not None:
            raise RuntimeError(f"docs/{uri} is generated at build time (docs/hooks/generate.py): remove the file")
        files.append(File.generated(config, uri, content=render()))
    return files
