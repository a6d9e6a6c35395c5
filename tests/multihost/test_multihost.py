"""deploy.yml over ssh to real hosts: network namespaces on one machine, each with its own sshd.

scripts/testhosts.py makes three hosts (own hostname, own /tmp, own address on a private
bridge, own sshd with its own host key; host key checking on). deploy.yml runs against its
inventory as against any remote machines; the checks are that each worker runs inside its
host's namespace and binds that host's address, that activations cross from host to host,
that the drive matches a one-process forward, that a re-run changes nothing, that a drain under
load loses no request, and teardown. The checkpoint is not shared (layerline_checkpoint_shared false):
each host is staged its own layers in its private /tmp, in a stage dir of those layers; the drain
stages the re-planned hosts' new layers beside the stages their running workers opened, and once it
committed the old ones are gone.
Needs root (namespaces, a bridge); installs openssh-server with apt-get when sshd is missing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from layerline import version

from helpers import BIN, ROOT, ansible_env, playbook, recap, remove_testhosts
from helpers import run_testhosts as hostctl

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                                reason="test hosts need root and iproute2 (network namespaces, a bridge)")

PREFIX = "llt"
SUBNET = "10.77.0.0/24"
HOSTS = ("h1", "h2", "h3")


@pytest.fixture(scope="module")
def cluster():
    """Three hosts and a run of deploy.yml's inputs; everything is removed afterwards, also on failure."""
    # Not under /tmp: every host has its own /tmp, and the checkpoint and keys must be seen by all.
    work = Path(tempfile.mkdtemp(prefix="layerline-multihost-", dir="/var/tmp"))
    out = work / "hosts"
    extra, made = None, {"torn_down": False}
    try:
        t0 = time.perf_counter()
        r = hostctl("up", str(len(HOSTS)), "--prefix", PREFIX, "--subnet", SUBNET, "--out", str(out), "--json")
        assert r.returncode == 0, f"testhosts up failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        info = json.loads(r.stdout)
        print(f"\n[multihost] testhosts up {len(HOSTS)}: {time.perf_counter() - t0:.2f} s")
        from layerline.checkpoint import write_demo_checkpoint
        # stored fp32, as it runs: nothing to convert at load, and small (what crosses hosts is the point)
        ckpt = write_demo_checkpoint(work / "ckpt", layers=6, hidden=128, vocab=500, dtype="float32", seed=3)
        home = work / "home"
        home.mkdir()
        # layerline_policy uniform: every host holds layers (2 each), whatever the probes measure;
        # under auto the planner may validly leave a host out of a model this small.
        extra = json.dumps({"layerline_home": str(home), "layerline_checkpoint": str(ckpt),
                            "layerline_demo_checkpoint": False, "layerline_policy": "uniform",
                            # each host gets its own stage in its private /tmp (and the drain, new layers)
                            "layerline_checkpoint_shared": False, "layerline_serve_port": 29880,
                            "layerline_seq": 12, "layerline_generate": 4,
                            # fp32: a replayed prefix gives the very logits its steps gave (the drain below)
                            "layerline_precision": "fp32",
                            # the workers yield the CPU to the plays (and the other tests) beside them
                            "layerline_nice": 10})
        made = {"info": info, "inventory": info["inventory"], "home": home, "extra": ["-e", extra],
                "torn_down": False}
        yield made
    finally:
        # teardown.yml again only where the test's own teardown did not run to its end (a failure)
        remove_testhosts(out / "inventory.yml", None if extra is None or made["torn_down"] else extra,
                         PREFIX, out, work)


def host_root(info: dict, host: str) -> Path:
    """The host's own view of the filesystem (its private /tmp), through its sshd's /proc root."""
    pid = int((Path(info["out"]) / "hosts" / host / "sshd.pid").read_text().split()[0])
    return Path(f"/proc/{pid}/root")


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


