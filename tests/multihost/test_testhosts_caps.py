"""scripts/testhosts.py --mem-limit: each namespace host runs inside a memory cgroup of its own, so
the kernel holds its ssh logins and what they start to the cap, and the probe reads the cap as
the host's RAM; and a host's root runs no shell startup of the controller's. Needs root (namespaces,
a bridge, cgroups)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from helpers import run_testhosts

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                                reason="test hosts need root and iproute2 (network namespaces, a bridge)")

PREFIX = "llcap"
CAPS = (512 << 20, 640 << 20)  # a probe imports torch (~210 MiB) and measures with buffers of its own


def hostctl(*args: str) -> subprocess.CompletedProcess:
    return run_testhosts(*args, timeout=300)


@pytest.fixture(scope="module")
def hosts():
    out = Path(tempfile.mkdtemp(prefix="layerline-caps-", dir="/var/tmp")) / "hosts"
    try:
        r = hostctl("up", "2", "--prefix", PREFIX, "--subnet", "10.77.9.0/24", "--out", str(out),
                    "--mem-limit", ",".join(f"{c >> 20}M" for c in CAPS), "--json")
        assert r.returncode == 0, f"testhosts up failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        yield json.loads(r.stdout)
    finally:
        hostctl("down", "--prefix", PREFIX, "--out", str(out))
        shutil.rmtree(out.parent, ignore_errors=True)


def on(info: dict, host: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-F", info["ssh_config"], host, command], capture_output=True, text=True,
                          timeout=120)


def test_probe_reads_each_host_cap_as_its_ram(hosts):
    for (name, h), cap in zip(sorted(hosts["hosts"].items()), CAPS):
        assert h["mem_limit_bytes"] == cap
        r = on(hosts, name, f"{hosts['python']} -c 'import json; from layerline.probe import probe; "
                            "c = probe(None, budget_s=0.05, measure_disk=False); "
                            "print(json.dumps([c[\"ram_total_bytes\"], c[\"ram_available_bytes\"], c[\"hostname\"]]))'")
        assert r.returncode == 0, r.stderr
        total, available, hostname = json.loads(r.stdout.strip().splitlines()[-1])
        assert total == cap, f"{name}: probe says {total} bytes of RAM, its cap is {cap}"
        assert 0 < available <= cap
        assert hostname == h["hostname"]


def test_a_host_runs_no_shell_startup_of_the_controllers(hosts):
    """Root's ~/.bashrc on a host is /etc/skel's, as on a fresh machine: sshd runs each command through the
    login shell, which reads ~/.bashrc, and this controller's (pyenv's init) cost every Ansible task on
    every host about 60 processes."""
    import pwd
    rc = Path(pwd.getpwnam("root").pw_dir) / ".bashrc"
    if not rc.is_file():
        pytest.skip("root has no ~/.bashrc here: nothing to replace")
    skel = Path("/etc/skel/.bashrc")
    want = skel.read_text() if skel.is_file() else ""
    for name in hosts["hosts"]:
        r = on(hosts, name, f"cat {rc}")
        assert r.returncode == 0 and r.stdout == want, f"{name}: ~/.bashrc is not /etc/skel's: {r.stdout[:300]!r}"


def test_the_kernel_kills_what_outgrows_the_cap(hosts):
    name, h = sorted(hosts["hosts"].items())[0]
    over = CAPS[0] + (128 << 20)
    # touch every page: an allocation past the cap is OOM-killed (SIGKILL, 137), whatever overcommit says
    r = on(hosts, name, f"{hosts['python']} -c 'b = bytearray({over}); print(len(b))' ; echo rc=$?")
    assert "rc=137" in r.stdout, (r.stdout, r.stderr)
    small = on(hosts, name, f"{hosts['python']} -c 'b = bytearray({CAPS[0] // 4}); print(len(b))'")
    assert small.returncode == 0 and small.stdout.strip() == str(CAPS[0] // 4)


def test_down_removes_the_cgroups(hosts):
    cgroups = [Path(h["cgroup"]) for h in hosts["hosts"].values()]
    assert all(c.is_dir() for c in cgroups)
    r = hostctl("down", "--prefix", PREFIX, "--out", hosts["out"])
    assert r.returncode == 0, r.stderr
    assert not any(c.exists() for c in cgroups)
