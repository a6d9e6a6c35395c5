"""One deployment over ssh to real hosts, as a user runs it, carrying ordered checks (each test goes on
from the state the one before left). The hosts are network namespaces on this machine, each with its own
sshd, hostname, address on a private bridge and /tmp (scripts/testhosts.py; host key checking on): h1,
h2 and h3 hold the model, h4 stands by for h3. deploy.yml's controller is SIGKILLed while the workers
start and the next deploy.yml converges; its plan, its staging, its drive and its server; each worker
in its host's namespace, binding its address, activations crossing from host to host, strangers'
keys refused by every socket, the server off loopback only with an API key; a re-run that changes
nothing; then, while clients keep streaming greedy completions through the deployed server, drain.yml,
a standby taking over a SIGKILLed worker, a SIGSTOPped worker waited for, a rejoin, a drain that
promotes the standby in place and the drain of a dead host, the two drains each first stopped partway
(SIGKILL before the switch, Ctrl-C as it starts) and resumed by the same command; drains refused with
one line; teardown.
What one host proves (the runtime role, a bf16 worker, a drive that fails) is test_one_host's.

layerline_checkpoint_shared is false, so the deploys and operations prove weight staging too: each
host gets only its own layers' tensors, once, in its private /tmp, in a stage dir of those layers, and
a staged file corrupted after shipping is shipped again; a drain that moves a host's layers stages
them beside the stage its running worker opened (a failed drain leaves that one as it was), and a
committed one removes the old.
The deployment runs fp32 (a replayed prefix, one batched prefill, gives the very logits its
token-by-token steps gave, so every request under load equals the undisturbed run).
Run the file whole: a test on its own lacks the state its predecessors leave (pytest -x stops at the
first failure, as later checks would only fail on its state). Needs root (namespaces, a bridge);
installs openssh-server with apt-get when sshd is missing."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from helpers import BIN, ROOT, Phases, ansible_env, playbook, recap, remove_testhosts, wait_for
from helpers import nshost_path, nshost_running, nshost_settings, nshost_sshd_pid, nshost_state_dir
from helpers import run_testhosts as hostctl
from drain_interrupts import AT_SWITCH, BEFORE_SWITCH, run_again_resumed, stop_partway

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                                reason="test hosts need root and iproute2 (network namespaces, a bridge)")

PREFIX = "llt"
SUBNET = "10.77.0.0/24"
HOSTS = ("h1", "h2", "h3", "h4")
PORT = 9100                      # every host's layerline_port (each has its own network stack)
SLOT1_PORT = PORT + 50           # the other slot's data port (layerline.settings.slot_port)
NICE = 3                         # the workers' layerline_nice
SERVE_PORT = 29880               # the server, on the controller's loopback
URL = f"http://127.0.0.1:{SERVE_PORT}"
# two clients of 16 tokens, each sending its next request Load.GAP after one ends: requests nearly
# always running while a route switches (those carried over must replay), short enough that the ones running
# when a load stops end soon; more clients or tokens only add steps the CPU must run beside the plays
N_TOKENS = 16
PROMPTS = [[5 + i, 17, 3 + 2 * i, 99 - i] for i in range(2)]
# set by the teardown test once teardown.yml stopped what the deploy started: the fixture need not run it again
TORN_DOWN = {"deploy": False}
# testhosts' facts (addresses, sshd pids), set by the fixture
INFO: dict = {}


def inside(host: str, path: str = "/") -> Path:
    """A path as the host names it, seen from here."""
    return nshost_path(INFO, host, path)


def settings(host: str):
    """The host's layerline settings, as the deploy reads them from the inventory."""
    return nshost_settings(INFO, host)


def state_dir(home: Path, host: str, slot: int = 0) -> Path:
    return nshost_state_dir(INFO, home, host, slot)


def netns_pids(ns: str) -> set[int]:
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=True)
    return {int(p) for p in r.stdout.split()}


def established(ns: str, port: int) -> set[str]:
    """Remote addresses with an established TCP connection to PORT inside namespace NS."""
    r = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Htn", "state", "established"],
                       capture_output=True, text=True, check=True)
    peers = set()
    for line in r.stdout.splitlines():
        cols = line.split()
        if len(cols) >= 4 and cols[-2].rsplit(":", 1)[1] == str(port):
            peers.add(cols[-1].rsplit(":", 1)[0])
    return peers


