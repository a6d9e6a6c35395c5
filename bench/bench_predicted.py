"""Predicted vs measured stage time on a local three-worker deployment.

    .venv/bin/python bench/bench_predicted.py [--checkpoint DIR] [--new 32]

Probes this machine once (as the probe module does), plans three hosts that share it, starts
one worker per planned stage, decodes, and prints per stage the plan's predicted time per
token against the measured compute time per decode token (goal: within 20%).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> dict:
    from bench_decode import ensure_demo

    from layerline.checkpoint import read_index
    from layerline.cost import CostOptions, model_cost
    from layerline.driver import Pipeline, greedy_generate
    from layerline.planner import Node, make_plan, plan_table
    from layerline.probe import probe

    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(ROOT / ".cache" / "demo-llama"))
    ap.add_argument("--new", type=int, default=32)
    a = ap.parse_args(argv)
    ckpt = str(ensure_demo(Path(a.checkpoint)))
    caps = probe(ckpt)
    ports = [29800, 29810, 29820]
    nodes = [Node(host=f"w{i + 1}", caps=caps, endpoint=f"tcp://127.0.0.1:{p}") for i, p in enumerate(ports)]
    plan = make_plan(nodes, model_cost(read_index(ckpt)), CostOptions(context=512), "auto").to_dict()
    print(plan_table(plan), flush=True)
    tmp = tempfile.mkdtemp(prefix="layerline-bench-")
    stages = [s for s in plan["stages"] if s["role"] == "active"]
    procs = []
    env = dict(os.environ, GOMP_SPINCOUNT="10000")
    from layerline.keys import local_keys
    kd = local_keys(os.path.join(tmp, "keys"), [s["host"] for s in stages])  # every worker needs --keys
    for i, s in enumerate(stages):
        argv_ = [sys.executable, "-m", "layerline.worker", "--checkpoint", ckpt,
                 "--layers", f"{s['layers'][0]}:{s['layers'][1]}", "--precision", s["precision"],
                 "--kv-context", "512", "--bind", s["endpoint"], "--name", s["host"],
                 "--ready-file", f"{tmp}/ready{i}", "--keys", kd[s["host"]]]
        argv_ += ["--first"] if i == 0 else []
        argv_ += ["--last"] if i == len(stages) - 1 else ["--next", stages[i + 1]["endpoint"]]
        procs.append(subprocess.Popen(argv_, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        for i, p in enumerate(procs):
            while not os.path.exists(f"{tmp}/ready{i}"):
                if p.poll() is not None:
                    raise SystemExit(f"worker {i} exited {p.returncode}")
                time.sleep(0.05)
        with Pipeline(stages[0]["endpoint"]) as pipe:
            prompt = list(range(1, 65))
            greedy_generate(pipe, prompt[:8], 4, seq="warm")
            _, steps = greedy_generate(pipe, prompt, a.new, seq="bench")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    decode = steps[1:]
    out = {}
    print(f"\n{'stage':<6} {'layers':<8} {'predicted':>10} {'measured':>10} {'pred/meas':>10}")
    for i, s in enumerate(stages):
        meas = sorted(st.timings[i]["s"] for st in decode)[len(decode) // 2]  # median per token
        ratio = s["predicted_s"] / meas
        out[s["host"]] = {"predicted_s": s["predicted_s"], "measured_s": meas, "ratio": ratio}
        print(f"{s['host']:<6} {s['layers'][0]}:{s['layers'][1]:<6} {s['predicted_s'] * 1e3:>8.2f}ms "
              f"{meas * 1e3:>8.2f}ms {ratio:>10.2f}")
    worst = max(abs(v["ratio"] - 1) for v in out.values())
    print(f"worst |predicted/measured - 1| = {worst:.0%} (goal within 20%)")
    print(json.dumps({"probe": {k: caps[k] for k in ("cores", "probe_seconds")},
                      "cpu": {k: caps["devices"][0][k] for k in ("flops_per_s", "mem_bw_bytes_per_s")}}))
    return {"stages": out, "worst": worst}


if __name__ == "__main__":
    main(sys.argv[1:])
