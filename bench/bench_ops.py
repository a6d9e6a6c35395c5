"""Operations under load, timed: a drain, a rejoin, a failover with a standby and one without.

    .venv/bin/python bench/bench_ops.py [--keep] [--normal-s 10]

Deploys a 6-layer random-init model (hidden 256, fp32) with the repo's playbooks over an
inventory of its own (four local hosts: w1-w3 active, w4 standby for w3; ports 29200-29291),
keeps eight clients streaming 48 greedy tokens each in a loop through the deployed server, and
records the arrival time of every token. Then, one after the other:

  normal    a quiet period: the normal inter-token time (median and p99 of all gaps)
  drain     ansible-playbook drain.yml -e layerline_drain=w2
  rejoin    ansible-playbook deploy.yml -e layerline_rejoin=w2
  standby   SIGKILL w3's worker; the standby w4 is promoted (w3's supervisor restarts it too)
  restart   SIGKILL w1's worker, which has no standby; its supervisor restarts it
  stall     SIGSTOP w1's worker for 5 s (no standby): the server waits for it, its caches survive

For each operation the table gives its wall time (the playbook's, or for a kill: until every
stream that was running had its next token), the longest inter-token gap of any stream while it
ran as a ratio to the normal median gap of the same run, the sequences replayed (a stage lacked
their cache: layerline_replays_total) and the requests it overlapped:
completed with the undisturbed tokens, failed (not 200, an error object, an exception or a
truncated stream) and completed with other tokens. Every stream is checked against a reference
made before the load starts, one request at a time. teardown.yml runs at the end, also on failure.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "runtime"))

PORT_BASE = 29200          # clear of the demo (29100), tests (29300-29600), molecule (29600, 29780), bench_predicted (29800)
SERVE_PORT = PORT_BASE + 90
URL = f"http://127.0.0.1:{SERVE_PORT}"
HOSTS = ("w1", "w2", "w3", "w4")
N_CLIENTS = 8
N_TOKENS = 48
PROMPTS = [[5 + i, 17, 3 + 2 * i, 99 - i] for i in range(N_CLIENTS)]
PLAYBOOK_TIMEOUT = 300     # s, each playbook run
TOTAL_BUDGET = 540         # s, after which the remaining operations are skipped (teardown still runs)
MAX_REQUESTS_PER_CLIENT = 2000
CLOCK0 = time.time() - time.perf_counter()


def log(msg: str) -> None:
    print(f"[ops {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the deployment ---------------------------------------------------------------------------------

def write_inventory(home: Path, ckpt: Path) -> Path:
    import yaml
    hosts = {}
    for i, h in enumerate(HOSTS):
        v = {"layerline_port": PORT_BASE + 10 * i, "layerline_state_dir": str(home / "state" / h)}
        if h == "w4":
            v.update(layerline_role="standby", layerline_standby_for="w3")
        hosts[h] = v
    # group_vars/all.yml of the repo's inventory is not read with -i elsewhere: everything it sets is here
    inv = {"layerline": {"hosts": hosts, "vars": {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "layerline_port_base": PORT_BASE,
        "layerline_home": str(home),
        "layerline_checkpoint": str(ckpt),
        "layerline_checkpoint_shared": True,
        "layerline_demo_checkpoint": False,
        "layerline_seq": 8,
        "layerline_generate": 4,
        "layerline_prompt": "",           # random ids: the demo checkpoint has no tokenizer
        "layerline_drive_reference": True,
        "layerline_rng_seed": 0,
        "layerline_probe_serial": True,
        "layerline_reserve_ram_gb": 1,
        "layerline_policy": "uniform",
        "layerline_precision": "fp32",    # a replayed prefix gives the very logits its steps gave
        "layerline_threads": 1,
        "layerline_objective": {"optimize": "throughput", "context": 1024},
    }}}
    path = home / "inventory.yml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def ansible_env() -> dict:
    env = dict(os.environ)
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_FORCE_COLOR="0", ANSIBLE_NOCOLOR="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", PYTHONUNBUFFERED="1")
    return env


class PlaybookError(RuntimeError):
    pass


def playbook(name: str, inv: Path, logdir: Path, *extra: str, check: bool = True) -> tuple[float, str, object]:
    """Run one of the repo's playbooks over our inventory; (wall seconds, stdout, exit status). Output kept in logdir."""
    cmd = [str(Path(sys.executable).parent / "ansible-playbook"), str(ROOT / name), "-i", str(inv), *extra]
    tag = "-".join([Path(name).stem] + [e.split("=")[-1] for e in extra if "=" in e])
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=ansible_env(), capture_output=True, text=True,
                           timeout=PLAYBOOK_TIMEOUT, stdin=subprocess.DEVNULL)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc, err = "timeout", ""
    wall = time.perf_counter() - t0
    n = len(list(logdir.glob("*.log")))
    (logdir / f"{n:02d}-{tag}.log").write_text(f"$ {' '.join(cmd)}\nrc={rc} wall={wall:.1f}s\n{out}\n--- stderr\n{err}")
    if check and rc != 0:
        raise PlaybookError(f"{name} {' '.join(extra)} exited {rc} after {wall:.0f} s; "
                            f"log {logdir}/{n:02d}-{tag}.log\n{out[-4000:]}\n{err[-1500:]}")
    return wall, out, rc


