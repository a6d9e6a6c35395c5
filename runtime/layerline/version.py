"""layerline's version, from one place: the package metadata (pyproject.toml's [project] version).

A source checkout (this file under SOURCE/runtime/layerline/, an editable install or runtime/ on
PYTHONPATH) reads SOURCE/pyproject.toml, which the metadata is built from, so a version bumped
there counts before the next install; an installed wheel answers from its metadata
(importlib.metadata). `layerline --version`, the
runtime role's check on each host and the collection's galaxy.yml all read this.
"""
from __future__ import annotations

import os
import tomllib
from importlib import metadata

DISTRIBUTION = "layerline"
# build_wheel.py's SOURCE for "no checkout: repack the distribution this interpreter has installed"
INSTALLED = "installed"


def source_root() -> str | None:
    """The source checkout this package lies in (SOURCE/runtime/layerline/, SOURCE/pyproject.toml naming
    this distribution), or None for an installed wheel."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return root if pyproject_project(os.path.join(root, "pyproject.toml")).get("name") == DISTRIBUTION else None


def pyproject_project(path: str) -> dict:
    """The [project] table of a pyproject.toml ({} where there is none)."""
    try:
        with open(path, "rb") as f:
            return dict(tomllib.load(f).get("project", {}))
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def package_version() -> str:
    """The source checkout's pyproject.toml version, else the installed distribution's metadata."""
    root = source_root()
    if root is not None:
        return str(pyproject_project(os.path.join(root, "pyproject.toml"))["version"])
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # copied files without metadata: say so rather than guess
        return "0+unknown"
