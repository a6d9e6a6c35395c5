"""The playbooks and roles pass ansible-lint's production profile; the modules document themselves."""
from __future__ import annotations

import subprocess

from helpers import BIN, ROOT, ansible_env


def test_ansible_lint_production():
    r = subprocess.run([str(BIN / "ansible-lint"), "--profile", "production", "--nocolor",
                        "deploy.yml", "drain.yml", "teardown.yml", "playbooks", "roles"],
                       cwd=ROOT, env=ansible_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]


def test_ansible_doc_for_every_module():
    for mod in sorted(p.stem for p in (ROOT / "modules" / "library").glob("layerline_*.py")):
        r = subprocess.run([str(BIN / "ansible-doc"), "-M", "modules/library", mod], cwd=ROOT,
                           env=ansible_env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "OPTIONS" in r.stdout, f"{mod}: {r.stderr[-2000:]}"