def ports_taken() -> list[int]:
    taken = []
    for p in list(range(PORT_BASE, PORT_BASE + 82)) + [SERVE_PORT]:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                taken.append(p)
    return taken


def route(home: Path) -> dict:
    try:
        return json.loads((home / "route.json").read_text())
    except (OSError, ValueError):
        return {}


def worker_pid(home: Path, host: str) -> tuple[int | None, str]:
    """The live worker pid of host in the route's current slot (supervisor status), and its state dir."""
    slot = int(route(home).get("slot", 0))
    d = str(home / "state" / host) + ("" if slot == 0 else f".{slot}")
    r = subprocess.run([sys.executable, "-m", "layerline.supervise", "status", "--state-dir", d],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    try:
        st = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        st = {}
    pid = st.get("worker_pid")
    if not pid:  # the ready file's pid, as a second source
        try:
            pid = json.loads(Path(d, "ready.json").read_text()).get("pid")
        except (OSError, ValueError):
            pid = None
    return pid, d


# --- the server -------------------------------------------------------------------------------------

def metrics_text() -> str:
    import httpx
    return httpx.get(URL + "/metrics", timeout=10).text


def metric(name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include `labels` (0.0 when none)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", metrics_text(), re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def stages_up() -> dict[str, tuple[str, float]]:
    out = {}
    for m in re.finditer(r"^layerline_stage_up\{([^}]*)\} (\S+)$", metrics_text(), re.M):
        lab = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[lab.get("host", "?")] = (lab.get("role", "?"), float(m.group(2)))
    return out


def wait_healthy(timeout: float) -> float | None:
    """Seconds until /health is 200 and every watched stage (standbys too) is up; None on timeout."""
    import httpx
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            if httpx.get(URL + "/health", timeout=5).status_code == 200:
                ups = stages_up()
                if ups and all(v == 1.0 for _, v in ups.values()):
                    return time.perf_counter() - t0
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.2)
    return None


def model_name() -> str:
    import httpx
    return httpx.get(URL + "/v1/models", timeout=10).json()["data"][0]["id"]


def stream(model: str, prompt: list[int], on_token=None) -> dict:
    """One streamed greedy completion: status, token ids and the time each arrived, error if any."""
    import httpx
    body = {"model": model, "prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    out = {"t_start": time.perf_counter(), "t_end": None, "status": None, "tokens": [], "times": [],
           "error": None, "finish": None}
    try:
        with httpx.stream("POST", URL + "/v1/completions", json=body, timeout=httpx.Timeout(60, connect=5)) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = r.read().decode(errors="replace")[:300]
            else:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if "error" in d:
                        out["error"] = d["error"]
                        continue
                    c = d["choices"][0]
                    now = time.perf_counter()
                    for t in c.get("token_ids") or []:
                        out["tokens"].append(t)
                        out["times"].append(now)
                    if on_token is not None and c.get("token_ids"):
                        on_token(now)
                    out["finish"] = c.get("finish_reason") or out["finish"]
    except Exception as e:  # noqa: BLE001 - counted as a failure in the table
        out["error"] = repr(e)
    out["t_end"] = time.perf_counter()
    return out


class Load:
    """N_CLIENTS clients, each streaming its prompt again and again until stopped (bounded in count)."""

    def __init__(self, model: str):
        self.model = model
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.requests: list[tuple[int, dict]] = []
        self.last_token = [0.0] * N_CLIENTS
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(N_CLIENTS)]

    def _client(self, i: int) -> None:
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            if self.stop.is_set():
                return
            r = stream(self.model, PROMPTS[i], lambda now, i=i: self._tick(i, now))
            with self.lock:
                self.requests.append((i, r))
            if r["error"] is not None and r["status"] != 200:
                time.sleep(0.2)  # a refused request: do not spin

    def _tick(self, i: int, now: float) -> None:
        self.last_token[i] = now

    def start(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)

    def all_ticked_after(self, t: float) -> bool:
        return all(x > t for x in self.last_token)


