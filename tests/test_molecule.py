"""The molecule scenarios, as a developer runs them: `molecule test -s default` and `-s multihost`.

default: deploy.yml on the embedded inventory (local connection), converge, idempotence, verify.
multihost: the same over ssh to three namespace hosts made by scripts/testhosts.py (needs root).
Both run offline: no dependency step, no collections; the repo's ansible.cfg.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import pytest

from helpers import BIN, ROOT, ansible_env

# tiers: default is e2e, multihost is multihost (tests/conftest.py marks them)


def molecule(scenario: str) -> None:
    # A private ephemeral dir, outside /tmp (the namespace hosts have their own /tmp).
    eph = tempfile.mkdtemp(prefix=f"layerline-molecule-{scenario}-", dir="/var/tmp")
    env = ansible_env(MOLECULE_EPHEMERAL_DIRECTORY=eph, NO_COLOR="1", MOLECULE_NO_COLOR="1")
    try:
        t0 = time.perf_counter()
        r = subprocess.run([str(BIN / "molecule"), "test", "-s", scenario], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=900)
        dt = time.perf_counter() - t0
    finally:
        shutil.rmtree(eph, ignore_errors=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"molecule test -s {scenario} exited {r.returncode}\n{out[-8000:]}"
    for step in ("converge", "idempotence", "verify"):
        assert f"{scenario} > {step}: Executed: Successful" in out, f"{step} did not run\n{out[-4000:]}"
    print(f"\n[molecule] {scenario}: {dt:.1f} s")


def test_molecule_default():
    molecule("default")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                    reason="the multihost scenario needs root and iproute2 (network namespaces, a bridge)")
def test_molecule_multihost():
    molecule("multihost")
