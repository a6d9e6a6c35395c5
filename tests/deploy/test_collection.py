"""The collection as a user meets it: `make collection`'s tarball installed into an empty project
(`ansible-galaxy collection install`), the user's own inventory, ansible.cfg and playbook there, the
collection's playbooks run by their fully qualified names: deploy, the user's playbook (a role, a module
and filters by FQCN: the health gate, a drive), drain, teardown. Nothing in the project points into this
checkout: no ANSIBLE_* variable, no path; only the controller's interpreter (which has the Python package
layerline installed, as a user's would) is this venv's.

Cheap on purpose: two local workers at layerline_nice, a 2-layer random-init model, ports 29800-29899
(clear of the demo 29100, test_cluster 29500, molecule 29600, test_bad_deploys 29700).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import BIN, ROOT

PORT_BASE = 29800
FQ = "layerline.layerline"

USER_PLAYBOOK = f"""---
# a user's own play: the collection's role, module and filters by their fully qualified names
- name: Check and drive the deployed model
  hosts: layerline
  gather_facts: false
  tasks:
    - name: The server answers and every stage is up
      ansible.builtin.include_role:
        name: {FQ}.layerline_server
        tasks_from: gate
        apply:
          delegate_to: "{{{{ groups | {FQ}.layerline_server_host }}}}"
          run_once: true
      run_once: true

    - name: Drive the running plan
      {FQ}.layerline_drive:
        argv: >-
          {{{{ layerline_home | {FQ}.layerline_saved_plan
             | {FQ}.layerline_drive_argv(hostvars[inventory_hostname], ansible_playbook_python) }}}}
      register: user_drive
      run_once: true
      delegate_to: localhost

    - name: Show the verdict
      ansible.builtin.debug:
        msg: "user drive: {{{{ user_drive.msg }}}}"
      run_once: true
"""


def _env(project: Path) -> dict:
    """A user's shell: no ANSIBLE_* from this checkout's tests; the project's own ansible.cfg is found in cwd."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", PYTHONUNBUFFERED="1",
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return env


def _run(project: Path, *cmd: str, timeout: int = 600) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    r = subprocess.run([str(BIN / cmd[0]), *cmd[1:]], cwd=project, env=_env(project), capture_output=True, text=True,
                       timeout=timeout)
    print(f"[collection] {' '.join(cmd)}: {time.perf_counter() - t0:.1f} s, rc {r.returncode}")
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert str(ROOT) not in r.stdout.replace(sys.executable, "").replace(str(BIN), ""), \
        f"{' '.join(cmd)}: output names this checkout"
    return r


def test_the_installed_collection_deploys_drives_drains_and_tears_down(tmp_path):
    from layerline.checkpoint import write_demo_checkpoint

    built = subprocess.run([sys.executable, str(ROOT / "scripts" / "collection.py"), "build", "--out",
                            str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    tarball = Path(built.stdout.strip().splitlines()[-1])
    assert tarball.name.startswith("layerline-layerline-") and tarball.is_file()

    project = tmp_path / "project"
    project.mkdir()
    _run(project, "ansible-galaxy", "collection", "install", str(tarball), "-p", "collections")
    assert (project / "collections/ansible_collections/layerline/layerline/MANIFEST.json").is_file()
    home = project / "home"
    ckpt = write_demo_checkpoint(home / "ckpt", layers=2, hidden=64, vocab=300, dtype="float32", seed=3)
    (project / "ansible.cfg").write_text("[defaults]\ncollections_path = collections\ninventory = inventory.yml\n"
                                         "interpreter_python = auto_silent\n")
    (project / "inventory.yml").write_text(json.dumps({"layerline": {
        "hosts": {"w1": {"layerline_port": PORT_BASE}, "w2": {"layerline_port": PORT_BASE + 10}},
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                 "layerline_home": str(home), "layerline_checkpoint": str(ckpt), "layerline_demo_checkpoint": False,
                 "layerline_serve_port": PORT_BASE + 90, "layerline_policy": "uniform", "layerline_seq": 6,
                 "layerline_nice": 10, "layerline_probe_serial": True, "layerline_reserve_ram_gb": 0}}}, indent=1))
    (project / "site.yml").write_text(USER_PLAYBOOK)

    pids: dict = {}
    try:
        deploy = _run(project, "ansible-playbook", f"{FQ}.deploy")
        plan = json.loads((home / "plan.json").read_text())
        assert [s["host"] for s in plan["stages"] if s["role"] == "active"] == ["w1", "w2"]
        assert json.loads((home / "drive.json").read_text()), deploy.stdout[-3000:]

        user = _run(project, "ansible-playbook", "site.yml")
        assert "user drive: " in user.stdout and "failed=0" in user.stdout

        _run(project, "ansible-playbook", f"{FQ}.drain", "-e", "layerline_drain=w2")
        assert json.loads((home / "route.json").read_text())["drained"] == ["w2"]
        plan = json.loads((home / "plan.json").read_text())
        assert [s["host"] for s in plan["stages"] if s["role"] == "active"] == ["w1"]
        pids = {f.parent.name: json.loads(f.read_text())["pid"] for f in (home / "state").rglob("ready.json")}
        assert "server" in pids and len(pids) >= 2, pids
    finally:
        _run(project, "ansible-playbook", f"{FQ}.teardown")
    assert not list((home / "state").rglob("ready.json"))
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