# --- analysis ---------------------------------------------------------------------------------------

def gaps_in(reqs: list[dict], t0: float, t1: float) -> list[float]:
    """Inter-token gaps (within one request) with both tokens inside [t0, t1]."""
    out = []
    for r in reqs:
        ts = r["times"]
        out += [b - a for a, b in zip(ts, ts[1:]) if a >= t0 and b <= t1]
    return out


def longest_gap_overlapping(reqs: list[dict], t0: float, t1: float) -> tuple[float, float, float]:
    """The longest inter-token gap (within one request) that overlaps [t0, t1]: (gap, its start, its end)."""
    worst = (0.0, t0, t0)
    for r in reqs:
        ts = r["times"]
        for a, b in zip(ts, ts[1:]):
            if a < t1 and b > t0 and b - a > worst[0]:
                worst = (b - a, a, b)
    return worst


def clock(t: float) -> str:
    """A perf_counter time as wall-clock HH:MM:SS.mmm (to match the server's log)."""
    w = CLOCK0 + t
    return time.strftime("%H:%M:%S", time.localtime(w)) + f".{int(w % 1 * 1000):03d}"


def longest_ttft(reqs: list[dict], t0: float, t1: float) -> float:
    """The longest time to first token of a request started inside [t0, t1]."""
    return max(((r["times"][0] if r["times"] else r["t_end"]) - r["t_start"]
                for r in reqs if t0 <= r["t_start"] <= t1), default=0.0)


def classify(reqs: list[tuple[int, dict]], reference: dict[int, list[int]], t0: float, t1: float) -> dict:
    """Requests that overlapped [t0, t1]: ok (the reference tokens), failed, mismatched (200, other tokens)."""
    ok = failed = mismatched = 0
    bad: list[str] = []
    for i, r in reqs:
        if not (r["t_start"] < t1 and r["t_end"] > t0):
            continue
        if r["status"] != 200 or r["error"] is not None or r["finish"] != "length" or len(r["tokens"]) != N_TOKENS:
            failed += 1
            bad.append(f"client {i}: status {r['status']} finish {r['finish']} {len(r['tokens'])} tokens "
                       f"error {str(r['error'])[:200]}")
        elif r["tokens"] != reference[i]:
            mismatched += 1
            first = next(k for k, (a, b) in enumerate(zip(r["tokens"], reference[i])) if a != b)
            bad.append(f"client {i}: tokens differ from the reference from token {first} on "
                       f"({r['tokens'][first:first + 5]} vs {reference[i][first:first + 5]})")
        else:
            ok += 1
    return {"ok": ok, "failed": failed, "mismatched": mismatched, "bad": bad}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


# --- the run ----------------------------------------------------------------------------------------