def ansible(inventory: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    r = subprocess.run([str(BIN / "ansible"), "-i", inventory, "layerline", *args], cwd=ROOT, env=ansible_env(),
                       capture_output=True, text=True, timeout=300)
    return r, time.perf_counter() - t0


def test_hosts_answer_over_ssh_each_its_own(cluster):
    inv = cluster["inventory"]
    r, first = ansible(inv, "-m", "ansible.builtin.ping")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    r, again = ansible(inv, "-m", "ansible.builtin.ping")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    print(f"\n[multihost] ssh ping of {len(HOSTS)} hosts: {first:.2f} s, again (ControlPersist) {again:.2f} s")
    # own hostname, own /tmp: a file one host writes there the others do not see
    r, _ = ansible(inv, "-m", "ansible.builtin.shell", "-a", "hostname; echo {{ inventory_hostname }} > /tmp/whoami")
    assert r.returncode == 0, r.stdout[-3000:]
    for h in HOSTS:
        assert re.search(rf"^{h} \| CHANGED \| rc=0 >>\n{PREFIX}-{h}$", r.stdout, re.M), r.stdout
        assert (host_root(cluster["info"], h) / "tmp" / "whoami").read_text().strip() == h
    assert not Path("/tmp/whoami").exists() or Path("/tmp/whoami").read_text().strip() not in HOSTS


def _venv_without_layerline(work: Path, name: str, with_deps: bool) -> Path:
    """A venv (no pip of its own); with_deps: sees the controller venv's packages except layerline."""
    venv = work / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    if with_deps:
        import sysconfig
        shared = work / f"{name}-site"
        shared.mkdir()
        for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
            if not entry.name.startswith(("layerline", "__editable__")):
                (shared / entry.name).symlink_to(entry)
        site = next(venv.glob("lib/python3*/site-packages"))
        (site / "controller-packages.pth").write_text(f"{shared}\n")
    return venv / "bin" / "python"


def test_runtime_role_installs_layerline_where_missing(cluster):
    """An interpreter without layerline gets the controller's wheel; one without its dependencies
    stops with one line naming them; a re-run changes nothing."""
    inv, extra, work = cluster["inventory"], cluster["extra"], Path(cluster["info"]["out"]).parent
    bare = _venv_without_layerline(work, "venv-bare", with_deps=False)
    r = playbook("playbooks/runtime.yml", "-i", inv, "-l", "h1", *extra, "-e", f"layerline_runtime_python={bare}",
                 check=False)
    out = " ".join(r.stdout.split())
    m = re.search(r"lacks layerline's dependencies ([\w, -]+);", out)
    assert r.returncode != 0 and m, r.stdout[-3000:]
    assert set(m.group(1).split(", ")) >= {"torch", "pyzmq", "safetensors", "numpy", "psutil", "orjson"}, m.group(1)

    py = _venv_without_layerline(work, "venv-deps", with_deps=True)
    # that venv's own view: a checkout run with PYTHONPATH=runtime would lend it the controller's layerline
    own = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assert subprocess.run([str(py), "-c", "import layerline"], capture_output=True, env=own).returncode != 0
    r = playbook("playbooks/runtime.yml", "-i", inv, "-l", "h1", *extra, "-e", f"layerline_runtime_python={py}")
    assert recap(r.stdout)["h1"]["changed"] > 0
    where = subprocess.run([str(py), "-c", "import layerline; print(layerline.__file__)"], capture_output=True,
                           text=True, check=True, env=own).stdout.strip()
    assert where.startswith(str(py.parent.parent)), f"layerline imported from {where}, not the venv's own"
    r = playbook("playbooks/runtime.yml", "-i", inv, "-l", "h1", *extra, "-e", f"layerline_runtime_python={py}")
    assert recap(r.stdout)["h1"]["changed"] == 0, r.stdout[-3000:]

    # an upgrade reaches the host: its copy now differs from the controller's code (as after the controller's
    # checkout moved on), so its version (package version + content hash) differs and the role reinstalls
    installed = Path(where).parent / "errors.py"
    original = installed.read_text()
    installed.write_text(original + "# code the controller no longer runs\n")
    full = [str(py), "-c", "from layerline import version; print(version.full())"]
    assert subprocess.run(full, capture_output=True, text=True, check=True, env=own).stdout.strip() != version.full()
    r = playbook("playbooks/runtime.yml", "-i", inv, "-l", "h1", *extra, "-e", f"layerline_runtime_python={py}")
    assert recap(r.stdout)["h1"]["changed"] > 0, r.stdout[-3000:]
    assert installed.read_text() == original, "the reinstall did not replace the host's old code"
    assert subprocess.run(full, capture_output=True, text=True, check=True, env=own).stdout.strip() == version.full()


def test_deploy_across_hosts_idempotent_teardown(cluster):
    info, inv, home, extra = cluster["info"], cluster["inventory"], cluster["home"], cluster["extra"]
    t0 = time.perf_counter()
    first = playbook("deploy.yml", "-i", inv, *extra, timeout=900)
    first_s = time.perf_counter() - t0

    plan = json.loads((home / "plan.json").read_text())
    actives = [s for s in plan["stages"] if s["role"] == "active"]
    assert [s["host"] for s in actives] == list(HOSTS), "three workers, in inventory order"
    assert [s["layers"] for s in actives] == [[0, 2], [2, 4], [4, 6]], "policy uniform: two layers each"
    assert actives[0]["layers"][0] == 0 and actives[-1]["layers"][1] == plan["num_layers"] == 6
    addrs = {s["host"]: info["hosts"][s["host"]]["addr"] for s in actives}
    assert len(set(addrs.values())) == len(HOSTS), "each stage on its own address"
    for s in actives:
        assert s["endpoint"].startswith(f"tcp://{addrs[s['host']]}:"), s

    # the drive went through the hosts and matched the one-process forward
    drive = json.loads((home / "drive.json").read_text())
    assert drive["ok"] is True, drive
    assert [t["stage"] for t in drive["stages"]] == list(HOSTS), drive["stages"]
    out = " ".join(first.stdout.split())
    assert "matches" in out and "DOES NOT MATCH" not in out

    # each worker runs inside its host: its namespace, its address, its private state dir
    pids = {}
    for s in actives:
        h = s["host"]
        ready_path = host_root(info, h) / "tmp" / "layerline" / "state" / "ready.json"
        ready = json.loads(ready_path.read_text())
        assert ready["bind"] == s["endpoint"], ready
        assert ready["bind"].startswith(f"tcp://{addrs[h]}:"), ready
        assert ready["pid"] in netns_pids(f"{PREFIX}-{h}"), f"{h}'s worker is not in namespace {PREFIX}-{h}"
        assert ready["layers"] == s["layers"] and ready["precision"] == s["precision"] == "fp32"
        assert os.getpriority(os.PRIO_PROCESS, ready["pid"]) == 10, f"{h}: layerline_nice did not reach the worker"
        pids[h] = ready["pid"]
    assert not Path("/tmp/layerline/state/ready.json").exists() or \
        json.loads(Path("/tmp/layerline/state/ready.json").read_text())["pid"] not in pids.values()

    # activations crossed hosts: each stage's data port holds a connection from the stage before it
    for prev, cur in zip(actives, actives[1:]):
        port = int(cur["endpoint"].rsplit(":", 1)[1])
        peers = established(f"{PREFIX}-{cur['host']}", port)
        assert addrs[prev["host"]] in peers, f"{cur['host']}:{port} peers {peers}, expected {addrs[prev['host']]}"

    # on the namespace network, a client with a keypair this deployment does not know is refused by
    # every worker's data and control socket (ZAP: the handshake fails on the allow-list, nothing is
    # answered); the controller's key is let in on the same control socket
    strangers_refused(home, actives, pids)
    # a server bound off loopback (the controller's bridge address) answers a namespace host only
    # with an API key
    server_needs_a_key(info, home, cluster)

    # nothing changed: nothing restarts, the play reports no change
    t0 = time.perf_counter()
    second = playbook("deploy.yml", "-i", inv, *extra, timeout=900)
    again_s = time.perf_counter() - t0
    counts = recap(second.stdout)
    assert set(counts) == set(HOSTS)
    assert all(c["changed"] == 0 and c["failed"] == 0 for c in counts.values()), second.stdout[-3000:]
    for h, pid in pids.items():
        ready = json.loads((host_root(info, h) / "tmp" / "layerline" / "state" / "ready.json").read_text())
        assert ready["pid"] == pid, f"{h}: worker restarted on a re-run with nothing changed"
    print(f"\n[multihost] deploy.yml over ssh, 3 hosts: first {first_s:.1f} s, re-run {again_s:.1f} s")

    # deploy staged each host its own layers, where its worker loads them
    stages = {h: worker_stage(info, h) for h in HOSTS}
    assert {h: st[1] for h, st in stages.items()} == {s["host"]: s["layers"] for s in actives}, stages

    # a drain over ssh, under load: h2 drained, h1 and h3 re-planned in the other slot on their hosts;
    # every request equals the undisturbed run (tests/deploy/test_deployment.py runs the rest of the operations,
    # with the checkpoint not shared as here: a drain that cannot come up, which leaves every running worker's
    # stage as it was, rejoin, standby promotion, SIGSTOP, a dead host re-planned around, on the embedded inventory)
    drain_under_load(inv, home, extra, undisturbed(extra))
    slot1 = {h: json.loads((host_root(info, h) / "tmp" / "layerline" / "state.1" / "ready.json").read_text())["pid"]
             for h in ("h1", "h3")}
    # the drain re-planned h1 and h3 onto other layers and staged those before it started their workers;
    # once the route committed to them, the stages of the slot it left are gone (h2's with it)
    for s in json.loads((home / "plan.json").read_text())["stages"]:
        ready = json.loads((host_root(info, s["host"]) / "tmp" / "layerline" / "state.1" / "ready.json").read_text())
        assert ready["layers"] == s["layers"] == worker_stage(info, s["host"], slot=1)[1], (s, ready)
    assert not any(d.exists() for d, _, _ in stages.values()), "the old slot's stages were left"

    # teardown stops every worker, in every namespace and slot
    playbook("teardown.yml", "-i", inv, *extra, timeout=300)
    cluster["torn_down"] = True   # the fixture need not run it again
    for h, pid in [*pids.items(), *slot1.items()]:
        for state in ("state", "state.1"):
            assert not (host_root(info, h) / "tmp" / "layerline" / state / "ready.json").exists()
        assert pid not in netns_pids(f"{PREFIX}-{h}")
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def worker_stage(info: dict, host: str, slot: int = 0) -> tuple[Path, list[int], dict]:
    """The stage dir the host's worker in `slot` was started on (its argv's --checkpoint, seen through the
    host's root), the layers its manifest lists, and its files: name -> (inode, mtime_ns)."""
    from layerline.checkpoint import STAGE_MANIFEST
    root = host_root(info, host)
    argv = json.loads((root / "tmp" / "layerline" / ("state" if slot == 0 else f"state.{slot}") / "argv.json").read_text())
    d = root / argv[argv.index("--checkpoint") + 1].lstrip("/")
    files = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(d.iterdir())}
    return d, json.loads((d / STAGE_MANIFEST).read_text())["layers"], files


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


