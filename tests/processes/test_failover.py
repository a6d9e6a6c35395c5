"""Failover, live: three real stages (and a standby) under the real supervisor, a live server,
four clients streaming greedy tokens while a stage's worker is SIGKILLed or SIGSTOPped. Every
request completes with 200 and exactly the tokens of an undisturbed run, at bf16 and at a GGUF
file's own bits (Q8_0 blocks, precision gguf), where a replay of a sequence's history as one
batched prefill gives other last bits than the steps that made it (the engine replays through the
same computations; tests/multihost/test_deployment.py proves fp32)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers import stop_process

from layerline import wire
from layerline.checkpoint import write_demo_checkpoint
from layerline.local import free_ports, local_keys, local_plan
from layerline.spec import worker_spec

MODEL = "m"
N_TOKENS = 32
PROMPTS = [[5, 6, 7], [11, 12, 13, 14], [21, 22], [31, 32, 33, 34, 35]]


def free_port() -> int:
    from layerline.local import free_ports   # this test process's own range (tests/conftest.py)
    return free_ports(1)[0]


def supervise(*args: str, timeout: float = 150) -> dict:
    r = subprocess.run([sys.executable, "-m", "layerline.supervise", *args], capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise AssertionError(f"supervise {args[0]}: {r.stdout} {r.stderr}") from None


class Cluster:
    """Planned stages (hosts stage0..2, optionally a standby for one of them), each under its own supervisor."""

    def __init__(self, ckpt: Path, tmp: Path, standby: str | None = None, precision: str = "bf16"):
        self.tmp = tmp
        hosts = ["stage0", "stage1", "stage2"] + (["standby"] if standby else [])
        ports = free_ports(len(hosts))
        # control sockets run CURVE always, and the server speaks to them as the controller: clusters
        # beside each other (a route switch) share one keys root, so one controller key reaches all
        keys = local_keys(str(tmp.parent), hosts)
        self.keys = os.path.join(keys, "controller")
        self.hv = {}
        for h, port in zip(hosts, ports):
            v = {"ansible_connection": "local", "layerline_port": port, "layerline_checkpoint": str(ckpt),
                 "layerline_state_dir": str(tmp / h), "layerline_compile": "off", "layerline_threads": 1,
                 "layerline_keys_dir": os.path.join(keys, h)}
            if h == "standby":
                v.update(layerline_role="standby", layerline_standby_for=standby)
            self.hv[h] = v
        plan = local_plan(str(ckpt), 3, precision, self.hv, kv_context=1024)
        self.plan = plan.to_dict()
        self.plan_file = tmp / "plan.json"
        self.plan_file.write_text(json.dumps(self.plan))
        self.dirs = {}
        procs = []
        for h in hosts:
            spec = worker_spec(plan, h, self.hv[h], python=sys.executable)
            os.makedirs(spec.state_dir, mode=0o700, exist_ok=True)
            self.dirs[h] = spec.state_dir
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "layerline.supervise", "start", "--state-dir", spec.state_dir, "--name", h,
                 "--ready-timeout", "120", "--", *spec.argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, stdin=subprocess.DEVNULL))
        for h, p in zip(hosts, procs):
            out, err = p.communicate(timeout=150)
            got = json.loads(out.strip().splitlines()[-1])
            assert got.get("state") == "started", f"{h}: {out} {err}"

    def status(self, host: str) -> dict:
        return supervise("status", "--state-dir", self.dirs[host])

    def stop(self) -> None:
        for d in self.dirs.values():
            try:
                supervise("stop", "--state-dir", d, timeout=40)
            except Exception:  # noqa: BLE001 - best effort in teardown
                pass


class Server:
    def __init__(self, cluster: Cluster, ckpt: Path, tmp: Path, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"server-{self.port}.log"
        self.err = open(tmp / f"server-{self.port}.err", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "layerline.server", "--plan", str(cluster.plan_file), "--keys", cluster.keys,
             "--checkpoint", str(ckpt),
             "--model-name", MODEL, "--port", str(self.port), "--log-file", str(self.log), *extra],
            stdout=subprocess.DEVNULL, stderr=self.err, stdin=subprocess.DEVNULL)
        deadline = time.time() + 60
        while time.time() < deadline:
            assert self.proc.poll() is None, f"server exited: {self.stderr()}"
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise AssertionError(f"server did not come up: {self.stderr()}")
        self.wait_all_up()

    def stderr(self) -> str:
        self.err.flush()
        return Path(self.err.name).read_text()[-3000:]

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def metric(self, name: str, **labels) -> float:
        for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", self.metrics(), re.M):
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                return float(m.group(2))
        return float("nan")

    def wait_all_up(self, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            ups = re.findall(r"^layerline_stage_up\{[^}]*\} (\S+)$", self.metrics(), re.M)
            if ups and all(float(v) == 1.0 for v in ups):
                return
            time.sleep(0.1)
        raise AssertionError(f"not every stage is up: {self.metrics()}")

    def stop(self) -> None:
        stop_process(self.proc)
        self.err.close()


def stream(url: str, prompt: list[int], on_token=None, max_tokens: int = N_TOKENS) -> dict:
    """One streamed greedy completion: status, token ids, the time each came, an error if any."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    out = {"status": None, "tokens": [], "times": [], "error": None, "finish": None}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=httpx.Timeout(120, connect=5)) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                out["error"] = d["error"]
                continue
            c = d["choices"][0]
            for t in c.get("token_ids") or []:
                out["tokens"].append(t)
                out["times"].append(time.perf_counter())
                if on_token is not None:
                    on_token()
            out["finish"] = c.get("finish_reason") or out["finish"]
    return out