@pytest.fixture(scope="module")
def deployed():
    """The deployment every test here goes on with: (home, extra args, the deploy.yml run that
    converged, the undisturbed tokens of PROMPTS, the output of the run killed before it, the staged
    file corrupted between the two and its size)."""
    from layerline.checkpoint import write_demo_checkpoint
    # Not under /tmp: every host has its own /tmp
    work = Path(tempfile.mkdtemp(prefix="layerline-deployment-", dir="/var/tmp"))
    out = work / "hosts"
    extra = None
    try:
        t0 = time.perf_counter()
        r = hostctl("up", str(len(HOSTS)), "--prefix", PREFIX, "--subnet", SUBNET, "--out", str(out), "--json",
                    "--port", str(PORT))
        assert r.returncode == 0, f"testhosts up failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        INFO.update(json.loads(r.stdout))
        print(f"\n[phase] deployment: testhosts up {len(HOSTS)}: {time.perf_counter() - t0:.1f} s")
        home = work / "home"
        home.mkdir()
        # stored fp32, as it runs: nothing to convert at load, and small (what crosses hosts is the point)
        ckpt = write_demo_checkpoint(home / "ckpt", layers=6, hidden=128, vocab=500, dtype="float32", seed=7)
        # testhosts' inventory and h4, a standby for h3 (an inventory dir: ansible-playbook and Cluster read
        # it alike)
        inv = home / "inventory"
        inv.mkdir()
        shutil.copy(INFO["inventory"], inv / "hosts.yml")
        (inv / "standby.yml").write_text(json.dumps({"layerline": {"hosts": {"h4": {
            "layerline_role": "standby", "layerline_standby_for": "h3"}}}}))
        # a stage down for 10 s past its supervisor's restarts is re-planned around: the server runs drain.yml
        drain = (f"env ANSIBLE_CONFIG={ROOT / 'ansible.cfg'} {BIN / 'ansible-playbook'} {ROOT / 'drain.yml'} "
                 f"-i {inv} -e @{home / 'vars.json'} -e layerline_drain={{host}}")
        # layerline_policy uniform: all three workers hold layers (2 each) whatever the probes measure;
        # under auto the planner may validly leave a host out of a model this small
        ev = {"layerline_home": str(home), "layerline_checkpoint": str(ckpt), "layerline_demo_checkpoint": False,
              "layerline_policy": "uniform", "layerline_precision": "fp32", "layerline_serve_port": SERVE_PORT,
              "layerline_checkpoint_shared": False,
              "layerline_prompt": "",  # random ids: no tokenizer
              "layerline_seq": 8, "layerline_generate": 4, "layerline_sequences": 2,
              "layerline_sampling": {"temperature": 0.8, "top_p": 0.9},
              "layerline_serve_restart_wait": 10, "layerline_serve_on_stage_lost": drain,
              # niced workers on two cores shared with the load, the plays and another test file can take
              # over 2 s to answer a health check: a stage taken for dead there would be failed over
              "layerline_serve_health_deadline": 4,
              # the workers yield some CPU to the plays beside them (at nice 10 they starved behind three
              # test files and a busy loop, and this file became the suite's long pole)
              "layerline_nice": NICE}
        (home / "vars.json").write_text(json.dumps(ev))
        extra = ["-i", str(inv), "-e", json.dumps(ev)]
        # the first deploy.yml dies (SIGKILL, its whole process group) while the workers start, after
        # staging; then a staged file is corrupted after shipping; the next deploy.yml must converge
        killed = killed_while_workers_start(extra)
        corrupted = inside("h2", settings("h2").stage_dir_for((2, 4), 6)) / "model.safetensors"
        size = corrupted.stat().st_size
        with open(corrupted, "r+b") as f:
            f.seek(size // 2)
            f.write(b"\xff" * 64)
        first = playbook("deploy.yml", *extra, timeout=900)
        # the undisturbed run: the same requests at once, as the load sends them
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            reference = dict(enumerate(ex.map(complete, PROMPTS)))
        print(f"[phase] deployment: the undisturbed run: {time.perf_counter() - t0:.1f} s")
        assert all(len(t) == N_TOKENS for t in reference.values())
        yield home, extra, first, reference, killed, (corrupted, size)
    finally:
        # the teardown test tears the deploy down; after a failure, here (then the hosts go)
        if extra is not None and not TORN_DOWN["deploy"]:
            playbook("teardown.yml", *extra, check=False, timeout=300)
        remove_testhosts(out / "inventory.yml", None, PREFIX, out, work)


def killed_while_workers_start(extra: list[str]) -> str:
    """deploy.yml SIGKILLed (its process group: the controller and its forks) once it reaches the
    workers' start; its output until then."""
    p = subprocess.Popen([str(BIN / "ansible-playbook"), "deploy.yml", *extra], cwd=ROOT, env=ansible_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen, deadline = [], time.monotonic() + 300
    try:
        for line in p.stdout:
            seen.append(line)
            if "Start the worker" in line or time.monotonic() > deadline:
                break
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
    assert any("Start the worker" in line for line in seen), "".join(seen)[-3000:]
    return "".join(seen)


def _pids(home) -> dict:
    out = {}
    for h in (*HOSTS, "server"):
        ready = state_dir(home, h) / "ready.json"
        out[h] = json.loads(ready.read_text())["pid"] if ready.exists() else None
    return out


def test_hosts_answer_over_ssh_each_its_own(deployed):
    """Each host answers Ansible over ssh (key auth, its host key checked) with its own hostname and
    its own /tmp: a file one host writes there the others do not see."""
    inv = str(deployed[0] / "inventory")
    r = ansible(inv, "-m", "ansible.builtin.ping")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    r = ansible(inv, "-m", "ansible.builtin.shell", "-a", "hostname; echo {{ inventory_hostname }} > /tmp/whoami")
    assert r.returncode == 0, r.stdout[-3000:]
    for h in HOSTS:
        assert re.search(rf"^{h} \| CHANGED \| rc=0 >>\n{PREFIX}-{h}$", r.stdout, re.M), r.stdout
        assert inside(h, "/tmp/whoami").read_text().strip() == h
    assert not Path("/tmp/whoami").exists() or Path("/tmp/whoami").read_text().strip() not in HOSTS


def ansible(inventory: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ansible"), "-i", inventory, "layerline", *args], cwd=ROOT, env=ansible_env(),
                          capture_output=True, text=True, timeout=300)


def test_controller_killed_mid_deploy_then_run_again(deployed):
    """The controller died (SIGKILL) while the workers started; the next deploy.yml converged: the
    staged file corrupted after shipping (its SHA-1 differs) alone was shipped again, every worker
    serves the plan (test_deploy_plans_stages_drives_and_serves), the drive matches, and no
    half-written file is left in layerline_home."""
    home, _, first, _, _, (corrupted, size) = deployed
    out = " ".join(first.stdout.split())
    assert "matches" in out and "DOES NOT MATCH" not in out
    assert f"shipped {size} bytes to {len(HOSTS)} hosts" in out, out[-3000:]
    assert corrupted.read_bytes() == (home / "stages" / "h2" / "model.safetensors").read_bytes(), "repaired"
    left = [str(f) for f in home.rglob("*") if ".tmp" in f.name or f.name.startswith(".ansible_tmp")]
    assert not left, left


def test_deploy_plans_stages_drives_and_serves(deployed):
    home, extra, first, _, killed, _ = deployed
    plan = json.loads((home / "plan.json").read_text())
    actives_ = [s for s in plan["stages"] if s["role"] == "active"]
    assert [s["host"] for s in actives_] == ["h1", "h2", "h3"], "three workers, in inventory order"
    assert [s["layers"] for s in actives_] == [[0, 2], [2, 4], [4, 6]], "policy uniform: two layers each"
    assert actives_[0]["layers"][0] == 0 and actives_[-1]["layers"][1] == plan["num_layers"] == 6
    assert [(s["host"], s["layers"], s["standby_for"]) for s in plan["stages"] if s["role"] == "standby"] == \
        [("h4", [4, 6], "h3")], "h4 stands by with h3's layers"
    # the plan table and the drive report reach the user
    out = " ".join(first.stdout.split())  # the yaml callback folds long lines
    assert "pred/token" in out and "predicted token time" in out
    assert "max |logits - one-process forward|" in out and "matches" in out
    assert "DOES NOT MATCH" not in out
    # the drive also generated for two sequences together and saved what it did
    drive = json.loads((home / "drive.json").read_text())
    assert "for 2 sequence(s)" in out and len(drive["generate"]["new_tokens"]) == 2
    assert all(len(t) == 4 for t in drive["generate"]["new_tokens"]) and drive["generate"]["tokens_per_s"] > 0
    # the first run (killed later, while the workers started) staged every host's own layers
    staged_only_own_layers(home, plan, " ".join(killed.split()))
    # every worker (the standby too) runs inside its host (its namespace, binding its address) with the
    # plan's precision and layers, niced as asked
    addrs = {h: INFO["hosts"][h]["addr"] for h in HOSTS}
    assert len(set(addrs.values())) == len(HOSTS), "each host on its own address"
    pids = {}
    for s in plan["stages"]:
        h = s["host"]
        ready_ = json.loads((state_dir(home, h) / "ready.json").read_text())
        assert ready_["precision"] == s["precision"] == plan["precision"] == "fp32"
        assert ready_["layers"] == s["layers"]
        assert s["endpoint"] == ready_["bind"] == f"tcp://{addrs[h]}:{PORT}", (s, ready_)
        assert ready_["pid"] in netns_pids(f"{PREFIX}-{h}"), f"{h}'s worker is not in namespace {PREFIX}-{h}"
        assert os.getpriority(os.PRIO_PROCESS, ready_["pid"]) == NICE, f"{h}: layerline_nice did not reach it"
        argv = json.loads((state_dir(home, h) / "argv.json").read_text())
        assert argv[argv.index("--precision") + 1] == plan["precision"]
        pids[h] = ready_["pid"]
    # activations crossed hosts: each stage's data port holds a connection from the stage before it
    for prev, cur in zip(actives_, actives_[1:]):
        peers = established(f"{PREFIX}-{cur['host']}", PORT)
        assert addrs[prev["host"]] in peers, f"{cur['host']}:{PORT} peers {peers}, expected {addrs[prev['host']]}"
    # on the namespace network, a client with a keypair this deployment does not know is refused by
    # every worker's data and control socket (ZAP: the handshake fails on the allow-list, nothing is
    # answered); the controller's key is let in on the same control socket
    strangers_refused(home, plan["stages"], pids)
    # a server bound off loopback (the controller's bridge address) answers a namespace host only with
    # an API key
    server_needs_a_key(home, extra)
    # the deployed server answers the official OpenAI client with the one-process greedy tokens
    from openai import OpenAI
    import torch
    from layerline.model.loader import load_stage
    assert f"serving at {URL}/v1" in out and f"curl -s {URL}/v1/completions" in out
    client = OpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0, timeout=60)
    [model] = [m.id for m in client.models.list().data]
    got = client.completions.create(model=model, prompt=[5, 17, 3, 99], max_tokens=4, temperature=0)
    ids = torch.tensor([[5, 17, 3, 99]])
    full = load_stage(str(home / "ckpt"), 0, 6, True, True, precision=plan["precision"])
    with torch.no_grad():
        for _ in range(4):
            ids = torch.cat([ids, full(ids)[:, -1:].argmax(-1)], dim=1)
    assert got.choices[0].token_ids == ids[0, 4:].tolist() and got.usage.completion_tokens == 4


def test_a_rerun_changes_nothing(deployed):
    """Nothing changed: nothing restarts (workers, the standby nor the server), nothing is shipped
    again, the play reports no change."""
    home, extra, *_ = deployed
    pids = _pids(home)
    assert all(pids.values()), pids
    second = playbook("deploy.yml", *extra)
    counts = recap(second.stdout)
    assert set(counts) == set(HOSTS)
    assert all(c["changed"] == 0 and c["failed"] == 0 for c in counts.values()), second.stdout[-3000:]
    assert f"shipped 0 bytes to {len(HOSTS)} hosts" in " ".join(second.stdout.split()), "staged once"
    assert _pids(home) == pids


def strangers_refused(home: Path, actives: list[dict], pids: dict) -> None:
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from layerline import keys, wire
    from layerline.pipeline import control
    ctl_keys = str(home / "keys" / "controller")
    ctx = zmq.Context()
    socks = []
    try:
        for st in actives:
            addr, port = st["endpoint"].rsplit(":", 1)
            ctl = f"{addr}:{int(port) + 1}"
            assert control(ctl, "health", keys_dir=ctl_keys, peer=st["host"])["pid"] == pids[st["host"]]
            server = keys.load_host_keys(ctl_keys).server_key(st["host"], "peer")
            for ep, op in ((st["endpoint"], "forward"), (ctl, "shutdown")):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                pub, sec = zmq.curve_keypair()
                keys.connect_curve(s, keys.HostKeys(dir="-", public=pub, secret=sec), server)
                mon = s.get_monitor_socket()
                s.connect(ep)
                s.send_multipart(wire.encode({"op": op}), flags=zmq.NOBLOCK)
                socks.append((ep, s, mon, set()))
        deadline = time.time() + 3.0
        while time.time() < deadline:
            for ep, s, mon, events in socks:
                assert not s.poll(0), f"a stranger got an answer from {ep}"
                while mon.poll(0):
                    events.add(recv_monitor_message(mon)["event"])
            time.sleep(0.05)
        for ep, _, _, events in socks:
            assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in events and zmq.EVENT_HANDSHAKE_SUCCEEDED not in events, \
                (ep, events)
    finally:
        for _, s, mon, _ in socks:
            s.disable_monitor()
            mon.close(0)
            s.close(0)
        ctx.term()
    for st in actives:   # no effect: each worker still runs as before
        addr, port = st["endpoint"].rsplit(":", 1)
        assert control(f"{addr}:{int(port) + 1}", "health", keys_dir=ctl_keys,
                       peer=st["host"])["pid"] == pids[st["host"]]


def server_needs_a_key(home: Path, extra: list[str]) -> None:
    addr, port = INFO["controller_addr"], SERVE_PORT + 5
    keys = home / "api_keys"
    keys.write_text("k-multihost-0123456789\n")
    keys.chmod(0o600)
    ready = home / "server2.json"
    ev = json.loads(extra[3])
    p = subprocess.Popen([sys.executable, "-m", "layerline.cli", "serve", "--plan", str(home / "plan.json"),
                          "--checkpoint", ev["layerline_checkpoint"], "--host", addr, "--port", str(port),
                          "--keys", str(home / "keys" / "controller"), "--api-keys", str(keys),
                          "--ready-file", str(ready)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while not ready.exists():
            assert p.poll() is None and time.time() < deadline, p.stdout.read() if p.poll() is not None else "no ready file"
            time.sleep(0.2)
        probe = ("import httpx, sys; u = sys.argv[1]; h = {'Authorization': 'Bearer ' + sys.argv[2]};"
                 "print(httpx.get(u).status_code, httpx.get(u, headers=h).status_code)")
        r = subprocess.run(["ip", "netns", "exec", f"{PREFIX}-h1", sys.executable, "-c", probe,
                            f"http://{addr}:{port}/v1/models", keys.read_text().strip()],
                           capture_output=True, text=True, timeout=60)
        assert r.stdout.split() == ["401", "200"], r.stdout + r.stderr
    finally:
        p.terminate()
        p.wait(30)


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
    """A client for each of PROMPTS, each streaming its prompt again and again until stopped, GAP seconds
    apart: without the gap they sent as many requests as the machine could answer while a playbook ran
    (twice as many, CPU the suite needs elsewhere: docs/testing.md). Each client is still in a request
    most of the time (one takes about 0.9 s quiet)."""
    GAP = 0.3

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
            self.stop.wait(self.GAP)

    def __enter__(self):
        for t in self.threads:
            t.start()
        time.sleep(1.0)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        t0 = time.perf_counter()
        for t in self.threads:
            t.join(150)
        print(f"[load] {len(self.results)} requests; the last ones ended {time.perf_counter() - t0:.1f} s after the stop")

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
    f = state_dir(home, host, slot) / "ready.json"
    return json.loads(f.read_text()) if f.exists() else None


def running(home) -> dict[str, int]:
    return nshost_running(INFO, home, HOSTS)


def port_taken(host: str, port: int):
    """A context: a listener on the host's address and PORT inside its namespace, so nothing else binds it."""
    import contextlib

    @contextlib.contextmanager
    def held():
        code = ("import socket, sys, time; s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen();"
                "print('bound', flush=True); time.sleep(900)")
        p = subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}-{host}", sys.executable, "-c", code,
                              INFO["hosts"][host]["addr"], str(port)], stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "bound", f"could not take {host}:{port}"
            yield
        finally:
            p.kill()
            p.wait(30)
    return held()


def supervisor_pid(home, host: str, slot: int = 0) -> int:
    return json.loads((state_dir(home, host, slot) / "supervisor.json").read_text())["pid"]


def opened_stage(home, host: str, slot: int = 0) -> tuple[str, list[int], dict]:
    """The stage dir the host's worker in `slot` was started on (its argv's --checkpoint), the layers its
    manifest lists, and its files: name -> (inode, mtime_ns)."""
    from layerline.checkpoint import STAGE_MANIFEST
    argv = json.loads((state_dir(home, host, slot) / "argv.json").read_text())
    d = inside(host, argv[argv.index("--checkpoint") + 1])
    files = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(d.iterdir())}
    return str(d), json.loads((d / STAGE_MANIFEST).read_text())["layers"], files


