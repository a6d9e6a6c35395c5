"""The decode kernels' C++ as files (`layerline.model.cpu_kernels`, runtime/layerline/model/csrc/):
the translation unit includes every file beside it and only those, the build key changes with any
file's contents, pyproject's package data carries every file into the wheel (and the wheel the
runtime role builds has them), and no dated benchmark figures sit in the sources or the module
docstring (docs/kernels.md holds them). No compiler runs here; tests/test_cpu_kernels.py builds.
"""
from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from layerline.model import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "runtime" / "layerline" / "model" / "csrc"
LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"', re.M)


def test_sources_are_the_csrc_files():
    srcs = cpu_kernels.sources()
    on_disk = sorted(p.name for p in CSRC.iterdir() if p.suffix in cpu_kernels.SOURCE_SUFFIXES)
    assert list(srcs) == on_disk and cpu_kernels.MAIN in srcs
    assert srcs == cpu_kernels.sources(CSRC)
    # every local include names a file there, and the unit includes every header (none left out)
    for name, text in srcs.items():
        assert set(LOCAL_INCLUDE.findall(text)) <= set(srcs), name
    assert set(LOCAL_INCLUDE.findall(srcs[cpu_kernels.MAIN])) == set(srcs) - {cpu_kernels.MAIN}
    assert "TORCH_LIBRARY(layerline_cpu" in srcs[cpu_kernels.MAIN]


def test_sources_without_the_unit_say_so(tmp_path):
    (tmp_path / "common.h").write_text("// a header alone\n")
    with pytest.raises(RuntimeError, match=f"no {cpu_kernels.MAIN}"):
        cpu_kernels.sources(tmp_path)


def test_build_key_follows_every_file():
    srcs = cpu_kernels.sources()
    cxx, flags = "g++", ["-O3"]
    key = cpu_kernels.build_key(srcs, cxx, flags)
    assert key == cpu_kernels.build_key(dict(srcs), cxx, flags)
    keys = {key}
    for name in srcs:
        keys.add(cpu_kernels.build_key({**srcs, name: srcs[name] + "\n"}, cxx, flags))
    keys.add(cpu_kernels.build_key(srcs, cxx, ["-O2"]))
    keys.add(cpu_kernels.build_key(srcs, "clang++", flags))
    assert len(keys) == len(srcs) + 3


def test_package_data_carries_every_source():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = conf["tool"]["setuptools"]["package-data"]["layerline.model"]
    for name in cpu_kernels.sources():
        assert any(fnmatch.fnmatch(f"csrc/{name}", g) for g in globs), f"csrc/{name}: not in package-data"


def test_no_dated_figures_in_sources():
    date = re.compile(r"20\d\d-\d\d-\d\d")
    for name, text in cpu_kernels.sources().items():
        assert not date.search(text), f"csrc/{name}: dated figures belong in docs/kernels.md"
    assert not date.search(cpu_kernels.__doc__ or "")


def test_runtime_role_wheel_has_the_sources(tmp_path):
    """The wheel the runtime role installs on remote hosts (built offline from a clean copy)."""
    r = subprocess.run([sys.executable, str(ROOT / "roles" / "layerline_runtime" / "files" / "build_wheel.py"),
                        str(ROOT), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    names = set(zipfile.ZipFile(json.loads(r.stdout)["wheel"]).namelist())
    for name in cpu_kernels.sources():
        assert f"layerline/model/csrc/{name}" in names

    # a controller that pip-installed layerline (no checkout): the role repacks the installed distribution,
    # and that install's version comes from its metadata, the same pyproject.toml version
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                          str(target), json.loads(r.stdout)["wheel"]], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr
    script = ROOT / "roles" / "layerline_runtime" / "files" / "build_wheel.py"
    again = subprocess.run([sys.executable, "-I", "-c", "import sys, runpy; sys.path.insert(0, sys.argv[1]); "
                            "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')",
                            str(target), str(script), "installed", str(tmp_path / "repacked")],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    repacked = set(zipfile.ZipFile(json.loads(again.stdout)["wheel"]).namelist())
    assert {n for n in names if not n.endswith("RECORD")} <= repacked
    version = subprocess.run([sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                              "import layerline, layerline.version as v; print(layerline.__version__, v.source_root())",
                              str(target)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert version.stdout.split() == [conf["project"]["version"], "None"], version.stderr