def run_clients(url: str, trigger=None, after: int = 3, max_tokens: int = N_TOKENS) -> list[dict]:
    """The four prompts streamed at once; trigger() runs (once, in a client's thread) when every
    client has `after` tokens."""
    counts = [0] * len(PROMPTS)
    fired = threading.Lock()
    state = {"done": False}
    results: list = [None] * len(PROMPTS)

    def client(i: int) -> None:
        def tick():
            counts[i] += 1
            if trigger is not None and not state["done"] and min(counts) >= after and fired.acquire(False):
                state["done"] = True
                trigger()
        try:
            results[i] = stream(url, PROMPTS[i], tick, max_tokens)
        except Exception as e:  # noqa: BLE001 - reported by the assertions
            results[i] = {"status": None, "tokens": [], "times": [], "error": repr(e), "finish": None}
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    return results


def max_gap(r: dict) -> float:
    t = r["times"]
    return max((b - a for a, b in zip(t, t[1:])), default=0.0)


def check_same(reference: list[dict], got: list[dict]) -> None:
    """Every stream whole and, as far as the undisturbed run went (a longer one: its first tokens), the
    same tokens."""
    for i, (ref, r) in enumerate(zip(reference, got)):
        assert r["status"] == 200 and r["error"] is None, f"client {i}: {r['status']} {r['error']}"
        assert r["finish"] == "length", f"client {i}: finish {r['finish']}"
        assert r["tokens"][:len(ref["tokens"])] == ref["tokens"], f"client {i}: tokens differ from the undisturbed run"


# the streams a stop must land in the middle of: a busy machine's client threads can read their third
# token after the server generated all N_TOKENS (once, beside a busy loop, all four had: the SIGSTOP
# stalled nothing); 200 take 1.4 s quiet (7 ms a token), several beside the loop, and four such
# streams still fit the plan's KV context of 1024 at once
DISTURBED = 200


def report(what: str, reference: list[dict], got: list[dict]) -> float:
    normal = max(max_gap(r) for r in reference)
    worst = max(max_gap(r) for r in got)
    print(f"\n{what}: longest inter-token gap {worst:.2f} s (undisturbed {normal * 1e3:.1f} ms)")
    return worst


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fo") / "ck"
    write_demo_checkpoint(out, layers=6, hidden=128, vocab=500, dtype="float32", seed=1)
    return out