def test_drain_and_rejoin_under_load_lose_nothing(deployed):
    home, extra, _, reference, *_ = deployed
    extravars = json.loads(extra[3])
    phase = Phases("drain")
    before = actives(home)
    assert [h for h, _, _ in before] == ["h1", "h2", "h3"]
    assert ready(home, "h4"), "the standby runs"
    stages = {h: opened_stage(home, h) for h in ("h1", "h2", "h3", "h4")}
    assert {os.getpriority(os.PRIO_PROCESS, ready(home, h)["pid"]) for h in ("h1", "h2", "h3", "h4")} == {NICE}

    # a drain whose new route cannot come up (h1's new port is taken, in h1's namespace) changes nothing
    with port_taken("h1", SLOT1_PORT):
        r = playbook("drain.yml", *extra, "-e", "layerline_drain=h2", "-e", "layerline_worker_ready_timeout=3",
                     check=False)
    assert r.returncode != 0
    out = " ".join(r.stdout.split())
    assert "drain of h2 failed" in out and "restored: the server routes through the old plan" in out, out[-3000:]
    assert actives(home) == before
    assert json.loads((home / "route.json").read_text()) == {"slot": 0, "drained": []}
    assert not any(ready(home, h, 1) for h in ("h1", "h2", "h3", "h4"))
    # it had staged h1, h3 and h4 their new layers: beside the stages their running workers opened, which
    # are as they were (a worker of the old slot that restarts loads what it ran)
    assert {h: opened_stage(home, h) for h in stages} == stages
    assert complete(PROMPTS[0]) == reference[0]
    phase("a drain that cannot come up")

    # drain h2 under load (no standby for it): h1 and h3 hold the model, on the other slot's ports,
    # and h4 mirrors h3's new layers there
    # the controller SIGKILLed as the new slot's workers start: route.json keeps the drain pending, and the
    # drain under load below is the same command run again, which resumes it (issue 37 item 6)
    stop_partway(home, ["drain.yml", *extra, "-e", "layerline_drain=h2"], ["h2"], BEFORE_SWITCH, signal.SIGKILL)
    phase("h2's drain SIGKILLed as its workers start")
    replays = metric("layerline_replays_total")
    with Load() as load:
        r = playbook("drain.yml", *extra, "-e", "layerline_drain=h2")
    run_again_resumed(r.stdout)
    out = " ".join(r.stdout.split())
    # the epoch counts every route change, a failover a loaded machine may cause included: the
    # outcome is the route through h1 and h3
    assert re.search(r"route epoch \d+ through h1, h3", out) and "matches the one-process forward" in out, \
        out[-3000:]
    after = actives(home)
    assert [h for h, _, _ in after] == ["h1", "h3"] and after[0][1][0] == 0 and after[-1][1][1] == 6
    assert all(e == f"tcp://{INFO['hosts'][h]['addr']}:{SLOT1_PORT}" for h, _, e in after), after
    assert json.loads((home / "route.json").read_text()) == {"slot": 1, "drained": ["h2"]}
    assert not any(ready(home, h) for h in ("h1", "h2", "h3", "h4")), "old slot stopped"
    # each worker of the new slot opened the stage of its new layers; the old slot's stages are gone
    assert [opened_stage(home, h, 1)[1] for h, _, _ in after] == [ls for _, ls, _ in after]
    assert not any(Path(d).exists() for d, _, _ in stages.values()), "the old slot's stages were left"
    n = load.check(reference)
    # the sequences the switch carried over (running at that moment: on a busy machine both clients may
    # be between requests) replay on the new stages, which lack them
    carried = re.findall(r"route switch: epoch \d+ over h1, h3; (\d+) running sequences carried over",
                         (home / "state" / "server" / "requests.log").read_text())
    assert carried, "the server did not log the switch"
    if int(carried[-1]):
        assert metric("layerline_replays_total") > replays, "sequences carried over a switch must replay"
    phase("drain h2 under load")

    # under load, h3's worker is SIGKILLed while its supervisor is held (so it is not back before the
    # monitor looks): the standby h4 is promoted; then h1's worker stops answering for 12 s (SIGSTOP,
    # no standby): the server waits for it. Only what h4 lacks is replayed (the stall replays
    # nothing); nothing is lost.
    promoted = metric("layerline_failovers_total")
    with Load() as load:
        sup = supervisor_pid(home, "h3", 1)
        os.kill(sup, signal.SIGSTOP)
        try:
            os.kill(ready(home, "h3", 1)["pid"], signal.SIGKILL)
            wait_for(lambda: 'action="promoted",host="h3"' in httpx.get(URL + "/metrics", timeout=10).text,
                     timeout=60, what="the server to promote h4 for h3")
        finally:
            os.kill(sup, signal.SIGCONT)
        time.sleep(1.0)
    n += load.check(reference)
    health = httpx.get(URL + "/health", timeout=10).json()
    assert [s["name"] for s in health["stages"]] == ["h1", "h4"], health
    phase("h4 promoted for a SIGKILLed h3")
    replays = metric("layerline_replays_total")
    with Load() as load:
        pid = ready(home, "h1", 1)["pid"]
        os.kill(pid, signal.SIGSTOP)
        # past two 4 s health deadlines in a row (layerline_serve_health_deadline, --health-misses 2):
        # the server takes h1 for down and waits for it
        time.sleep(12)
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: httpx.get(URL + "/health", timeout=10).status_code == 200 and
                 metric("layerline_failovers_total") >= promoted + 2, timeout=60,
                 what="the server to wait for h1 and answer again")
        time.sleep(1.0)
    n += load.check(reference)
    assert metric("layerline_replays_total") == replays, "h1 kept its caches: the stall replays nothing"
    phase("h1 SIGSTOPped and waited for")

    # h2 rejoins under load, from Python (the same plays as deploy.yml -e layerline_rejoin=h2):
    # back to three hosts and the standby, on slot 0
    from layerline import Cluster
    with Load() as load, Cluster.from_path(home / "inventory", extravars=extravars, quiet=True) as c:
        plan = c.rejoin("h2")
    assert [s["host"] for s in plan["stages"] if s["role"] == "active"] == ["h1", "h2", "h3"]
    assert actives(home) == before
    assert json.loads((home / "route.json").read_text()) == {"slot": 0, "drained": []}
    assert not any(ready(home, h, 1) for h in ("h1", "h2", "h3", "h4"))
    n += load.check(reference)
    phase("h2 rejoined")

    # drain h3 under load: its standby takes its place where it runs (slot 0, no worker starts), h2
    # now hands its output to h4, and h3's worker stops
    # first a Ctrl-C as the server's switch starts (it may or may not have switched): pending again, and the
    # run under load below resumes it
    h4 = ready(home, "h4")["pid"]
    stop_partway(home, ["drain.yml", *extra, "-e", "layerline_drain=h3"], ["h3"], AT_SWITCH, signal.SIGINT)
    phase("h3's drain stopped by a Ctrl-C as the switch starts")
    with Load() as load:
        r = playbook("drain.yml", *extra, "-e", "layerline_drain=h3")
    run_again_resumed(r.stdout)
    out = " ".join(r.stdout.split())
    assert ("through h1, h2, h4" in out or "route unchanged" in out) and "matches the one-process forward" in out, \
        out[-3000:]
    assert [(h, ls) for h, ls, _ in actives(home)] == [(h if h != "h3" else "h4", ls) for h, ls, _ in before]
    assert json.loads((home / "route.json").read_text()) == {"slot": 0, "drained": ["h3"], "promoted": {"h4": "h3"}}
    assert ready(home, "h4")["pid"] == h4 and not ready(home, "h3") and not ready(home, "h4", 1)
    n += load.check(reference)
    phase("h3 drained, h4 in its place")

    # h1 dies for good (its supervisor stopped too): the server marks it down, waits 10 s for a restart
    # that does not come, and runs its --on-stage-lost command: drain.yml for h1, which takes it out
    # although it does not answer (the gate lets down only the hosts being drained); h4 keeps h3's
    # place in the new plan
    # (on h1: in its mount namespace, where its state dir is)
    r = subprocess.run(["nsenter", "-t", str(nshost_sshd_pid(INFO, "h1")), "-m", "--", sys.executable, "-m",
                        "layerline.supervise",
                        "stop", "--state-dir", settings("h1").state_dir_in(0)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    log_file = home / "state" / "server" / "on-stage-lost-h1.log"
    wait_for(lambda: log_file.exists() and "PLAY RECAP" in log_file.read_text(), timeout=240,
             what=f"the server's drain of h1 to end ({log_file})")
    log = log_file.read_text()
    assert httpx.get(URL + "/health", timeout=10).status_code == 200
    assert "through h2, h4" in " ".join(log.split()), log[-3000:]
    assert [h for h, _, _ in actives(home)] == ["h2", "h4"]
    assert json.loads((home / "route.json").read_text()) == {"slot": 1, "drained": ["h3", "h1"],
                                                             "promoted": {"h4": "h3"}}
    assert all(complete(p) == reference[i] for i, p in enumerate(PROMPTS[:2]))
    phase("dead h1 re-planned around by the server")
    print(f"\n{n} requests of {N_TOKENS} tokens through a drain, a standby promoted for a SIGKILLed worker, a "
          "SIGSTOP, a rejoin, a drain that promoted the standby in place: all 200, all equal to the undisturbed tokens; "
          "a dead host re-planned around by the server")


def test_bad_drains_are_one_line_and_touch_nothing(deployed):
    home, extra, *_ = deployed
    plan = (home / "plan.json").read_text()
    for arg, says in (("layerline_drain=w9", "layerline_drain: w9 is not a host of group layerline"),
                      ("layerline_drain=h2,h4", "would leave no host to serve"),
                      ("layerline_drain=", "layerline_drain: name the host(s) to take out")):
        r = playbook("drain.yml", *extra, "-e", arg, check=False)
        assert r.returncode != 0 and says in " ".join(r.stdout.split()), r.stdout[-2000:]
        assert "Traceback" not in r.stdout + r.stderr
    r = playbook("deploy.yml", *extra, "-e", "layerline_rejoin=h2", check=False)
    assert r.returncode != 0 and "h2 is not drained" in " ".join(r.stdout.split())
    assert (home / "plan.json").read_text() == plan


def staged_only_own_layers(home, plan: dict, out: str) -> None:
    """Each host holds only its own layers' tensors (the first the embedding, the last the head),
    its worker loads them, and the run reports the bytes shipped against the whole model."""
    from layerline.checkpoint import STAGE_MANIFEST, read_index
    # probed before staging, each host timed the disk its stage lands on (not "not measured")
    assert all(s["disk_read_bytes_per_s"] for s in plan["stages"]), plan["stages"]
    shipped = 0
    for s in plan["stages"]:
        staged_at = settings(s["host"]).stage_dir_for(s["layers"], plan["num_layers"])
        staged = inside(s["host"], staged_at)
        idx = read_index(staged, check=False)  # one stage's tensors, not a whole model
        assert {t.layer for t in idx.tensors.values() if t.layer is not None} == set(range(*s["layers"]))
        assert ("model.embed_tokens.weight" in idx.tensors) == (s["layers"][0] == 0)
        assert ("lm_head.weight" in idx.tensors) == (s["layers"][1] == plan["num_layers"])
        argv = json.loads((state_dir(home, s["host"]) / "argv.json").read_text())
        assert argv[argv.index("--checkpoint") + 1] == staged_at
        # the stage's manifest is written on the host, not shipped
        shipped += sum(p.stat().st_size for p in staged.iterdir() if p.name != STAGE_MANIFEST)
    total = read_index(home / "ckpt").total_bytes
    assert f"shipped {shipped} bytes to {len(plan['stages'])} hosts; the whole model is {total} bytes" in out


def test_teardown_stops_every_worker_and_the_server(deployed):
    """After all the above (two slots used, a host dead, a standby promoted): every worker and the
    server stop, and no ready file is left."""
    home, extra, *_ = deployed
    pids = running(home)
    assert "server" in pids and len(pids) > 2, pids
    playbook("teardown.yml", *extra)
    TORN_DOWN["deploy"] = True
    assert not running(home)
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
