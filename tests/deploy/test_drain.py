"""Operations under load, as a user runs them: deploy.yml on the embedded inventory plus a standby
for w3 (w4), then drain.yml, a standby taking over a SIGKILLed worker, a SIGSTOPped worker waited
for, a rejoin, a drain that promotes the standby in place and the drain of a dead host, while
eight clients keep streaming greedy completions through the deployed server. Every request
completes with 200 and exactly the tokens of an undisturbed run; a drain that fails puts
everything back."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers import BIN, ROOT, playbook, wait_for

PORT_BASE = 29300  # clear of the demo (29100), test_e2e_deploy (29400), test_cluster (29500), molecule
URL = f"http://127.0.0.1:{PORT_BASE + 90}"
N_TOKENS = 48
PROMPTS = [[5 + i, 17, 3 + 2 * i, 99 - i] for i in range(8)]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    from layerline.checkpoint import write_demo_checkpoint
    home = tmp_path_factory.mktemp("drain")
    # fp32: a replayed prefix (one batched prefill) gives the very logits its token-by-token steps gave
    ckpt = write_demo_checkpoint(home / "ckpt", layers=6, hidden=128, vocab=500, dtype="float32", seed=7)
    # the embedded inventory and w4, a standby for w3 (an inventory dir: ansible-playbook and Cluster read it alike)
    inv = home / "inventory"
    shutil.copytree(ROOT / "inventory", inv)
    (inv / "standby.yml").write_text(json.dumps({"layerline": {"hosts": {"w4": {
        "layerline_port": "{{ layerline_port_base | int + 30 }}", "layerline_role": "standby",
        "layerline_standby_for": "w3"}}}}))
    # a stage down for 10 s past its supervisor's restarts is re-planned around: the server runs drain.yml
    drain = (f"env ANSIBLE_CONFIG={ROOT / 'ansible.cfg'} {BIN / 'ansible-playbook'} {ROOT / 'drain.yml'} "
             f"-i {inv} -e @{home / 'vars.json'} -e layerline_drain={{host}}")
    ev = {"layerline_home": str(home), "layerline_checkpoint": str(ckpt), "layerline_demo_checkpoint": False,
          "layerline_policy": "uniform", "layerline_precision": "fp32", "layerline_port_base": PORT_BASE,
          "layerline_prompt": "", "layerline_seq": 8, "layerline_generate": 4,
          "layerline_serve_restart_wait": 10, "layerline_serve_on_stage_lost": drain,
          # niced workers on two cores shared with the load, the plays and another test file can take
          # over 2 s to answer a health check: a stage taken for dead there would be failed over
          "layerline_serve_health_deadline": 4,
          # the workers yield the CPU to the plays beside them; the load takes what is left
          "layerline_nice": 10}
    (home / "vars.json").write_text(json.dumps(ev))
    extra = ["-i", str(inv), "-e", json.dumps(ev)]
    try:
        playbook("deploy.yml", *extra)
        # the undisturbed run: the same eight requests at once, as the load sends them
        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            reference = dict(enumerate(ex.map(complete, PROMPTS)))
        assert all(len(t) == N_TOKENS for t in reference.values())
        yield home, extra, reference
    finally:
        playbook("teardown.yml", *extra, check=False)


def complete(prompt: list[int]) -> list[int]:
    """One streamed greedy completion; its token ids (raises on anything but 200 and a full stream)."""
    body = {"model": "ckpt", "prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    tokens, finish = [], None
    with httpx.stream("POST", URL + "/v1/completions", json=body, timeout=httpx.Timeout(120, connect=5)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            assert "error" not in d, d
            tokens += d["choices"][0].get("token_ids") or []
            finish = d["choices"][0].get("finish_reason") or finish
    assert finish == "length", finish
    return tokens


class Load:
    """Eight clients, each streaming its prompt again and again until stopped."""

    def __init__(self):
        self.stop = threading.Event()
        self.results: list[tuple[int, list[int] | str]] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(len(PROMPTS))]

    def _client(self, i: int) -> None:
        while not self.stop.is_set():
            try:
                self.results.append((i, complete(PROMPTS[i])))
            except Exception as e:  # noqa: BLE001 - every failure is reported by check()
                self.results.append((i, repr(e)))

    def __enter__(self):
        for t in self.threads:
            t.start()
        time.sleep(1.0)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(150)

    def check(self, reference: dict) -> int:
        bad = [(i, r) for i, r in self.results if r != reference[i]]
        assert not bad, f"{len(bad)} of {len(self.results)} requests failed or differ: {bad[:3]}"
        return len(self.results)


def metric(name: str) -> float:
    text = httpx.get(URL + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def actives(home) -> list[tuple[str, list[int], str]]:
    plan = json.loads((home / "plan.json").read_text())
    return [(s["host"], s["layers"], s["endpoint"]) for s in plan["stages"] if s["role"] == "active"]


def ready(home, host: str, slot: int = 0) -> dict | None:
    f = home / "state" / (host if slot == 0 else f"{host}.{slot}") / "ready.json"
    return json.loads(f.read_text()) if f.exists() else None


def supervisor_pid(home, host: str, slot: int = 0) -> int:
    d = home / "state" / (host if slot == 0 else f"{host}.{slot}")
    return json.loads((d / "supervisor.json").read_text())["pid"]


def test_drain_and_rejoin_under_load_lose_nothing(deployed):
    home, extra, reference = deployed
    before = actives(home)
    assert [h for h, _, _ in before] == ["w1", "w2", "w3"]
    assert ready(home, "w4"), "the standby runs"
    assert {os.getpriority(os.PRIO_PROCESS, ready(home, h)["pid"]) for h in ("w1", "w2", "w3", "w4")} == {10}

    # a drain whose new route cannot come up (w1's new port is taken) changes nothing
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", PORT_BASE + 50))
        taken.listen()
        r = playbook("drain.yml", *extra, "-e", "layerline_drain=w2", "-e", "layerline_worker_ready_timeout=3",
                     check=False)
    assert r.returncode != 0
    out = " ".join(r.stdout.split())
    assert "drain of w2 failed" in out and "restored: the server routes through the old plan" in out, out[-3000:]
    assert actives(home) == before
    assert json.loads((home / "route.json").read_text()) == {"slot": 0, "drained": []}
    assert not any(ready(home, h, 1) for h in ("w1", "w2", "w3", "w4"))
    assert complete(PROMPTS[0]) == reference[0]

    # drain w2 under load (no standby for it): w1 and w3 hold the model, on the other slot's ports,
    # and w4 mirrors w3's new layers there
    replays = metric("layerline_replays_total")
    with Load() as load:
        r = playbook("drain.yml", *extra, "-e", "layerline_drain=w2")
    out = " ".join(r.stdout.split())
    assert "route epoch 1 through w1, w3" in out and "matches the one-process forward" in out, out[-3000:]
    after = actives(home)
    assert [h for h, _, _ in after] == ["w1", "w3"] and after[0][1][0] == 0 and after[-1][1][1] == 6
    assert all(e.endswith(str(PORT_BASE + 50 + 10 * (int(h[1]) - 1))) for h, _, e in after), after
    assert json.loads((home / "route.json").read_text()) == {"slot": 1, "drained": ["w2"]}
    assert not any(ready(home, h) for h in ("w1", "w2", "w3", "w4")), "old slot stopped"
    n = load.check(reference)
    assert metric("layerline_replays_total") > replays, "the switch landed while requests were running"

    # under load, w3's worker is SIGKILLed while its supervisor is held (so it is not back before the
    # monitor looks): the standby w4 is promoted; then w1's worker stops answering for 7 s (SIGSTOP,
    # no standby): the server waits for it. Only what w4 lacks is replayed (the stall replays
    # nothing); nothing is lost.
    promoted = metric("layerline_failovers_total")
    with Load() as load:
        sup = supervisor_pid(home, "w3", 1)
        os.kill(sup, signal.SIGSTOP)
        try:
            os.kill(ready(home, "w3", 1)["pid"], signal.SIGKILL)
            wait_for(lambda: 'action="promoted",host="w3"' in httpx.get(URL + "/metrics", timeout=10).text,
                     timeout=60, what="the server to promote w4 for w3")
        finally:
            os.kill(sup, signal.SIGCONT)
        time.sleep(1.0)
    n += load.check(reference)
    health = httpx.get(URL + "/health", timeout=10).json()
    assert [s["name"] for s in health["stages"]] == ["w1", "w4"], health
    replays = metric("layerline_replays_total")
    with Load() as load:
        pid = ready(home, "w1", 1)["pid"]
        os.kill(pid, signal.SIGSTOP)
        time.sleep(7)   # past the 4 s health deadline: the server takes w1 for down
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: httpx.get(URL + "/health", timeout=10).status_code == 200 and
                 metric("layerline_failovers_total") >= promoted + 2, timeout=60,
                 what="the server to wait for w1 and answer again")
        time.sleep(1.0)
    n += load.check(reference)
    assert metric("layerline_replays_total") == replays, "w1 kept its caches: the stall replays nothing"

    # w2 rejoins under load, from Python (the same plays as deploy.yml -e layerline_rejoin=w2):
    # back to three hosts and the standby, on slot 0
    from layerline import Cluster
    with Load() as load, Cluster.from_path(home / "inventory", extravars=json.loads(extra[3]), quiet=True) as c:
        plan = c.rejoin("w2")
    assert [s["host"] for s in plan["stages"] if s["role"] == "active"] == ["w1", "w2", "w3"]
    assert actives(home) == before
    assert json.loads((home / "route.json").read_text()) == {"slot": 0, "drained": []}
    assert not any(ready(home, h, 1) for h in ("w1", "w2", "w3", "w4"))
    n += load.check(reference)

    # drain w3 under load: its standby takes its place where it runs (slot 0, no worker starts), w2
    # now hands its output to w4, and w3's worker stops
    w4 = ready(home, "w4")["pid"]
    with Load() as load:
        r = playbook("drain.yml", *extra, "-e", "layerline_drain=w3")
    out = " ".join(r.stdout.split())
    assert "through w1, w2, w4" in out and "matches the one-process forward" in out, out[-3000:]
    assert [(h, ls) for h, ls, _ in actives(home)] == [(h if h != "w3" else "w4", ls) for h, ls, _ in before]
    assert json.loads((home / "route.json").read_text()) == {"slot": 0, "drained": ["w3"], "promoted": {"w4": "w3"}}
    assert ready(home, "w4")["pid"] == w4 and not ready(home, "w3") and not ready(home, "w4", 1)
    n += load.check(reference)

    # w1 dies for good (its supervisor stopped too): the server marks it down, waits 10 s for a restart
    # that does not come, and runs its --on-stage-lost command: drain.yml for w1, which takes it out
    # although it does not answer (the gate lets down only the hosts being drained); w4 keeps w3's
    # place in the new plan
    r = subprocess.run([sys.executable, "-m", "layerline.supervise", "stop", "--state-dir",
                        str(home / "state" / "w1")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    log_file = home / "state" / "server" / "on-stage-lost-w1.log"
    wait_for(lambda: log_file.exists() and "PLAY RECAP" in log_file.read_text(), timeout=240,
             what=f"the server's drain of w1 to end ({log_file})")
    log = log_file.read_text()
    assert httpx.get(URL + "/health", timeout=10).status_code == 200
    assert "through w2, w4" in " ".join(log.split()), log[-3000:]
    assert [h for h, _, _ in actives(home)] == ["w2", "w4"]
    assert json.loads((home / "route.json").read_text()) == {"slot": 1, "drained": ["w3", "w1"],
                                                             "promoted": {"w4": "w3"}}
    assert all(complete(p) == reference[i] for i, p in enumerate(PROMPTS[:2]))
    print(f"\n{n} requests of {N_TOKENS} tokens through a drain, a standby promoted for a SIGKILLed worker, a "
          "SIGSTOP, a rejoin, a drain that promoted the standby in place: all 200, all equal to the undisturbed tokens; "
          "a dead host re-planned around by the server")


def test_bad_drains_are_one_line_and_touch_nothing(deployed):
    home, extra, _ = deployed
    plan = (home / "plan.json").read_text()
    for arg, says in (("layerline_drain=w9", "layerline_drain: w9 is not a host of group layerline"),
                      ("layerline_drain=w2,w4", "would leave no host to serve"),
                      ("layerline_drain=", "layerline_drain: name the host(s) to take out")):
        r = playbook("drain.yml", *extra, "-e", arg, check=False)
        assert r.returncode != 0 and says in " ".join(r.stdout.split()), r.stdout[-2000:]
        assert "Traceback" not in r.stdout + r.stderr
    r = playbook("deploy.yml", *extra, "-e", "layerline_rejoin=w2", check=False)
    assert r.returncode != 0 and "w2 is not drained" in " ".join(r.stdout.split())
    assert (home / "plan.json").read_text() == plan