@pytest.fixture(scope="module")
def plain(ckpt, tmp_path_factory):
    """Three stages without a standby, and a server over them (down after two missed 1-s health
    checks: a stopped stage is seen within the tests' stops)."""
    tmp = tmp_path_factory.mktemp("plain")
    cluster = Cluster(ckpt, tmp)
    server = None
    try:
        server = Server(cluster, ckpt, tmp, "--health-deadline", "1")
        reference = run_clients(server.url)
        for r in reference:
            assert r["status"] == 200 and len(r["tokens"]) == N_TOKENS, r
        yield cluster, server, reference
    finally:
        if server is not None:
            server.stop()
        cluster.stop()


def test_the_health_monitor_keeps_one_connection_to_each_stage(plain):
    """The server asks each stage's health every interval over a kept connection (pipeline.ControlChannel),
    not over a new one each time (a TCP connect, a CURVE handshake and the worker's ZAP check, twice a second
    a stage: most of an idle deployment's CPU): an established connection to every control port is there
    whenever looked at, where a connection a probe lives for a few ms of each 0.5 s."""
    import psutil
    from layerline.endpoints import control_endpoint
    cluster, server, _ = plain
    server.wait_all_up()
    ports = {int(control_endpoint(s["endpoint"]).rsplit(":", 1)[1]) for s in cluster.plan["stages"]}
    seen = dict.fromkeys(ports, 0)
    for _ in range(6):
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_ESTABLISHED and c.laddr.port in seen:
                seen[c.laddr.port] += 1
        time.sleep(0.5)
    assert all(n >= 4 for n in seen.values()), f"established connections to each control port, of 6 looks: {seen}"


def test_sigkill_restarted_by_the_supervisor(plain):
    """The restarted stage lost every running sequence's cache: they replay their prefix."""
    cluster, server, reference = plain
    replays = server.metric("layerline_replays_total")
    pid = cluster.status("stage1")["worker_pid"]
    assert pid
    t = {}

    def kill():
        t["kill"] = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
    got = run_clients(server.url, kill, max_tokens=DISTURBED)
    assert "kill" in t
    check_same(reference, got)
    worst = report("SIGKILL stage1 (supervisor restart)", reference, got)
    assert worst > 0.5, "the kill did not land mid-generation"
    new = cluster.status("stage1")["worker_pid"]
    assert new and new != pid
    n = [server.metric("layerline_failovers_total", host="stage1", action=a) for a in ("waited", "restarted")]
    assert sum(x for x in n if x == x) >= 1, server.metrics()
    assert server.metric("layerline_stage_up", host="stage1", role="active") == 1.0
    assert server.metric("layerline_replays_total") > replays
    log = server.log.read_text()
    assert "stage1" in log and ("is down" in log or "restarted between" in log)


def test_sigstop_without_a_standby(plain):
    """The stopped stage comes back with its caches (the same process): the server resends every
    sequence from what every stage confirmed and none replays its prefix."""
    cluster, server, reference = plain
    server.wait_all_up()
    replays = server.metric("layerline_replays_total")
    pid = cluster.status("stage2")["worker_pid"]
    t = {}

    def stop():
        t["stop"] = time.perf_counter()
        os.kill(pid, signal.SIGSTOP)

        def cont():
            time.sleep(5)
            os.kill(pid, signal.SIGCONT)
        threading.Thread(target=cont, daemon=True).start()
    before = server.metric("layerline_failovers_total", host="stage2", action="waited")
    got = run_clients(server.url, stop, max_tokens=DISTURBED)
    assert "stop" in t
    check_same(reference, got)
    worst = report("SIGSTOP stage2 5 s", reference, got)
    assert worst > 4.0
    after = server.metric("layerline_failovers_total", host="stage2", action="waited")
    assert after == (0 if before != before else before) + 1  # nan: no failover of stage2 before
    assert cluster.status("stage2")["worker_pid"] == pid  # the same process answered again
    assert server.metric("layerline_replays_total") == replays   # every stage kept its caches
    assert server.metric("layerline_stage_up", host="stage2", role="active") == 1.0
    assert re.search(r"stage stage2 \(active\) at tcp://127\.0\.0\.1:\d+ is down", server.log.read_text())


