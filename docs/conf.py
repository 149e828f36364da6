"""Sphinx configuration of aelastic's documentation site.

Build it (from the repository's root, after ``pip install -e '.[docs]'``):

    python -m sphinx -W --keep-going -n -b html docs docs/_build/html

``-W`` turns every warning into an error: a broken internal link, a reference to a missing label or page, a page in
no table of contents, a docstring that does not parse. The command line and ``--rdzv-conf`` references are
generated from the code before each build (``_ext/reference.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

import reference  # noqa: E402  (docs/_ext, put on the path above)

reference.write_pages(HERE / "reference" / "_generated")

from aelastic import __version__  # noqa: E402

project = "aelastic"
author = "the aelastic authors"
copyright = "2026, the aelastic authors"
release = __version__
version = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# Pages are Markdown; the generated pages are included by reference/cli.md and reference/rdzv-conf.md.
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "reference/_generated", "Thumbs.db", ".DS_Store"]

autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # a dataclass's "Attributes:" as fields of its entry, not entries of their own

html_theme = "furo"
html_title = f"aelastic {version}"
# Internal references only: the site is built without network access (CI, and this machine).
linkcheck_ignore = [r"https?://.*"]


def _benchmark_pages() -> None:
    """benchmarks/RESULTS.md and HISTORY.md as pages of the site (benchmarks/results.md, history.md), their links
    to each other and their plots made relative to where the pages are. Written by ``python -m benchmarks``, they
    stay in benchmarks/; these copies are build output (.gitignore)."""
    source = HERE.parent / "benchmarks"
    for name, page in (("RESULTS.md", "results.md"), ("HISTORY.md", "history.md")):
        text = (source / name).read_text()
        text = text.replace("](HISTORY.md)", "](history.md)").replace("](RESULTS.md)", "](results.md)")
        text = text.replace("](plots/", "](../../benchmarks/plots/")
        target = HERE / "benchmarks" / page
        if not target.exists() or target.read_text() != text:
            target.write_text(text)


_benchmark_pages()
