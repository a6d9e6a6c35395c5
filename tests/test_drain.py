"""Operations under load, as a user runs them: deploy.yml, then drain.yml and a rejoin while eight
clients keep streaming greedy completions through the deployed server. Every request completes
with 200 and exactly the tokens of an undisturbed run; a drain that fails puts everything back."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from helpers import ROOT, playbook, wait_for

# tier: e2e (tests/conftest.py marks by module)

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
    extra = ["-e", json.dumps({"layerline_home": str(home), "layerline_checkpoint": str(ckpt),
                               "layerline_demo_checkpoint": False, "layerline_policy": "uniform",
                               "layerline_precision": "fp32", "layerline_port_base": PORT_BASE,
                               "layerline_prompt": "", "layerline_seq": 8, "layerline_generate": 4})]
    try:
        playbook("deploy.yml", *extra)
        reference = {i: complete(p) for i, p in enumerate(PROMPTS)}
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


def test_drain_and_rejoin_under_load_lose_nothing(deployed):
    home, extra, reference = deployed
    before = actives(home)
    assert [h for h, _, _ in before] == ["w1", "w2", "w3"]

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
    assert not any((home / "state" / f"{h}.1" / "ready.json").exists() for h in ("w1", "w2", "w3"))
    assert complete(PROMPTS[0]) == reference[0]

    # drain w2 under load: two hosts hold the model, on the other slot's ports
    replays = metric("layerline_replays_total")
    with Load() as load:
        r = playbook("drain.yml", *extra, "-e", "layerline_drain=w2")
    out = " ".join(r.stdout.split())
    assert "route epoch 1 through w1, w3" in out and "matches the one-process forward" in out, out[-3000:]
    after = actives(home)
    assert [h for h, _, _ in after] == ["w1", "w3"] and after[0][1][0] == 0 and after[-1][1][1] == 6
    assert all(e.endswith(str(PORT_BASE + 50 + 10 * (int(h[1]) - 1))) for h, _, e in after), after
    assert json.loads((home / "route.json").read_text()) == {"slot": 1, "drained": ["w2"]}
    assert not any((home / "state" / h / "ready.json").exists() for h in ("w1", "w2", "w3")), "old slot stopped"
    n = load.check(reference)
    assert metric("layerline_replays_total") > replays, "the switch landed while requests were running"

    # w2 rejoins under load, from Python (the same plays as deploy.yml -e layerline_rejoin=w2):
    # back to three hosts, on slot 0
    from layerline import Cluster
    with Load() as load, Cluster.from_path(ROOT / "inventory", extravars=json.loads(extra[1]), quiet=True) as c:
        plan = c.rejoin("w2")
    assert [s["host"] for s in plan["stages"] if s["role"] == "active"] == ["w1", "w2", "w3"]
    assert actives(home) == before
    assert json.loads((home / "route.json").read_text()) == {"slot": 0, "drained": []}
    assert not any((home / "state" / f"{h}.1" / "ready.json").exists() for h in ("w1", "w2", "w3"))
    n += load.check(reference)

    # under load, w1's worker stops answering for 5 s (SIGSTOP) and w3's is SIGKILLed (its supervisor
    # restarts it): the server waits for each, every running sequence replays, nothing is lost
    for host, sig in (("w1", signal.SIGSTOP), ("w3", signal.SIGKILL)):
        pid = json.loads((home / "state" / host / "ready.json").read_text())["pid"]
        with Load() as load:
            os.kill(pid, sig)
            if sig == signal.SIGSTOP:
                time.sleep(5)
                os.kill(pid, signal.SIGCONT)
            wait_for(lambda: httpx.get(URL + "/health", timeout=10).status_code == 200 and
                     metric("layerline_failovers_total") >= (1 if host == "w1" else 2), timeout=60,
                     what=f"the server to fail over {host} and answer again")
            time.sleep(1.0)
        n += load.check(reference)

    # w3 dies for good (its supervisor stopped too): the server marks it down, and drain.yml takes it
    # out although it does not answer (the gate lets down only the hosts being drained)
    r = subprocess.run([sys.executable, "-m", "layerline.supervise", "stop", "--state-dir",
                        str(home / "state" / "w3")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    wait_for(lambda: 'layerline_stage_up{host="w3",role="active"} 0.0' in httpx.get(URL + "/metrics", timeout=10).text,
             timeout=30, what="the server to mark w3 down")
    r = playbook("drain.yml", *extra, "-e", "layerline_drain=w3")
    assert "route epoch 3 through w1, w2" in " ".join(r.stdout.split())
    assert [h for h, _, _ in actives(home)] == ["w1", "w2"]
    assert all(complete(p) == reference[i] for i, p in enumerate(PROMPTS[:2]))
    print(f"\n{n} requests of {N_TOKENS} tokens through a drain, a rejoin, a SIGSTOP and a SIGKILL: all 200, "
          "all equal to the undisturbed tokens")


def test_bad_drains_are_one_line_and_touch_nothing(deployed):
    home, extra, _ = deployed
    plan = (home / "plan.json").read_text()
    for arg, says in (("layerline_drain=w9", "layerline_drain: w9 is not a host of group layerline"),
                      ("layerline_drain=w1,w2,w3", "would leave no host to serve"),
                      ("layerline_drain=", "layerline_drain: name the host(s) to take out")):
        r = playbook("drain.yml", *extra, "-e", arg, check=False)
        assert r.returncode != 0 and says in " ".join(r.stdout.split()), r.stdout[-2000:]
        assert "Traceback" not in r.stdout + r.stderr
    r = playbook("deploy.yml", *extra, "-e", "layerline_rejoin=w1", check=False)
    assert r.returncode != 0 and "w1 is not drained" in " ".join(r.stdout.split())
    assert (home / "plan.json").read_text() == plan