@pytest.fixture(scope="module")
def q8_gguf(ckpt, tmp_path_factory) -> Path:
    from helpers import tiny_gguf
    return tiny_gguf(ckpt, tmp_path_factory.mktemp("fo-gguf") / "m.gguf", qtype="Q8_0")


@pytest.mark.parametrize("dead", ["stage1", "stage0"])
def test_standby_takes_over(ckpt, q8_gguf, tmp_path, dead):
    """stage1: the predecessor's set_next moves to the standby; stage0: the server's pipeline does
    (this one on a GGUF file of Q8_0 blocks at its own bits)."""
    ckpt, precision = (q8_gguf, "gguf") if dead == "stage0" else (ckpt, "bf16")
    cluster = Cluster(ckpt, tmp_path, standby=dead, precision=precision)
    server = None
    try:
        server = Server(cluster, ckpt, tmp_path)
        assert server.metric("layerline_stage_up", host="standby", role="standby") == 1.0
        body = httpx.get(server.url + "/health", timeout=10).json()
        assert [s["name"] for s in body["standbys"]] == ["standby"] and body["standbys"][0]["ok"]
        reference = run_clients(server.url)
        from layerline.planner import Plan
        depth = Plan.from_dict(cluster.plan).depth
        assert server.metric("layerline_microbatches") == depth   # the plan's core groups
        st = cluster.status(dead)
        sup, pid = st["supervisor_pid"], st["worker_pid"]

        def kill():  # the worker and its supervisor: it cannot come back
            os.kill(sup, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        got = run_clients(server.url, kill)
        check_same(reference, got)
        report(f"SIGKILL {dead} + its supervisor, standby promoted", reference, got)
        assert server.metric("layerline_failovers_total", host=dead, action="promoted") == 1.0
        assert server.metric("layerline_stage_up", host="standby", role="active") == 1.0
        assert server.metric("layerline_stage_up", host=dead, role="standby") == 0.0
        body = httpx.get(server.url + "/health", timeout=10).json()
        assert [s["name"] for s in body["stages"]] == [("standby" if h == dead else h)
                                                       for h in ("stage0", "stage1", "stage2")]
        assert body["status"] == "ok"
        # the standby runs on the same machine as the stage it replaced: the same core groups
        assert server.metric("layerline_microbatches") == depth
        # and it keeps serving on the new route
        again = run_clients(server.url)
        check_same(reference, again)
    finally:
        if server is not None:
            server.stop()
        cluster.stop()


def test_no_standby_and_no_restart_in_time_is_503_then_recovers(plain, ckpt, tmp_path):
    """--restart-wait 1 and a stage stopped for 8 s: the streams end in a 503 error object before it is
    back (2 s to notice: two missed 1-s checks, 1 s to wait: 8 s leaves room for a busy machine), new requests get 503 at
    once, and once the stage answers again the server serves."""
    cluster, _, reference = plain
    server = Server(cluster, ckpt, tmp_path, "--restart-wait", "1", "--health-deadline", "1")
    try:
        pid = cluster.status("stage2")["worker_pid"]
        cont = threading.Event()

        def stop():
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(8.0, lambda: (os.kill(pid, signal.SIGCONT), cont.set())).start()
        t0 = time.perf_counter()
        # far more tokens than a stream gets before the slowest has 3 (a client that started first
        # finished all N_TOKENS before the stop on a fast machine), while the four still fit the
        # plan's KV context of 1024 at once (4 x 205 tokens), so none waits in the queue
        got = run_clients(server.url, stop, max_tokens=200)
        assert time.perf_counter() - t0 < 8.0, "the requests waited for the stage beyond --restart-wait"
        for r in got:
            assert r["status"] == 200 and r["error"] is not None and r["error"]["code"] == "stage_down", r
            assert "stage2" in r["error"]["message"] and "did not come back within 1 s" in r["error"]["message"]
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "stage_down", r.text
        assert server.metric("layerline_failovers_total", host="stage2", action="failed") == 1.0
        assert cont.wait(15)
        server.wait_all_up(30)
        deadline = time.time() + 10
        while time.time() < deadline:  # the monitor resumes the engine once stage2 answers
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
            if r.status_code == 200:
                break
            time.sleep(0.2)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == reference[0]["tokens"][:4]
    finally:
        server.stop()


def test_engine_fail_over_keeps_what_the_stages_confirmed(tmp_path):
    """No processes: a fail_over starts a new epoch (stamped on what is sent next), forgets the
    requests in flight (late answers dropped) and dispatches nothing while paused; on resume each
    running sequence is resent from what every stage confirmed (held), not from 0. A stage that lost
    one answers seq_unknown: it replays from 0, and a replay a failover caused never counts toward
    max_replays (here 0), however many failovers come; one without a failover does."""
    from layerline.driver import DriveError, Pipeline
    from layerline.engine import INFLIGHT, READY, Engine, Sequence
    from layerline.pipeline import Answer

    from layerline import keys
    kd = keys.local_keys(str(tmp_path / "keys"), ["stage0"])   # every pipeline socket runs CURVE
    with Pipeline("tcp://127.0.0.1:1", timeout_s=30, keys_dir=kd["controller"], first_key="stage0") as pipe:
        eng = Engine(pipe, stages=3, rows=True, max_replays=0)
        a, b = Sequence("a", [1, 2, 3], 8), Sequence("b", [4, 5], 8)
        for s in (a, b):
            eng.add(s)
        eng._admit()
        a.tokens += [9, 10]
        a.held = 4          # mid-decode: one sampled token not fed yet
        assert pipe.epoch == 0
        eng._dispatch()
        assert eng.inflight and pipe._pending
        rids = list(eng.inflight)
        assert eng.fail_over("stage1 down") == 1   # b's prompt was only in flight: nothing to replay
        assert pipe.epoch == eng.epoch == 1
        assert not eng.inflight and not any(r in pipe._pending for r in rids)
        assert all(s.state == READY for s in (a, b)) and (a.held, b.held) == (4, 0)
        eng._dispatch()
        assert not eng.inflight  # paused
        sent = []
        pipe.to_first.send_multipart = lambda frames, **kw: sent.append(wire.decode(frames)[0])
        eng.resume()
        eng._dispatch()
        assert [(h.get("seq"), h.get("pos"), h.get("rows"), h["epoch"]) for h in sent] == \
            [("b", 0, None, 1), (None, None, [["a", 4]], 1)]   # b's prompt from 0, a's step at 4
        # a stage lost `a`: it replays from 0, and the replay does not count toward max_replays
        eng._answer(Answer(sent[1]["id"], None, DriveError("gone", "seq_unknown", ["a"])))
        assert a.held == 0 and a.state == READY and a.replays == 0 and eng.replays == 1
        eng.fail_over("route switch")   # and again: a new epoch, its replays free as well
        eng.resume()
        sent.clear()
        eng._dispatch()
        assert [(h["seq"], h["pos"], h["epoch"]) for h in sent] == [("a", 0, 2), ("b", 0, 2)]
        for h in sent:
            eng._answer(Answer(h["id"], None, DriveError("gone", "seq_unknown", None)))
        assert a.replays == b.replays == 0 and eng.replays == 3 and b.state == READY
        b.state = INFLIGHT   # no failover explains this one: max_replays 0 fails it
        eng.inflight["late"] = ("seq", [b], [2])
        eng._answer(Answer("late", None, DriveError("gone", "seq_unknown", None)))
        assert b.finish == "error" and b.replays == 0
        events = []
        c = Sequence("c", [7], 4, sink=lambda k, v: events.append(k))
        eng.running["c"] = c
        eng.kv_used += c.reserve
        assert eng.unavailable("stage2 is down") == 2 and events == ["unavailable"] and not eng.running
