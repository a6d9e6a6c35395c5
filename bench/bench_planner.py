"""Planner benchmark: planning time at scale, and how much the auto policy buys over fixed splits.

    .venv/bin/python bench/bench_planner.py [--clusters N] [--seed S]

(a) wall time of one auto/throughput plan for 1,000 hosts x 200 layers, against a 1 s goal;
(b) over seeded synthetic clusters of 3-8 hosts whose compute and memory bandwidth differ
    (1x-8x), the predicted bottleneck of auto divided by that of ram_balanced (goal <= 0.8)
    and of uniform, each pair planned in this run under the same cost model.

Prints ratios only; never fails on them. `main()` returns the figures as a dict.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from layerline.cost import CostOptions, ModelCost
from layerline.planner import Node, PlanError, make_plan

GiB = 2**30
SCALE_GOAL_S = 1.0
RATIO_GOAL = 0.8


def model(layers: int, seed: int = 0) -> ModelCost:
    """A 7B-class decoder (about 200M params per layer, GQA KV), layer sizes varying +-10%."""
    rng = random.Random(seed)
    dense = [int(200e6 * rng.uniform(0.9, 1.1)) for _ in range(layers)]
    return ModelCost(num_layers=layers, stored_precision="bf16", dense_params=dense, expert_params=[0] * layers,
                     rows=[40_000] * layers, embed_params=32_000 * 4096, head_params=32_000 * 4096 + 4096,
                     kv_width=2 * 8 * 128, hidden_size=4096, vocab_size=32_000)


def host(name: str, ram: int, flops: float, bw: float) -> Node:
    caps = {"addr": "127.0.0.1", "hostname": f"machine-{name}", "os": "linux", "cores": 16,
            "ram_total_bytes": ram + GiB, "ram_available_bytes": ram, "disk_free_bytes": 10**12,
            "disk_read_bytes_per_s": None,
            "devices": [{"name": "cpu", "kind": "cpu", "memory_bytes": ram, "memory_free_bytes": ram,
                         "flops_per_s": flops, "mem_bw_bytes_per_s": bw}], "probe_seconds": 0.0}
    return Node(host=name, caps=caps)


def random_cluster(rng: random.Random, n: int, need: int) -> list[Node]:
    """n hosts, RAM summing to 1.3-2.5x the model's need split unevenly, compute and memory
    bandwidth each spread 1x-8x independently of RAM."""
    w = [rng.uniform(0.3, 1.0) for _ in range(n)]
    total = need * rng.uniform(1.3, 2.5)
    return [host(f"h{k}", int(total * w[k] / sum(w)), 5e11 * rng.uniform(1, 8), 1e10 * rng.uniform(1, 8))
            for k in range(n)]


def bench_scale(hosts: int = 1000, layers: int = 200, repeat: int = 3, seed: int = 0) -> dict:
    rng = random.Random(seed)
    mc = model(layers, seed)
    opts = CostOptions(objective="throughput", context=4096)
    times = []
    for _ in range(repeat):
        nodes = [host(f"h{k}", rng.randint(8, 64) * GiB, 5e11 * rng.uniform(1, 8), 1e10 * rng.uniform(1, 8))
                 for k in range(hosts)]
        t0 = time.perf_counter()
        plan = make_plan(nodes, mc, opts, "auto")
        times.append(time.perf_counter() - t0)
    best = min(times)
    used = len(plan.actives)
    return {"hosts": hosts, "layers": layers, "seconds": best, "seconds_median": statistics.median(times),
            "ratio_to_goal": best / SCALE_GOAL_S, "active_stages": used}


def bench_quality(clusters: int = 200, seed: int = 1) -> dict:
    rng = random.Random(seed)
    opts = CostOptions(objective="throughput", context=4096)
    vs = {"ram_balanced": [], "uniform": []}
    infeasible = {"auto": 0, "ram_balanced": 0, "uniform": 0}
    for _ in range(clusters):
        layers = rng.randint(16, 48)
        mc = model(layers, rng.randrange(2**31))
        # the whole model's bytes at bf16 with its KV at this context
        need = (sum(mc.dense_params) + mc.embed_params + mc.head_params) * 2 + layers * mc.kv_width * 2 * opts.context
        nodes = random_cluster(rng, rng.randint(3, 8), need)
        specs = [(n.host, n.caps) for n in nodes]
        bottleneck = {}
        for policy in ("auto", "ram_balanced", "uniform"):
            try:
                bottleneck[policy] = make_plan([Node(host=h, caps=c) for h, c in specs], mc, opts,
                                               policy).bottleneck_s
            except PlanError:
                infeasible[policy] += 1
        if "auto" not in bottleneck:
            continue
        for other in vs:
            if other in bottleneck:
                vs[other].append(bottleneck["auto"] / bottleneck[other])
    out = {"clusters": clusters, "infeasible": infeasible}
    for other, r in vs.items():
        out[other] = {"n": len(r), "mean": statistics.fmean(r) if r else None, "worst": max(r) if r else None,
                      "best": min(r) if r else None,
                      "share_meeting_goal": sum(x <= RATIO_GOAL for x in r) / len(r) if r else None}
    return out


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args([] if argv is None else argv)
    scale = bench_scale()
    quality = bench_quality(a.clusters, a.seed)

    print(f"(a) planning time, auto/throughput, {scale['hosts']} hosts x {scale['layers']} layers")
    print(f"    best of 3: {scale['seconds']:.3f} s (median {scale['seconds_median']:.3f} s), "
          f"ratio to the {SCALE_GOAL_S:g} s goal: {scale['ratio_to_goal']:.3f}, "
          f"{scale['active_stages']} active stages")
    print(f"(b) predicted bottleneck, auto / fixed policy, {quality['clusters']} clusters of 3-8 hosts "
          f"(flops and mem bw spread 1x-8x; seed {a.seed})")
    head = f"    {'auto / policy':<18}{'n':>5}{'mean':>9}{'worst':>9}{'best':>9}{'<= ' + str(RATIO_GOAL):>9}"
    print(head)
    print("    " + "-" * (len(head) - 4))
    for other in ("ram_balanced", "uniform"):
        q = quality[other]
        print(f"    {other:<18}{q['n']:>5}{_fmt(q['mean']):>9}{_fmt(q['worst']):>9}{_fmt(q['best']):>9}"
              f"{_fmt(q['share_meeting_goal'], '.0%'):>9}")
    inf = quality["infeasible"]
    print(f"    infeasible plans: auto {inf['auto']}, ram_balanced {inf['ram_balanced']}, uniform {inf['uniform']}")
    print(f"    goal: mean auto / ram_balanced <= {RATIO_GOAL} "
          f"(measured {_fmt(quality['ram_balanced']['mean'])})")
    return {"scale": scale, "quality": quality}


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
