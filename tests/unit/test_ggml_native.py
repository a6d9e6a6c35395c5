"""ggml_native: which ggml library precision gguf loads (LAYERLINE_GGML_LIB, else this host's own
build, else the wheel's), the build's name per CPU and wheel version, and the check a build must pass.
Nothing here builds ggml (minutes): the cache is filled with stand-in files."""
from __future__ import annotations

from pathlib import Path

import pytest

from layerline import cli
from layerline.model import ggml_native, gguf_blocks

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni
processor\t: 1
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty build cache, no LAYERLINE_GGML_LIB, LAYERLINE_GGML_NATIVE unset."""
    monkeypatch.setenv("LAYERLINE_GGML_CACHE", str(tmp_path / "ggml"))
    monkeypatch.delenv("LAYERLINE_GGML_LIB", raising=False)
    monkeypatch.delenv("LAYERLINE_GGML_NATIVE", raising=False)
    if ggml_native.wheel_version() is None:
        pytest.skip("libggml-python is not installed")
    return tmp_path / "ggml"


def fake_build(d: Path, libs=ggml_native.LIBS) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for lib in libs:
        (d / f"{lib}.so").write_bytes(b"")
    return d


def test_cpu_flags_come_from_the_first_processor():
    assert ggml_native.cpu_flags(CPUINFO) == ["avx2", "avx512_vnni", "avx512f", "fma", "fpu", "sse2"]
    assert ggml_native.cpu_flags("processor\t: 0\n") == []


def test_a_build_is_named_by_wheel_version_cpu_flags_and_machine():
    k = ggml_native.key("0.20.2", ["avx2", "fma"], "x86_64")
    assert k == ggml_native.key("0.20.2", ["avx2", "fma"], "x86_64")
    assert k.startswith("0.20.2-")
    others = {ggml_native.key("0.20.3", ["avx2", "fma"], "x86_64"), ggml_native.key("0.20.2", ["avx2"], "x86_64"),
              ggml_native.key("0.20.2", ["avx2", "fma", "avx512f"], "x86_64"),
              ggml_native.key("0.20.2", ["avx2", "fma"], "aarch64")}
    assert k not in others and len(others) == 4


def test_no_build_until_both_libraries_are_there(cache):
    d = ggml_native.target_dir()
    assert d is not None and d.parent == cache
    assert ggml_native.built() is None
    fake_build(d, libs=ggml_native.LIBS[:1])
    assert ggml_native.built() is None
    fake_build(d)
    assert ggml_native.built() == d


def test_the_library_dir_env_then_this_hosts_build_then_the_wheel(cache, monkeypatch, tmp_path):
    wheel = gguf_blocks.ggml_lib_dir()
    assert "libggml" in str(wheel)  # the wheel's, nothing built
    d = fake_build(ggml_native.target_dir())
    assert gguf_blocks.ggml_lib_dir() == d
    monkeypatch.setenv("LAYERLINE_GGML_NATIVE", "off")
    assert gguf_blocks.ggml_lib_dir() == wheel
    monkeypatch.setenv("LAYERLINE_GGML_LIB", str(tmp_path / "mine"))
    monkeypatch.delenv("LAYERLINE_GGML_NATIVE")
    assert gguf_blocks.ggml_lib_dir() == tmp_path / "mine"


def test_a_build_for_another_cpu_is_not_loaded(cache, monkeypatch):
    fake_build(ggml_native.target_dir())
    monkeypatch.setattr(ggml_native, "cpu_flags", lambda cpuinfo=None: ["sse2"])
    assert ggml_native.built() is None


def test_a_build_that_does_not_load_fails_its_check(tmp_path):
    with pytest.raises(RuntimeError, match="failed its check: does not load"):
        ggml_native.check(fake_build(tmp_path / "broken"))


def test_cli_build_ggml_prints_a_build_already_there(cache, capsys):
    d = fake_build(ggml_native.target_dir())
    assert cli.main(["build-ggml"]) == 0
    assert capsys.readouterr().out.strip() == str(d)
