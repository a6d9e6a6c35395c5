"""Running the project's playbooks the way a user does, from tests."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def ansible_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_FORCE_COLOR="0", ANSIBLE_NOCOLOR="1",
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def playbook(name: str, *args: str, timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "ansible-playbook"), name, *args]
    r = subprocess.run(cmd, cwd=ROOT, env=ansible_env(), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}")
    return r


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP counts per host."""
    out = {}
    for m in re.finditer(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$", output, re.M):
        out[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return out
