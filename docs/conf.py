"""Sphinx configuration: MyST Markdown pages, the furo theme, an API reference generated from the docstrings.

Every object is documented once, in the module that defines it. A package's page lists the names it exports with
links to those definitions, and a cross-reference to an exported name (``mpistrategy.allreduce``,
``mpistrategy.sync.DASO``) resolves to the definition.
"""

from __future__ import annotations

import importlib
from typing import Any

from docutils import nodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment

import mpistrategy

PACKAGES = (
    "mpistrategy",
    "mpistrategy.aggregation",
    "mpistrategy.nn",
    "mpistrategy.strategy",
    "mpistrategy.strategy.reducer",
    "mpistrategy.sync",
)

project = "mpistrategy"
author = "the mpistrategy developers"
copyright = "2026, the mpistrategy developers"
release = mpistrategy.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path = ["_templates"]

myst_enable_extensions = ["colon_fence", "deflist", "dollarmath", "attrs_inline"]
myst_heading_anchors = 3

autosummary_generate = True
autodoc_default_options = {"members": True, "show-inheritance": True, "ignore-module-all": True}
autodoc_member_order = "bysource"
autodoc_inherit_docstrings = False  # overridden Lightning hooks would show Lightning's own docstrings
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"mpistrategy {release}"


def _definition(name: str) -> str | None:
    """The full name of the definition behind ``name`` (``mpistrategy.allreduce`` ->
    ``mpistrategy.collectives.reduction.allreduce``), or None where ``name`` is not an object defined elsewhere."""
    module_name, _, attribute = name.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError):
        return None
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or module == module_name:
        return None
    return f"{module}.{qualname}"


def _exports(package: str) -> list[str]:
    """The definitions of the names ``package`` exports (its ``__all__``) that are defined in another module."""
    names = getattr(importlib.import_module(package), "__all__", [])
    return [definition for name in names if (definition := _definition(f"{package}.{name}")) is not None]


autosummary_context = {"exports": {package: _exports(package) for package in PACKAGES}}


def _resolve_export(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.TextElement
) -> nodes.reference | None:
    """Resolves a Python cross-reference to an exported name (``mpistrategy.sync.DASO``) to its definition."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"]
    module = node.get("py:module")
    for name in (target, f"{module}.{target}" if module else None):
        definition = _definition(name) if name and name.startswith("mpistrategy.") else None
        if definition is not None:
            domain = env.get_domain("py")
            return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], definition, node, contnode)
    return None


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("missing-reference", _resolve_export)
    return {"parallel_read_safe": True}