def _live_pid_mid_stream(load: Load, home: Path, host: str) -> tuple[int, str]:
    """host's worker pid and state dir, once every client has had a token in the last 0.5 s
    (mid-stream; bounded: 10 s)."""
    pid, d = worker_pid(home, host)
    if not pid:
        raise RuntimeError(f"no live worker pid for {host} in {d}")
    t_wait = time.perf_counter()
    while time.perf_counter() - t_wait < 10 and not load.all_ticked_after(time.perf_counter() - 0.5):
        time.sleep(0.02)
    return pid, d


def _healthy_and_streaming(load: Load) -> tuple[float, bool, bool]:
    """Wait for /health with every stage up, then for every stream's next token (bounded):
    (the window's end, healthy within 45 s, every stream ticked)."""
    healthy = wait_healthy(45) is not None
    t_end = time.perf_counter() + 1.0
    resumed_by = t_end + 9.0
    while time.perf_counter() < resumed_by and not load.all_ticked_after(t_end - 1.0):
        time.sleep(0.05)
    ticked = load.all_ticked_after(t_end - 1.0)
    time.sleep(max(0.0, t_end - time.perf_counter()))
    return t_end, healthy, ticked


def kill_op(load: Load, home: Path, host: str, notes: list[str]) -> tuple[float, float]:
    """SIGKILL host's worker mid-stream; the window to look for its stall in: (t_kill, t_end)."""
    pid, d = _live_pid_mid_stream(load, home, host)
    t_kill = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    log(f"SIGKILL {host} worker pid {pid} ({d}) at {clock(t_kill)}")
    time.sleep(1.0)  # let the health check see it before asking for /health ourselves
    t_end, healthy, ticked = _healthy_and_streaming(load)
    if not ticked:
        notes.append(f"{host} kill: not every stream had a token within 10 s of the server being healthy again")
    new, _ = worker_pid(home, host)
    notes.append(f"{host} kill at {clock(t_kill)}: worker pid {pid} -> {new} (a new pid from its supervisor: "
                 f"{bool(new and new != pid)}); /health 200 with every stage up "
                 + (f"{t_end - 1.0 - t_kill:.1f} s after the kill" if healthy else "NOT within 45 s"))
    return t_kill, t_end


