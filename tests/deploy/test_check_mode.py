"""`ansible-playbook deploy.yml --check --diff` on the embedded inventory, from nothing: it runs to the end,
predicts what a real run would change, shows the route's and plan's changes, and writes nothing (no
layerline_home: no checkpoint, keys, probe cache, plan or state dir) and starts no process. One playbook run.
"""
from __future__ import annotations

import re

from helpers import playbook, processes_mentioning

PORT_BASE = 29950  # nothing listens in check mode; still clear of every other test's ports


def test_deploy_in_check_mode_changes_nothing(tmp_path):
    home = tmp_path / "home"   # not made: check mode must not make it either
    # policy uniform: all three workers hold layers whatever the probes measure on a busy machine
    r = playbook("deploy.yml", "--check", "--diff", "-e", f"layerline_home={home}",
                 "-e", f"layerline_port_base={PORT_BASE}", "-e", "layerline_policy=uniform")
    out = r.stdout
    recap = dict(re.findall(r"^(w\d)\s+: (ok=.*)$", out, re.M))
    assert sorted(recap) == ["w1", "w2", "w3"], out[-2000:]
    assert all("failed=0" in line and "unreachable=0" in line for line in recap.values()), recap
    # honest predictions: a deploy from nothing would make the checkpoint, keys, state dirs and start workers
    assert not re.search(r"\bchanged=0\b", recap["w1"]), recap
    assert re.search(r"TASK \[Write the demo checkpoint when it is missing\][^\n]*\nchanged:", out)
    assert re.search(r"layerline_worker : Start the worker[^\n]*\n(changed: \[w\d\]\n){3}", out), out[-4000:]
    # the test hosts' PID 1 is not systemd: layerline_service_manager auto resolves to the supervisor on each
    assert re.search(r"layerline_worker : Run the worker as a systemd unit[^\n]*\n(skipping: \[w\d\]\n){3}", out), \
        out[-4000:]
    # --diff: the route state and the plan a real run would keep
    assert f"+++ after: {home}/route.json" in out and f"+++ after: {home}/plan.json" in out
    assert "check mode: the pipeline not driven" in out
    assert not home.exists(), sorted(str(p) for p in home.rglob("*"))
    assert not processes_mentioning(str(home))
