"""The version a host runs (issue 37, item 3): the package version plus a hash of its code, the
runtime role's reinstall decision, and the check every connection makes (ZMTP metadata)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

import layerline
from layerline import keys, version
from layerline.spec import VERSION_CODE

ROOT = Path(__file__).resolve().parents[2]


def test_full_is_the_package_version_and_a_content_hash(tmp_path):
    assert re.fullmatch(re.escape(layerline.__version__) + r"\+[0-9a-f]{12}", version.full())
    pkg = tmp_path / "layerline"
    shutil.copytree(version.package_dir(), pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert version.content_hash(str(pkg)) == version.content_hash()
    (pkg / "scratch").mkdir()            # not a package: a wheel would not carry it
    (pkg / "scratch" / "x.py").write_text("x = 1\n")
    (pkg / "notes.txt").write_text("not code")
    assert version.content_hash(str(pkg)) == version.content_hash()
    with open(pkg / "wire.py", "a") as f:   # one changed line of code: another version
        f.write("\n# changed\n")
    assert version.content_hash(str(pkg)) != version.content_hash()
    kernels = next(pkg.glob("model/csrc/*.cpp"))
    shutil.copytree(version.package_dir(), tmp_path / "again" / "layerline", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "again" / "layerline" / kernels.relative_to(pkg)).write_text("// changed kernel\n")
    assert version.content_hash(str(tmp_path / "again" / "layerline")) != version.content_hash()


def test_a_host_is_reinstalled_exactly_when_its_version_differs():
    v = version.full()
    assert version.needs_install(0, v + "\n", v) is False
    assert version.needs_install(0, "0.1.0+000000000000", v) is True    # same package version, other code
    assert version.needs_install(0, layerline.__version__, v) is True    # a layerline that prints no hash
    assert version.needs_install(1, "", v) is True                        # none, or too old to have layerline.version
    r = subprocess.run([sys.executable, "-c", VERSION_CODE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == v   # what the role asks a host's interpreter


def test_the_filter_decides_not_yaml():
    import importlib.util
    spec = importlib.util.spec_from_file_location("ll_filters", ROOT / "modules" / "filter_plugins" / "layerline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    v = version
    f = mod.FilterModule().filters()
    assert f["layerline_version"]() == v.full()
    assert f["layerline_runtime_needs_install"]({"rc": 0, "stdout": v.full()}, v.full()) is False
    assert f["layerline_runtime_needs_install"]({"rc": 0, "stdout": "0.1.0"}, v.full()) is True
    assert f["layerline_runtime_needs_install"]({"rc": 1, "stdout": ""}, v.full()) is True
    for task in (ROOT / "roles" / "layerline_runtime" / "tasks").glob("*.yml"):
        assert "!= (layerline_runtime_version" not in task.read_text(), f"{task}: the decision belongs in Python"


def test_a_server_on_other_code_than_the_controllers_refuses_to_start(tmp_path, capsys):
    """The server's --layerline-version (in its argv as the workers', so an upgrade restarts it): other code
    than the controller's stops it in one line naming both versions, before it listens or reads a plan."""
    import argparse

    from layerline.server import cli
    a = cli.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--plan", str(tmp_path / "none.json"), "--port", "0", "--layerline-version", "0.0.9+0123456789ab"])
    assert cli.run(a) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"--layerline-version: the controller runs layerline 0.0.9+0123456789ab, this host's "
                        f"{sys.executable} has {version.full()}; re-run deploy.yml so the runtime role installs "
                        "the controller's version here") and len(err.splitlines()) == 1, err
    a.layerline_version = version.full()   # the same code passes that check (and stops later: no --keys)
    assert cli.run(a) == 2 and "--layerline-version" not in capsys.readouterr().err


def pair(tmp_path, sender_version: str | None):
    """A CURVE ROUTER (this side, stamped) and a DEALER into it whose handshake says sender_version
    (None: stamped as this process)."""
    kd = keys.local_keys(str(tmp_path / "keys"), ["w"])
    ctx = zmq.Context()
    hk, ck = keys.load_host_keys(kd["w"]), keys.load_host_keys(kd["controller"])
    srv = ctx.socket(zmq.ROUTER)
    keys.serve_curve(srv, hk)
    port = srv.bind_to_random_port("tcp://127.0.0.1")
    cli = ctx.socket(zmq.DEALER)
    if sender_version is None:
        keys.connect_curve(cli, ck, hk.public)
    else:   # another build: its own version in the handshake
        cli.setsockopt(zmq.METADATA, f"{version.PROP_VERSION}:{sender_version}".encode())
        cli.setsockopt(zmq.METADATA, f"{version.PROP_PROTOCOL}:{version.PROTOCOL}".encode())
        cli.setsockopt(zmq.CURVE_SECRETKEY, ck.secret)
        cli.setsockopt(zmq.CURVE_PUBLICKEY, ck.public)
        cli.setsockopt(zmq.CURVE_SERVERKEY, hk.public)
    cli.connect(f"tcp://127.0.0.1:{port}")
    return ctx, srv, cli


@pytest.mark.parametrize("other", [None, "0.1.0+000000000000"])
def test_every_connection_carries_both_versions(tmp_path, other):
    ctx, srv, cli = pair(tmp_path, other)
    try:
        cli.send(b"hello")
        assert srv.poll(10_000)
        ident, body = srv.recv_multipart(copy=False)
        bad = version.mismatch(body, "stage w2", "stage w1")
        if other is None:
            assert bad is None and version.peer_of(body) == (version.full(), str(version.PROTOCOL))
        else:
            assert bad == (f"version mismatch: stage w2 runs layerline 0.1.0+000000000000 (wire protocol 1), stage w1 "
                           f"runs layerline {version.full()} (wire protocol 1); re-run deploy.yml so every host gets "
                           "the controller's layerline (the runtime role reinstalls and restarts the hosts that differ)")
        srv.send_multipart([ident.bytes, b"back"])   # the answer carries this side's version to the sender
        assert cli.poll(10_000)
        assert version.peer_of(cli.recv(copy=False)) == (version.full(), str(version.PROTOCOL))
    finally:
        srv.close(0)
        cli.close(0)
        ctx.term()