def server_needs_a_key(info: dict, home: Path, cluster: dict) -> None:
    addr, port = info["controller_addr"], 29885
    keys = home / "api_keys"
    keys.write_text("k-multihost-0123456789\n")
    keys.chmod(0o600)
    ready = home / "server2.json"
    extra = json.loads(cluster["extra"][1])
    p = subprocess.Popen([sys.executable, "-m", "layerline.cli", "serve", "--plan", str(home / "plan.json"),
                          "--checkpoint", extra["layerline_checkpoint"], "--host", addr, "--port", str(port),
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


# two clients of 16 tokens, each sending its next request as soon as one ends (as test_deployment's
# load): requests always running while the route switches; more only add steps beside the plays
PROMPTS = [[5 + i, 17, 3 + 2 * i, 99 - i] for i in range(2)]


def complete(extra: list[str], prompt: list[int]) -> list[int]:
    """One greedy completion of 16 tokens through the deployed server: its token ids."""
    import httpx
    url = f"http://127.0.0.1:{json.loads(extra[1])['layerline_serve_port']}/v1/completions"
    r = httpx.post(url, json={"model": "ckpt", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                              "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def undisturbed(extra: list[str]) -> list[list[int]]:
    """The undisturbed run: PROMPTS' completions, sent at once as the load sends them."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        return list(ex.map(lambda p: complete(extra, p), PROMPTS))


def drain_under_load(inv: str, home: Path, extra: list[str], reference: list[list[int]]) -> None:
    import threading
    results, stop = [], threading.Event()

    def client(i):
        while not stop.is_set():
            try:
                results.append((i, complete(extra, PROMPTS[i])))
            except Exception as e:  # noqa: BLE001 - reported below
                results.append((i, repr(e)))
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    try:
        r = playbook("drain.yml", "-i", inv, *extra, "-e", "layerline_drain=h2", timeout=900)
        assert "through h1, h3" in " ".join(r.stdout.split()), r.stdout[-3000:]
        assert [s["host"] for s in json.loads((home / "plan.json").read_text())["stages"]] == ["h1", "h3"]
        time.sleep(1.0)   # requests that start on the new route, too
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    bad = [(i, got) for i, got in results if got != reference[i]]
    assert results and not bad, f"{len(bad)} of {len(results)} requests failed or differ: {bad[:3]}"
    print(f"\n[multihost] {len(results)} requests through a drain over ssh: all equal")