def stop_op(load: Load, home: Path, host: str, notes: list[str], seconds: float = 5.0) -> tuple[float, float]:
    """SIGSTOP host's worker mid-stream for `seconds`, then SIGCONT; the window: (t_stop, t_end)."""
    pid, _ = _live_pid_mid_stream(load, home, host)
    t_stop = time.perf_counter()
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    t_end, healthy, ticked = _healthy_and_streaming(load)
    if not ticked:
        notes.append(f"{host} SIGSTOP: not every stream had a token within 10 s of the server being healthy again")
    notes.append(f"{host} SIGSTOP {seconds:g} s at {clock(t_stop)}: /health 200 with every stage up "
                 + (f"{t_end - 1.0 - t_stop:.1f} s after the stop" if healthy else "NOT within 45 s"))
    return t_stop, t_end


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, state) at the end")
    ap.add_argument("--normal-s", type=float, default=10.0, help="seconds of undisturbed load for the baseline")
    ap.add_argument("--settle-s", type=float, default=3.0, help="seconds of load between operations")
    a = ap.parse_args(argv)

    from layerline.checkpoint import write_demo_checkpoint

    taken = ports_taken()
    if taken:
        print(f"bench_ops: ports {taken[:6]}{'...' if len(taken) > 6 else ''} are in use; "
              f"this bench needs {PORT_BASE}-{PORT_BASE + 81} and {SERVE_PORT}", file=sys.stderr)
        return 2

    t_begin = time.perf_counter()
    home = Path(tempfile.mkdtemp(prefix="layerline-bench-ops-"))
    logdir = home / "logs"
    logdir.mkdir()
    ckpt = write_demo_checkpoint(home / "ckpt", layers=6, hidden=256, vocab=2000, dtype="float32", seed=11)
    inv = write_inventory(home, ckpt)
    log(f"home {home}; inventory {inv}")

    rows: list[dict] = []
    notes: list[str] = []
    load: Load | None = None
    failed_run = None
    try:
        wall, out, _ = playbook("deploy.yml", inv, logdir)
        log(f"deployed in {wall:.0f} s")
        plan = json.loads((home / "plan.json").read_text())
        notes.append("plan: " + ", ".join(f"{s['host']} {s['role']}{' for ' + s['standby_for'] if s.get('standby_for') else ''} "
                                          f"layers {s['layers'][0]}-{s['layers'][1]}" for s in plan["stages"]))
        if not any(s["host"] == "w4" and s["role"] == "standby" for s in plan["stages"]):
            notes.append("deploy.yml did not plan w4 as a standby: the standby failover below is not one")
        ups = stages_up()
        notes.append("server watches: " + ", ".join(f"{h} ({r})" for h, (r, _) in sorted(ups.items())))

        model = model_name()
        reference = {}
        for i, p in enumerate(PROMPTS):
            r = stream(model, p)
            if r["status"] != 200 or r["error"] or len(r["tokens"]) != N_TOKENS:
                raise RuntimeError(f"reference request {i} failed: {r['status']} {r['error']} {len(r['tokens'])} tokens")
            reference[i] = r["tokens"]
        log("reference made; load starts")

        load = Load(model).start()
        time.sleep(2.0)  # warm: every client in its first request
        n0 = time.perf_counter()
        time.sleep(a.normal_s)
        n1 = time.perf_counter()
        rows.append({"op": "normal", "t0": n0, "t1": n1, "wall": n1 - n0, "replays": 0.0})

        def over_budget() -> bool:
            return time.perf_counter() - t_begin > TOTAL_BUDGET

        ops = [("drain w2", lambda: playbook("drain.yml", inv, logdir, "-e", "layerline_drain=w2", check=False)),
               ("rejoin w2", lambda: playbook("deploy.yml", inv, logdir, "-e", "layerline_rejoin=w2", check=False))]
        for name, run in ops:
            if over_budget():
                notes.append(f"{name}: skipped, over the {TOTAL_BUDGET} s budget")
                continue
            log(f"{name} ...")
            r0 = metric("layerline_replays_total")
            t0 = time.perf_counter()
            wall, out, rc = run()
            t1 = time.perf_counter()
            flat = " ".join(out.split())
            failed = rc != 0
            m = re.search(r"route epoch \d+ through [\w, ]+", flat)
            notes.append(f"{name}: {'FAILED (exit ' + str(rc) + ')' if failed else 'ok'} in {wall:.1f} s; route.json {route(home)}; "
                         + (m.group(0) if m else "no 'route epoch' line") + "; "
                         + ("new route matches the one-process forward" if "matches the one-process forward" in flat
                            else "no 'matches the one-process forward' line"))
            if failed:
                tail = [ln for ln in out.splitlines() if "fatal:" in ln or "msg:" in ln or "FAILED" in ln][-5:]
                notes.append(f"{name} failure lines: " + " | ".join(t.strip()[:300] for t in tail))
            rows.append({"op": name, "t0": t0, "t1": t1, "wall": wall,
                         "replays": metric("layerline_replays_total") - r0})
            time.sleep(a.settle_s)

        promoted_before = metric("layerline_failovers_total", host="w3", action="promoted")
        for name, host, op in (("SIGKILL w3, standby w4", "w3", kill_op), ("SIGKILL w1, no standby", "w1", kill_op),
                               ("SIGSTOP w1 5 s, no standby", "w1", stop_op)):
            if over_budget():
                notes.append(f"{name}: skipped, over the {TOTAL_BUDGET} s budget")
                continue
            log(f"{name} ...")
            r0 = metric("layerline_replays_total")
            t0, t1 = op(load, home, host, notes)
            rows.append({"op": name, "t0": t0, "t1": t1, "wall": None,  # until its stall ended: below
                         "replays": metric("layerline_replays_total") - r0})
            time.sleep(a.settle_s)
        fo = {k: metric("layerline_failovers_total", host=h, action=k)
              for h, k in (("w3", "promoted"), ("w1", "waited"), ("w1", "restarted"))}
        notes.append(f"failovers_total: w3 promoted {fo['promoted'] - promoted_before:g} during the w3 kill; "
                     f"w1 waited {fo['waited']:g}, restarted {fo['restarted']:g}; replays_total "
                     f"{metric('layerline_replays_total'):g}")
        notes.append("stages after: " + ", ".join(f"{h} {r} up={v:g}" for h, (r, v) in sorted(stages_up().items())))
    except Exception as e:  # noqa: BLE001 - reported, then torn down
        failed_run = e
        log(f"run failed: {e}")
    finally:
        if load is not None:
            load.finish()
        log("teardown ...")
        try:
            wall, _, _ = playbook("teardown.yml", inv, logdir, check=True)
            log(f"teardown in {wall:.0f} s")
        except Exception as e:  # noqa: BLE001 - fall back to the supervisors themselves
            log(f"teardown.yml failed ({str(e)[:300]}); stopping the supervisors directly")
            for d in sorted((home / "state").glob("*")):
                subprocess.run([sys.executable, "-m", "layerline.supervise", "stop", "--state-dir", str(d)],
                               capture_output=True, timeout=60, stdin=subprocess.DEVNULL)

    if rows and load is not None:
        reqs = [r for _, r in load.requests]
        normal = rows[0]
        ng = gaps_in(reqs, normal["t0"], normal["t1"])
        med, p99 = statistics.median(ng) if ng else float("nan"), pct(ng, 99)
        print(f"\nbench_ops: 6-layer fp32 model (hidden 256, vocab 2000), w1-w3 local workers of one thread, "
              f"w4 standby for w3; {N_CLIENTS} clients streaming {N_TOKENS} greedy tokens in a loop")
        print(f"normal inter-token gap: median {med * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms "
              f"({len(ng)} gaps in {normal['wall']:.0f} s)\n")
        hdr = f"| {'operation':<26} | {'wall s':>7} | {'longest gap s':>13} | {'/ normal median':>15} | " \
              f"{'longest TTFT s':>14} | {'replays':>7} | {'ok':>4} | {'failed':>6} | {'other tokens':>12} |"
        print(hdr)
        print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
        all_bad = []
        for row in rows:
            worst, ga, gb = longest_gap_overlapping(reqs, row["t0"], row["t1"])
            if row["op"] == "normal":
                worst = max(ng, default=0.0)
            else:
                notes.append(f"{row['op']}: longest gap {worst:.3f} s from {clock(ga)} to {clock(gb)} "
                             f"(op {clock(row['t0'])} - {clock(row['t1'])}); "
                             f"gaps over 5x the normal median: {sum(1 for g in gaps_in(reqs, row['t0'], row['t1']) if g > 5 * med)}")
            if row["wall"] is None:  # a kill: until the longest stall it caused had ended
                row["wall"] = gb - row["t0"]
            c = classify(load.requests, reference, row["t0"], row["t1"])
            all_bad += [f"{row['op']}: {b}" for b in c["bad"]]
            print(f"| {row['op']:<26} | {row['wall']:>7.2f} | {worst:>13.3f} | {worst / med:>14.1f}x | "
                  f"{longest_ttft(reqs, row['t0'], row['t1']):>14.2f} | {row['replays']:>7g} | {c['ok']:>4} | "
                  f"{c['failed']:>6} | "
                  f"{c['mismatched']:>12} |")
        total = classify(load.requests, reference, float("-inf"), float("inf"))
        print(f"\nall requests: {total['ok']} with the undisturbed tokens, {total['failed']} failed, "
              f"{total['mismatched']} with other tokens (of {len(load.requests)})")
        print("wall: the playbook's run for drain/rejoin; for a kill, from the SIGKILL until its longest stall ended")
        for b in sorted(set(all_bad))[:20]:
            print(f"  BAD {b}")
    for n in notes:
        print(f"  - {n}")
    print(f"total run {time.perf_counter() - t_begin:.0f} s")
    if failed_run is not None:
        print(f"\nbench_ops: the run failed: {failed_run}", file=sys.stderr)
    if a.keep or failed_run is not None:
        print(f"kept {home} (logs in {logdir})")
    else:
        shutil.rmtree(home, ignore_errors=True)
    return 1 if failed_run is not None else 0


if __name__ == "__main__":
    sys.exit(main())
