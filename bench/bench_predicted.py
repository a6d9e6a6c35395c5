"""Predicted vs measured stage time on a local three-worker deployment, per mode.

    .venv/bin/python bench/bench_predicted.py [--checkpoint DIR] [--new 32]
        [--modes bf16/off,bf16/default,int8/off]

Probes this machine once (as the probe module does), then for each mode (precision/compile):
plans three hosts that share it, starts one worker per planned stage (at once, with the flags a
deploy gives stages that share a machine: `--time-alone`, `--awake-ms 0`), and reads the step time
each worker measured at warm-up (its ready file's step_s). As a deploy keeps them in the probe
cache, the measured / modelled factor goes into the caps, and the next plan (the same layers,
pinned, so the running workers serve it) predicts from it. Printed per stage: the cost model
alone, the plan with the factors the hosts measured, as a deploy plans with them (the three hosts
share this machine, so each plans with the median of the three: planner.machine_step_factors;
the goal, within 20%), and
with the mode's factor (the median of the three hosts': how well one stage's factor carries to
another's layers), against the measured compute time per decode token.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _start(ckpt: str, plan, compile: str, tmp: str, kd: dict) -> list:
    from layerline.spec import shared_cores_argv
    env = dict(os.environ, GOMP_SPINCOUNT="10000")
    procs = []
    stages = [s.to_dict() for s in plan.actives]
    for i, s in enumerate(stages):
        argv_ = [sys.executable, "-m", "layerline.worker", "--checkpoint", ckpt,
                 "--layers", f"{s['layers'][0]}:{s['layers'][1]}", "--precision", s["precision"],
                 "--kv-context", "512", "--bind", s["endpoint"], "--name", s["host"],
                 "--ready-file", f"{tmp}/ready{i}", "--keys", kd[s["host"]], "--compile", compile,
                 "--compile-cache", str(ROOT / ".cache" / "inductor")]
        # started all at once, with the flags a deploy gives stages that share a machine
        argv_ += shared_cores_argv(plan) if s["shares_cores_with"] else []
        argv_ += ["--first"] if i == 0 else []
        argv_ += ["--last"] if i == len(stages) - 1 else ["--next", stages[i + 1]["endpoint"]]
        procs.append(subprocess.Popen(argv_, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    deadline = time.monotonic() + 1800  # a max-autotune compile on a cold cache takes minutes
    try:
        for i, p in enumerate(procs):
            while not os.path.exists(f"{tmp}/ready{i}"):
                if p.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"worker {i} did not start (exit {p.poll()})")
                time.sleep(0.05)
    except BaseException:
        for p in procs:  # the others too: they hold ports and cores
            p.kill()
            p.wait()
        raise
    return procs


def run_mode(ckpt: str, caps: dict, prec: str, compile: str, new: int, ports: list[int]) -> dict:
    from layerline.checkpoint import read_index
    from layerline.cost import CostOptions, model_cost, step_factor, step_mode
    from layerline.driver import Pipeline, greedy_generate
    from layerline.keys import local_keys
    from layerline.planner import Node, make_plan
    from layerline.probe import with_step_factor

    cost, opts = model_cost(read_index(ckpt)), CostOptions(context=512)

    def plan_with(per_host: dict, pin: dict | None = None):
        nodes = []
        for i, p in enumerate(ports):
            host = f"w{i + 1}"
            c = caps if host not in per_host else with_step_factor(caps, "cpu", step_mode(prec, compile), per_host[host])
            nodes.append(Node(host=host, caps=c, endpoint=f"tcp://127.0.0.1:{p}", precision=prec, compile=compile,
                              layers=(pin or {}).get(host)))
        return make_plan(nodes, cost, opts, "auto")

    first_plan = plan_with({})
    first = [s.to_dict() for s in first_plan.actives]
    tmp = tempfile.mkdtemp(prefix="layerline-bench-")
    kd = local_keys(os.path.join(tmp, "keys"), [s["host"] for s in first])  # every worker needs --keys
    procs = _start(ckpt, first_plan, compile, tmp, kd)
    try:
        ready = [json.loads(Path(f"{tmp}/ready{i}").read_text()) for i in range(len(first))]
        # what the role's record_step keeps per host
        own = {s["host"]: step_factor(r["step_s"], s["predicted_s"], s["step_factor"]) for s, r in zip(first, ready)}
        mode = statistics.median(own.values())
        pin = {s["host"]: tuple(s["layers"]) for s in first}
        with_own = [s.to_dict() for s in plan_with(own, pin).actives]
        with_mode = [s.to_dict() for s in plan_with(dict.fromkeys(own, mode), pin).actives]
        with Pipeline(first[0]["endpoint"], keys_dir=kd["controller"], first_key=first[0]["host"]) as pipe:
            prompt = list(range(1, 65))
            greedy_generate(pipe, prompt[:8], 4, seq="warm")
            _, steps = greedy_generate(pipe, prompt, new, seq="bench")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)  # the workers' keys (secrets) and ready files
    decode = steps[1:]
    rows = []
    for i, s in enumerate(first):
        meas = sorted(st.timings[i]["s"] for st in decode)[len(decode) // 2]  # median per token
        rows.append({"host": s["host"], "layers": s["layers"], "model_s": s["predicted_s"], "warmup_step_s": ready[i]["step_s"],
                     "own_s": with_own[i]["predicted_s"], "mode_s": with_mode[i]["predicted_s"], "measured_s": meas})
    return {"mode": step_mode(prec, compile), "factor": mode, "factors": own, "stages": rows,
            "compiled": all(r.get("compiled") for r in ready) if compile != "off" else False}


def main(argv=None) -> dict:
    from bench_decode import ensure_demo

    from layerline.probe import probe

    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(ROOT / ".cache" / "demo-llama"))
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--modes", default="bf16/off,bf16/default,int8/off",
                    help="precision/compile pairs, comma-separated")
    a = ap.parse_args(argv)
    ckpt = str(ensure_demo(Path(a.checkpoint)))
    caps = probe(ckpt)
    print(json.dumps({"probe": {k: caps[k] for k in ("cores", "probe_seconds")},
                      "cpu": {k: caps["devices"][0][k] for k in ("flops_per_s", "mem_bw_bytes_per_s")}}), flush=True)
    out, worst = {}, 0.0
    for m in a.modes.split(","):
        prec, compile = m.split("/")
        r = run_mode(ckpt, copy.deepcopy(caps), prec, compile, a.new, [29800, 29810, 29820])
        out[m] = r
        print(f"\n{m}{' (compile failed: eager)' if compile != 'off' and not r['compiled'] else ''}: mode factor "
              f"{r['factor']:.2f} (per host {', '.join(f'{h} {f:.2f}' for h, f in r['factors'].items())})")
        print(f"{'stage':<6} {'layers':<7} {'model':>9} {'own f':>9} {'mode f':>9} {'measured':>9} "
              f"{'model/m':>8} {'own/m':>6} {'mode/m':>6}")
        for s in r["stages"]:
            ms = s["measured_s"]
            worst = max(worst, abs(s["own_s"] / ms - 1))
            print(f"{s['host']:<6} {s['layers'][0]}:{s['layers'][1]:<5} {s['model_s'] * 1e3:>7.2f}ms "
                  f"{s['own_s'] * 1e3:>7.2f}ms {s['mode_s'] * 1e3:>7.2f}ms {ms * 1e3:>7.2f}ms "
                  f"{s['model_s'] / ms:>8.2f} {s['own_s'] / ms:>6.2f} {s['mode_s'] / ms:>6.2f}", flush=True)
    print(f"\nworst |predicted/measured - 1| with each host's own factor (what a deploy plans with), over "
          f"{len(out)} modes = {worst:.0%} (goal within 20%)", flush=True)
    return {"modes": out, "worst": worst}


if __name__ == "__main__":
    main(sys.argv[1:])
