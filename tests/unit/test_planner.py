"""layerline.planner: placement properties over random clusters and models.

The expectations use an independent restatement of the cost model (bytes and time per
stage, memory budgets) written here from the plan contract, plus brute force over every
ordered contiguous split on small instances.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from layerline.caps import NodeCaps
from layerline.cost import CostOptions, ModelCost
from layerline.errors import LayerlineError
from layerline.pipeline import pipeline_for_plan
from layerline.planner import (DEFAULT_HOP_S, Node, Plan, PlanError, make_plan, message_threads, pipeline_depth, plan_table,
                               validate_plan)

PB = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0}
KVB = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
REL = 1e-9

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- an independent statement of the cost model --------------------------------------------------

def w_bytes(mc: ModelCost, prec: str, a: int, b: int) -> int:
    """Weights a stage [a, b) holds: its layers, the embedding if first, the head if last."""
    L = mc.num_layers
    w = 0
    for i in range(a, b):
        w += int((mc.dense_params[i] + mc.expert_params[i]) * PB[prec])
        if prec == "int8":
            w += mc.rows[i] * 4          # one fp32 scale per output channel
    edge = 0.0
    if a == 0:
        edge += mc.embed_params * PB[prec]
    if b == L:
        edge += mc.head_params * PB[prec]
        if mc.tied_embeddings and a != 0:
            edge += mc.embed_params * PB[prec]
    return w + int(edge)


def kv_layer(mc: ModelCost, opts: CostOptions, prec: str) -> int:
    """KV bytes one layer reserves: bytes/token x context x batch."""
    if opts.kv_bytes_per_layer_token is not None:
        per = opts.kv_bytes_per_layer_token
    else:
        per = (mc.kv_width or 0) * KVB[opts.kv_dtype or ("bf16" if prec == "int8" else prec)]  # int8 keeps a bf16 KV
    return per * opts.context * opts.batch


def mem(mc, opts, prec, a, b) -> int:
    return w_bytes(mc, prec, a, b) + (b - a) * kv_layer(mc, opts, prec)


def s_time(mc: ModelCost, prec: str, flops: float, bw: float, a: int, b: int, batch: int,
           layer_s: float = 0.0) -> float:
    """Decode step time: the larger of compute and weight reads (active experts only), plus each
    layer's fixed cost."""
    L = mc.num_layers
    act = sum(mc.active_params(i) for i in range(a, b))
    fl = 2.0 * act
    rd = act * PB[prec]
    if b == L:
        fl += 2.0 * mc.vocab_size * mc.hidden_size
        rd += (mc.head_params + (mc.embed_params if mc.tied_embeddings else 0)) * PB[prec]
    return max(fl * batch / flops, rd / bw) + (b - a) * layer_s


def budgets(specs: list[dict], reserve: int = 0) -> list[int]:
    """Each host's budget: its machine's available RAM split among the hosts on it."""
    share: dict = {}
    for s in specs:
        if s.get("role", "active") != "draining":
            key = (s["hostname"], s["ram_total"])
            share[key] = share.get(key, 0) + 1
    out = []
    for s in specs:
        b = s["ram"] // share.get((s["hostname"], s["ram_total"]), 1) - reserve
        if s.get("max_ram") is not None:
            b = min(b, s["max_ram"])
        out.append(max(0, b))
    return out


def caps(spec: dict) -> dict:
    return {"addr": "127.0.0.1", "hostname": spec["hostname"], "os": "linux", "cores": 4,
            "ram_total_bytes": spec["ram_total"], "ram_available_bytes": spec["ram"],
            "disk_free_bytes": 10**12, "disk_read_bytes_per_s": spec.get("disk"),
            "devices": [{"name": "cpu", "kind": "cpu", "memory_bytes": spec["ram_total"],
                         "memory_free_bytes": spec["ram"], "flops_per_s": spec["flops"],
                         "mem_bw_bytes_per_s": spec["bw"], "layer_overhead_s": spec.get("layer_s")}],
            "probe_seconds": 0.1, **({"machine_id": spec["machine_id"]} if "machine_id" in spec else {})}


def spec(name: str, ram: int, flops: float = 1e12, bw: float = 1e11, **kw) -> dict:
    d = {"host": name, "hostname": f"machine-{name}", "ram": int(ram), "ram_total": 2 * int(ram) + 7,
         "flops": float(flops), "bw": float(bw)}
    d.update(kw)
    return d


def nodes_of(specs: list[dict]) -> list[Node]:
    """Node objects (frozen: make_plan leaves its inputs as they were)."""
    out = []
    for s in specs:
        out.append(Node(host=s["host"], caps=caps(s), role=s.get("role", "active"), layers=s.get("layers"),
                        precision=s.get("precision"), standby_for=s.get("standby_for"),
                        max_ram_bytes=s.get("max_ram"), endpoint=f"tcp://127.0.0.1:{9100 + 2 * len(out)}"))
    return out


def plan(specs, mc, opts, policy="auto") -> dict:
    """The plan as its JSON (what playbooks and plan.json hold)."""
    return make_plan(nodes_of(specs), mc, opts, policy).to_dict()


def actives(p: dict) -> list[dict]:
    return [s for s in p["stages"] if s["role"] == "active"]


def close(x: float, y: float) -> bool:
    return math.isclose(x, y, rel_tol=REL, abs_tol=1e-300)


def splits(L: int, n: int):
    """Every ordered contiguous split of L layers over n hosts (hosts may get zero layers)."""
    for cuts in itertools.combinations_with_replacement(range(L + 1), n - 1):
        edges = (0,) + cuts + (L,)
        yield [(edges[k], edges[k + 1]) for k in range(n)]


def hop(opts) -> float:
    """The hop the planner prices: the objective's, else (no measured round trips here) the default."""
    return DEFAULT_HOP_S if opts.hop_s is None else opts.hop_s


def brute(specs, mc, opts, prec):
    """(min bottleneck, min sum-of-times + hop per used stage, min hosts used) over fitting splits."""
    bud = budgets(specs, opts.reserve_ram_bytes)
    best_b = best_l = math.inf
    best_n = math.inf
    for sp in splits(mc.num_layers, len(specs)):
        used = [(k, a, b) for k, (a, b) in enumerate(sp) if b > a]
        if any(mem(mc, opts, prec, a, b) > bud[k] for k, a, b in used):
            continue
        times = [s_time(mc, prec, specs[k]["flops"], specs[k]["bw"], a, b, opts.batch) for k, a, b in used]
        best_b = min(best_b, max(times))
        best_l = min(best_l, sum(times) + hop(opts) * len(used))
        best_n = min(best_n, len(used))
    return best_b, best_l, best_n


# --- strategies -------------------------------------------------------------------------------------

@st.composite
def models(draw, max_layers: int = 40) -> ModelCost:
    L = draw(st.integers(1, max_layers))
    dense = draw(st.lists(st.integers(10**4, 2 * 10**8), min_size=L, max_size=L))
    if draw(st.booleans()):
        E, k = draw(st.sampled_from([4, 8, 16])), draw(st.integers(1, 2))
        expert = draw(st.lists(st.integers(0, 6 * 10**8), min_size=L, max_size=L))
    else:
        E, k, expert = 0, 0, [0] * L
    hidden = draw(st.sampled_from([256, 1024, 4096]))
    vocab = draw(st.integers(1000, 150_000))
    tied = draw(st.booleans())
    rows = [d // draw(st.integers(100, 5000)) + 1 for d in dense]
    return ModelCost(num_layers=L, stored_precision=draw(st.sampled_from(["bf16", "fp32"])),
                     dense_params=dense, expert_params=expert, rows=rows, embed_params=vocab * hidden,
                     head_params=hidden + (0 if tied else vocab * hidden), num_experts=E, experts_per_token=k,
                     kv_width=draw(st.sampled_from([128, 512, 2048])), hidden_size=hidden, vocab_size=vocab,
                     tied_embeddings=tied)


@st.composite
def options(draw, objective=None) -> CostOptions:
    return CostOptions(objective=objective or draw(st.sampled_from(["throughput", "latency", "memory"])),
                       context=draw(st.integers(1, 8192)), batch=draw(st.integers(1, 4)),
                       kv_dtype=draw(st.sampled_from([None, "bf16", "fp16", "fp32"])),
                       hop_s=draw(st.sampled_from([0.0, 0.0005, 0.01])))


@st.composite
def cluster(draw, mc: ModelCost, opts: CostOptions, max_nodes: int = 8, lo: float = 0.9, hi: float = 4.0,
            min_nodes: int = 1):
    """min_nodes..max_nodes hosts whose RAM adds up to lo..hi times the whole model's need (split
    unevenly), with random speeds."""
    total = mem(mc, opts, mc.stored_precision, 0, mc.num_layers) * draw(st.floats(lo, hi))
    n = draw(st.integers(min_nodes, max_nodes))
    w = draw(st.lists(st.floats(0.05, 1.0), min_size=n, max_size=n))
    return [spec(f"w{k}", int(total * w[k] / sum(w)) + 1,
                 flops=1e12 * draw(st.floats(1.0, 10.0)), bw=1e11 * draw(st.floats(1.0, 10.0)))
            for k in range(n)]


@st.composite
def instances(draw, max_layers=40, max_nodes=8, objective=None, lo=0.9, hi=4.0, min_nodes=1):
    mc = draw(models(max_layers))
    opts = draw(options(objective))
    return mc, opts, draw(cluster(mc, opts, max_nodes, lo, hi, min_nodes))


def check_plan(p: dict, specs: list[dict], mc: ModelCost, opts: CostOptions) -> None:
    """Every invariant a returned plan must satisfy, against the independent cost model."""
    validate_plan(Plan.from_dict(p))
    json.dumps(p)
    act = actives(p)
    assert act, "a plan has at least one active stage"
    covered = [i for s in act for i in range(*s["layers"])]
    assert covered == list(range(mc.num_layers)), "actives cover every layer exactly once, in order"
    order = [s["host"] for s in specs if s.get("role", "active") == "active"]
    assert [s["host"] for s in act] == [h for h in order if h in {s["host"] for s in act}], "pipeline order"
    assert p["num_layers"] == mc.num_layers
    bud = dict(zip([s["host"] for s in specs], budgets(specs, opts.reserve_ram_bytes)))
    by_host = {s["host"]: s for s in specs}
    for s in p["stages"]:
        a, b = s["layers"]
        assert b > a
        assert s["mem_budget_bytes"] == bud[s["host"]]
        assert s["weight_bytes"] + s["kv_bytes"] <= s["mem_budget_bytes"], f"{s['host']} over its budget"
        assert s["weight_bytes"] == w_bytes(mc, s["precision"], a, b)
        assert s["kv_bytes"] == (b - a) * kv_layer(mc, opts, s["precision"])
        h = by_host[s["host"]]
        assert close(s["predicted_s"], s_time(mc, s["precision"], h["flops"], h["bw"], a, b, opts.batch,
                                              h.get("layer_s") or 0.0))
    assert p["bottleneck_s"] == max(s["predicted_s"] for s in act)
    assert p["predicted_token_s"] >= sum(s["predicted_s"] for s in act)
    assert p["kv"]["context"] == opts.context
    assert p["kv"]["dtype"] == (opts.kv_dtype or ("bf16" if p["precision"] == "int8" else p["precision"]))


# --- properties ---------------------------------------------------------------------------------------

@FAST
@given(inst=instances(), policy=st.sampled_from(["auto", "ram_balanced", "uniform"]))
def test_any_returned_plan_is_valid(inst, policy):
    mc, opts, specs = inst
    try:
        p = plan(specs, mc, opts, policy)
    except PlanError as e:
        assert "\n" not in str(e)
        return
    check_plan(p, specs, mc, opts)
    assert p["precision"] == mc.stored_precision
    if policy in ("ram_balanced", "uniform"):
        # fixed splits: layer counts within one of the exact proportional share
        w = budgets(specs) if policy == "ram_balanced" else [1] * len(specs)
        counts = {s["host"]: s["layers"][1] - s["layers"][0] for s in actives(p)}
        for s, wk in zip(specs, w):
            assert abs(counts.get(s["host"], 0) - mc.num_layers * wk / sum(w)) < 1


@FAST
@given(inst=instances(objective="throughput", lo=1.0, hi=4.0, min_nodes=2))
def test_auto_throughput_beats_fixed_policies(inst):
    mc, opts, specs = inst
    results = {}
    for policy in ("auto", "ram_balanced", "uniform"):
        try:
            results[policy] = plan(specs, mc, opts, policy)
        except PlanError:
            results[policy] = None
    for other in ("ram_balanced", "uniform"):
        if results[other] is None:
            continue
        assert results["auto"] is not None, f"{other} found a plan, auto did not"
        assert results["auto"]["bottleneck_s"] <= results[other]["bottleneck_s"] * (1 + REL)


def _brute_check(mc, opts, specs):
    prec = mc.stored_precision
    best_b, best_l, best_n = brute(specs, mc, opts, prec)
    try:
        p = plan(specs, mc, opts)
    except PlanError:
        assert best_b == math.inf, "make_plan found no plan but a fitting split exists"
        return None, best_n
    assert best_b < math.inf, "make_plan returned a plan but no split fits"
    check_plan(p, specs, mc, opts)
    act = actives(p)
    if opts.objective == "throughput":
        assert close(p["bottleneck_s"], best_b)
    elif opts.objective == "latency":
        total = sum(s["predicted_s"] for s in act) + hop(opts) * len(act)
        assert close(total, best_l)
        assert close(p["predicted_token_s"], best_l + hop(opts))
    return p, best_n


@SMALL
@given(inst=instances(max_layers=8, max_nodes=4, objective="throughput", lo=1.2, hi=6.0, min_nodes=2))
def test_throughput_equals_brute_force(inst):
    _brute_check(*inst)


@SMALL
@given(inst=instances(max_layers=8, max_nodes=4, objective="latency", lo=1.2, hi=6.0, min_nodes=2))
def test_latency_equals_brute_force(inst):
    _brute_check(*inst)


@SMALL
@given(inst=instances(max_layers=8, max_nodes=4, objective="memory", lo=1.2, hi=6.0, min_nodes=2))
def test_memory_feasible_iff_brute_force(inst):
    _brute_check(*inst)


_MC4 = ModelCost(num_layers=4, stored_precision="bf16", dense_params=[1000] * 4, expert_params=[0] * 4,
                 rows=[10] * 4, embed_params=0, head_params=0, kv_width=0, hidden_size=0, vocab_size=0)


@SMALL
@example(inst=(_MC4, CostOptions(objective="memory", kv_bytes_per_layer_token=0),
               [spec("small", 2100), spec("big", 10**6)]))
@given(inst=instances(max_layers=8, max_nodes=4, objective="memory", lo=1.2, hi=6.0, min_nodes=2))
def test_memory_uses_fewest_hosts(inst):
    p, best_n = _brute_check(*inst)
    if p is not None:
        assert len(actives(p)) == best_n


# --- precision ladder -------------------------------------------------------------------------------

LADDERS = [["bf16", "int8"], ["fp32", "bf16", "int8"], ["fp32", "int8"], ["bf16"], ["int8"]]


@SMALL
@given(mc=models(max_layers=8), ladder=st.sampled_from(LADDERS), data=st.data())
def test_ladder_steps_down_only_as_needed(mc, ladder, data):
    opts = CostOptions(objective=data.draw(st.sampled_from(["throughput", "latency", "memory"])),
                       context=data.draw(st.integers(1, 4096)), precision_ladder=ladder)
    # RAM between a fraction of the int8 need and more than the fp32 need
    lo_need = mem(mc, opts, "int8", 0, mc.num_layers)
    hi_need = mem(mc, opts, "fp32", 0, mc.num_layers)
    n = data.draw(st.integers(1, 3))
    specs = [spec(f"w{k}", data.draw(st.integers(lo_need // (2 * n), hi_need + 1))) for k in range(n)]
    feasible = [r for r in ladder if brute(specs, mc, opts, r)[0] < math.inf]
    try:
        p = plan(specs, mc, opts)
    except PlanError as e:
        assert not feasible, f"fits at {feasible[0]} but make_plan failed: {e}"
        return
    assert feasible and p["precision"] == feasible[0]
    assert {s["precision"] for s in p["stages"]} == {feasible[0]}
    check_plan(p, specs, mc, opts)


def test_ladder_bf16_stays_bf16_and_int8_only_when_needed():
    mc = ModelCost(num_layers=6, stored_precision="bf16", dense_params=[10**6] * 6, expert_params=[0] * 6,
                   rows=[1000] * 6, embed_params=10**5, head_params=10**5, kv_width=64, hidden_size=64,
                   vocab_size=1000)
    opts = CostOptions(context=128, precision_ladder=["bf16", "int8"])
    need_bf16, need_int8 = mem(mc, opts, "bf16", 0, 6), mem(mc, opts, "int8", 0, 6)
    assert need_int8 < need_bf16
    assert plan([spec("a", need_bf16)], mc, opts)["precision"] == "bf16"
    assert plan([spec("a", need_bf16 * 10)], mc, opts)["precision"] == "bf16"
    p = plan([spec("a", need_bf16 - 1)], mc, opts)
    assert p["precision"] == "int8" and p["stages"][0]["precision"] == "int8"
    assert p["kv"]["dtype"] == "bf16"  # int8 is weight-only
    with pytest.raises(PlanError, match="int8"):
        plan([spec("a", need_int8 - 1)], mc, opts)


# --- unfit models --------------------------------------------------------------------------------

@FAST
@given(mc=models(), ladder=st.sampled_from([[], ["bf16", "int8"], ["fp32"]]), data=st.data())
def test_unfit_says_how_many_bytes_short(mc, ladder, data):
    opts = CostOptions(context=data.draw(st.integers(1, 8192)), precision_ladder=ladder,
                       reserve_ram_bytes=data.draw(st.sampled_from([0, 1000])))
    rung = (ladder or [mc.stored_precision])[-1]
    need = mem(mc, opts, rung, 0, mc.num_layers)
    n = data.draw(st.integers(1, 4))
    specs = [spec(f"w{k}", int(need * data.draw(st.floats(0.0, 0.95)) / n)) for k in range(n)]
    have = sum(budgets(specs, opts.reserve_ram_bytes))
    assert need > have
    with pytest.raises(PlanError) as ei:
        plan(specs, mc, opts)
    msg = str(ei.value)
    assert "\n" not in msg
    m = re.search(r"(\d+) bytes short", msg)
    assert m, msg
    assert int(m.group(1)) == need - have
    assert rung in msg


# --- standbys ------------------------------------------------------------------------------------

def _mc(L=8, **kw) -> ModelCost:
    d = dict(num_layers=L, stored_precision="bf16", dense_params=[10**6] * L, expert_params=[0] * L,
             rows=[2000] * L, embed_params=5 * 10**5, head_params=5 * 10**5 + 64, kv_width=128,
             hidden_size=64, vocab_size=8000)
    d.update(kw)
    return ModelCost(**d)


BIG = 10**9
OPTS = CostOptions(context=256)


def test_standby_for_mirrors_principal_layers_and_precision():
    mc = _mc()
    specs = [spec("a", BIG, layers=(0, 3)), spec("b", BIG, layers=(3, 8), precision="int8"),
             spec("s", BIG, role="standby", standby_for="b"), spec("t", BIG, role="standby", standby_for="a")]
    p = plan(specs, mc, OPTS)
    check_plan(p, specs, mc, OPTS)
    st_ = {s["host"]: s for s in p["stages"]}
    assert st_["b"]["precision"] == "int8" and st_["a"]["precision"] == "bf16"
    for sb, pr in (("s", "b"), ("t", "a")):
        assert st_[sb]["role"] == "standby" and st_[sb]["standby_for"] == pr
        for k in ("layers", "precision", "weight_bytes", "kv_bytes"):
            assert st_[sb][k] == st_[pr][k], k
    assert [s["host"] for s in actives(p)] == ["a", "b"]


@FAST
@given(inst=instances(max_layers=12, max_nodes=4, lo=1.0, hi=4.0), n_standby=st.integers(1, 3), data=st.data())
def test_auto_standbys_mirror_distinct_actives(inst, n_standby, data):
    mc, opts, specs = inst
    try:
        base = plan(specs, mc, opts)
    except PlanError:
        return
    n_act = len(actives(base))
    assume(n_standby <= n_act)
    standbys = [spec(f"s{k}", 10 * mem(mc, opts, "fp32", 0, mc.num_layers) + BIG, role="standby")
                for k in range(n_standby)]
    p = plan(specs + standbys, mc, opts)
    check_plan(p, specs + standbys, mc, opts)
    act = {s["host"]: s for s in actives(p)}
    principals = []
    for s in p["stages"]:
        if s["role"] == "standby":
            assert s["standby_for"] in act
            principals.append(s["standby_for"])
            assert s["layers"] == act[s["standby_for"]]["layers"]
            assert s["precision"] == act[s["standby_for"]]["precision"]
    assert len(principals) == n_standby == len(set(principals))


@pytest.mark.parametrize("target", ["nowhere", "d"])
def test_standby_for_non_active_host_is_an_error(target):
    specs = [spec("a", BIG), spec("d", BIG, role="draining"), spec("s", BIG, role="standby", standby_for=target)]
    with pytest.raises(PlanError) as ei:
        plan(specs, _mc(), OPTS)
    assert "s" in str(ei.value) and target in str(ei.value) and "\n" not in str(ei.value)


def test_standby_for_another_standby_is_an_error():
    specs = [spec("a", BIG), spec("s1", BIG, role="standby", standby_for="a"),
             spec("s2", BIG, role="standby", standby_for="s1")]
    with pytest.raises(PlanError):
        plan(specs, _mc(), OPTS)


def test_auto_standby_never_mirrors_a_standby():
    specs = [spec("a", BIG), spec("s1", BIG, role="standby"), spec("s2", BIG, role="standby")]
    try:
        p = plan(specs, _mc(), OPTS)
    except PlanError:
        return
    act = {s["host"] for s in actives(p)}
    assert all(s["standby_for"] in act for s in p["stages"] if s["role"] == "standby")


def test_standby_too_small_says_bytes_short():
    mc = _mc()
    need = mem(mc, OPTS, "bf16", 0, 8)
    specs = [spec("a", BIG), spec("s", need - 123, role="standby", standby_for="a")]
    with pytest.raises(PlanError) as ei:
        plan(specs, mc, OPTS)
    assert re.search(r"\b123 bytes short", str(ei.value)), str(ei.value)


# --- pins --------------------------------------------------------------------------------------

@FAST
@given(mc=models(max_layers=20), objective=st.sampled_from(["throughput", "latency", "memory"]), data=st.data())
def test_pins_honoured(mc, objective, data):
    opts = CostOptions(objective=objective, context=data.draw(st.integers(1, 2048)))
    n = data.draw(st.integers(1, 6))
    sp = data.draw(st.sampled_from(list(itertools.islice(splits(mc.num_layers, n), 200))))
    pinned = {k: sp[k] for k in range(n) if sp[k][1] > sp[k][0] and data.draw(st.booleans())}
    ample = 2 * mem(mc, opts, mc.stored_precision, 0, mc.num_layers)
    specs = [spec(f"w{k}", ample, flops=data.draw(st.floats(1e10, 1e13)), layers=pinned.get(k)) for k in range(n)]
    p = plan(specs, mc, opts)  # the split the pins came from fits: a plan must exist
    check_plan(p, specs, mc, opts)
    got = {s["host"]: tuple(s["layers"]) for s in actives(p)}
    for k, r in pinned.items():
        assert got[f"w{k}"] == r


def test_pins_set_pipeline_order():
    specs = [spec("late", BIG, layers=(5, 8)), spec("free", BIG), spec("early", BIG, layers=(0, 2))]
    p = plan(specs, _mc(), OPTS)
    validate_plan(Plan.from_dict(p))
    got = {s["host"]: s["layers"] for s in actives(p)}
    assert got["early"] == [0, 2] and got["late"] == [5, 8] and got["free"] == [2, 5]


def test_manual_policy():
    specs = [spec("a", BIG, layers=(0, 5)), spec("b", BIG, layers=(5, 8))]
    p = plan(specs, _mc(), OPTS, "manual")
    assert [s["layers"] for s in actives(p)] == [[0, 5], [5, 8]]
    with pytest.raises(PlanError, match="b"):
        plan([spec("a", BIG, layers=(0, 5)), spec("b", BIG)], _mc(), OPTS, "manual")


def test_pin_past_the_model_is_an_error():
    with pytest.raises(PlanError, match="w0"):
        plan([spec("w0", BIG, layers=(0, 9))], _mc(), OPTS)


@pytest.mark.parametrize("policy", ["ram_balanced", "uniform"])
def test_pins_refused_by_fixed_policies(policy):
    """Fixed splits would silently override a pin: the planner refuses and says what to use."""
    specs = [spec("a", BIG, layers=(0, 1)), spec("b", BIG)]
    with pytest.raises(PlanError, match=f"layerline_policy {policy}.*a pin layerline_layers"):
        plan(specs, _mc(), OPTS, policy)


def test_bad_policy_role_precision():
    with pytest.raises(PlanError, match="layerline_policy"):
        plan([spec("a", BIG)], _mc(), OPTS, "fastest")
    with pytest.raises(PlanError, match="layerline_role"):
        plan([spec("a", BIG, role="spare")], _mc(), OPTS)
    with pytest.raises(PlanError, match="layerline_precision"):
        plan([spec("a", BIG, precision="fp8")], _mc(), OPTS)
    with pytest.raises(PlanError, match="no active"):
        plan([spec("a", BIG, role="standby")], _mc(), OPTS)
    assert issubclass(PlanError, LayerlineError)


# --- shared machines -------------------------------------------------------------------------------

def test_hosts_on_one_machine_split_its_ram(tmp_path):
    """Hosts with one machine_id (the kernel's boot id) share its RAM, as they share its cores."""
    ram = 3 * 10**9
    box = dict(hostname="box", machine_id="boot-1", ram_total=4 * 10**9)
    specs = [spec("a", ram, **box), spec("b", ram, **box), spec("c", ram, **box),
             spec("other", ram, hostname="box", machine_id="boot-2"),   # same name, other machine
             spec("solo", ram)]
    p = plan(specs, _mc(), CostOptions(context=256, reserve_ram_bytes=1000), "uniform")
    got = {s["host"]: s["mem_budget_bytes"] for s in p["stages"]}
    assert got == {"a": ram // 3 - 1000, "b": ram // 3 - 1000, "c": ram // 3 - 1000,
                   "other": ram - 1000, "solo": ram - 1000}
    assert sum(got[h] for h in "abc") <= ram
    # the same grouping decides threads and spin: three stages share box's cores
    shared = {s["host"]: s["shares_cores_with"] for s in p["stages"]}
    assert shared == {"a": 2, "b": 2, "c": 2, "other": 0, "solo": 0}
    # and how many micro-batches the engine keeps in flight: box's three stages at a core each (its
    # 4 cores hold them), and one each on other and solo
    assert Plan.from_dict(p).depth == 5
    live = {**p, "stages": [{**st, "endpoint": f"tcp://127.0.0.1:{5600 + i}"} for i, st in enumerate(p["stages"])]}
    from layerline.keys import local_keys
    kd = local_keys(str(tmp_path / "keys"), [s["host"] for s in p["stages"]])   # every pipeline runs CURVE
    with pipeline_for_plan(live, keys_dir=kd["controller"]) as pipe:  # what the server and the drive engine go by
        assert pipe.depth == 5
    # without a machine_id (an older probe) the hostname tells
    legacy = plan([spec("a", ram, hostname="box"), spec("b", ram, hostname="box")], _mc(),
                  CostOptions(context=256), "uniform")
    assert [s["mem_budget_bytes"] for s in legacy["stages"]] == [ram // 2, ram // 2]


def test_pipeline_depth_counts_core_groups():
    """CPU stages of one machine compute as many at once as its cores hold, a core each; each GPU
    computes on its own; a stage of an older plan, without a machine, counts alone."""
    def st(machine, device, threads, cores):
        return {"machine": machine, "device": device, "threads": threads, "cores": cores}
    assert pipeline_depth([st("m1", "cpu", 2, 2)] * 3) == 2
    assert pipeline_depth([st("m1", "cpu", 2, 2), st("m2", "cpu", 2, 2), st("m1", "cpu", 2, 2)]) == 3
    assert pipeline_depth([st("m1", "cpu", 1, 1)] * 3) == 1   # one core: they take turns
    assert pipeline_depth([st("m1", "cuda:0", 2, None), st("m1", "cuda:1", 2, None), st("m1", "cpu", 2, 2)]) == 3
    assert pipeline_depth([{"device": "cpu"}, {"device": "cpu"}]) == 2   # an older plan: no machine
    assert pipeline_depth([]) == 1
    assert pipeline_depth([st("m1", "cpu", 1, 2)] * 3) == 2
    assert pipeline_depth([st("m1", "cpu", 2, 8)] * 3) == 3
    assert pipeline_depth([st("m1", "cpu", None, None)] * 3) == 1   # unknown: take turns


def test_a_shared_stage_computes_a_message_on_its_share_of_the_cores():
    """Alone, a message gets all the stage's threads; beside others, the machine's cores split among
    the messages that may compute on them at once (never more than the stages sharing them), at
    least one each, never more than the stage's own threads."""
    assert message_threads(2, 2, 3, 1) == 2
    assert message_threads(2, 2, 3, 2) == 1
    assert message_threads(2, 2, 3, 9) == 1
    assert message_threads(16, 16, 3, 2) == 8
    assert message_threads(16, 16, 3, 7) == 5      # three stages: at most three compute at once
    assert message_threads(3, 8, 3, 3) == 2        # pinned threads: never more than pinned
    assert message_threads(2, 8, 3, 3) == 2
    assert message_threads(4, 2, 2, 2) == 1


def test_make_plan_leaves_its_inputs_alone():
    nodes, mc, opts = nodes_of([spec("a", BIG), spec("b", BIG)]), _mc(), CostOptions(context=256)
    before = (repr(nodes), repr(mc), repr(opts))
    p1 = make_plan(nodes, mc, opts)
    assert (repr(nodes), repr(mc), repr(opts)) == before
    assert make_plan(nodes, mc, opts) == p1


def test_tie_break_fewer_hops_then_faster_hosts():
    """Equal bottleneck: fewer hops first, then the faster hosts take the work (the README says so)."""
    mc = _mc()  # 8 equal layers
    # two layers over three equal hosts: a third stage would add a hop and nothing else
    mc = _mc(L=2)
    p = plan([spec("a", BIG), spec("b", BIG), spec("c", BIG)], mc, OPTS)
    assert [(s["host"], s["layers"]) for s in actives(p)] == [("a", [0, 1]), ("b", [1, 2])]
    # c (1.5x) must hold the head's stage; a (1x) or b (1.2x) may hold layer 0 at the same bottleneck
    # and the same hop count: the faster one, b, takes it, although a comes first
    speed = lambda k: dict(flops=1e12 * k, bw=1e11 * k)  # noqa: E731
    p = plan([spec("a", BIG, **speed(1.0)), spec("b", BIG, **speed(1.2)), spec("c", BIG, **speed(1.5))], mc, OPTS)
    assert [(s["host"], s["layers"]) for s in actives(p)] == [("b", [0, 1]), ("c", [1, 2])]


def test_shared_machine_budget_decides_fit():
    mc = _mc()
    need = mem(mc, OPTS, "bf16", 0, 8)
    box = dict(hostname="box", ram_total=10**10)
    # alone on the machine, one host holds the whole model
    assert len(actives(plan([spec("a", need + 1, **box)], mc, OPTS))) == 1
    # two hosts on that machine get half each, and no split of this model fits two halves
    shared = [spec("a", need + 1, **box), spec("b", need + 1, **box)]
    assert budgets(shared) == [(need + 1) // 2] * 2
    assert brute(shared, mc, OPTS, "bf16")[0] == math.inf
    with pytest.raises(PlanError):
        plan(shared, mc, OPTS)
    # the same two on separate machines: fits
    apart = [spec("a", need + 1), spec("b", need + 1)]
    check_plan(plan(apart, mc, OPTS), apart, mc, OPTS)


# --- plan_table -------------------------------------------------------------------------------------

def test_plan_table_lists_every_host_and_unmeasured_disk():
    specs = [spec("alpha", BIG, disk=None), spec("beta", BIG, disk=5 * 10**8, layers=(4, 8)),
             spec("gamma", BIG, role="standby", standby_for="beta", disk=0)]
    p = plan(specs, _mc(), OPTS)
    table = plan_table(Plan.from_dict(p))
    rows = {line.split()[0]: line for line in table.splitlines() if line.split()}
    for s in specs:
        assert s["host"] in rows, f"{s['host']} missing from table"
    assert "not measured" in rows["alpha"]
    assert "not measured" not in rows["beta"] and "MiB/s" in rows["beta"]
    assert "not measured" in rows["gamma"]          # 0 is not a measurement either
    assert "standby" in rows["gamma"] and "beta" in rows["gamma"]
    assert "bf16" in table


# --- experts paged from disk -------------------------------------------------------------------------

def _moe(layers=4, dense=1000, experts=8000, n_exp=8, top=2) -> ModelCost:
    return ModelCost(num_layers=layers, stored_precision="bf16", dense_params=[dense] * layers,
                     expert_params=[experts] * layers, rows=[10] * layers, embed_params=500, head_params=500,
                     num_experts=n_exp, experts_per_token=top, kv_width=8, hidden_size=4, vocab_size=100)


def test_experts_paged_only_from_a_measured_disk():
    mc, opts = _moe(), CostOptions(context=16)
    full = mem(mc, opts, "bf16", 0, 4)
    dense_only = full - 4 * 8000 * 2
    ram = (full + dense_only) // 2  # too small for every expert, big enough for the dense part
    with pytest.raises(PlanError, match="bytes short"):
        plan([spec("a", ram)], mc, opts)  # disk not measured: never costed as if it were
    p = plan([spec("a", ram, disk=1e8)], mc, opts)
    (s,) = actives(p)
    assert s["experts_paged"] and s["expert_cache_bytes"] > 0
    assert s["weight_bytes"] + s["kv_bytes"] + s["expert_cache_bytes"] == s["mem_budget_bytes"]
    # disk time: active expert bytes per token, scaled by the share the cache misses
    active_expert_bytes = 4 * 8000 * 2 / 8 * 2
    miss = 1 - s["expert_cache_bytes"] / (4 * 8000 * 2)
    assert close(s["disk_s"], active_expert_bytes * miss / 1e8)
    assert close(s["predicted_s"], s_time(mc, "bf16", 1e12, 1e11, 0, 4, 1) + s["disk_s"])
    assert "experts from disk" in plan_table(Plan.from_dict(p))
    # a faster disk is a faster stage; enough RAM means no paging at all
    faster = actives(plan([spec("a", ram, disk=1e9)], mc, opts))[0]
    assert faster["predicted_s"] < s["predicted_s"]
    roomy = actives(plan([spec("a", full, disk=1e8)], mc, opts))[0]
    assert not roomy["experts_paged"] and roomy["disk_s"] == 0


def test_planner_prefers_resident_experts_over_a_slow_disk():
    """Two hosts: one small with a slow disk, one roomy. Throughput keeps the experts in RAM."""
    mc, opts = _moe(), CostOptions(context=16)
    full = mem(mc, opts, "bf16", 0, 4)
    p = plan([spec("small", full // 3, disk=1e6), spec("big", full)], mc, opts)
    assert not any(s["experts_paged"] for s in actives(p))


def test_measured_step_factor_scales_the_mode_it_was_measured_for():
    mc = _mc()
    base = make_plan(nodes_of([spec("a", BIG, precision="int8")]), mc, OPTS)
    [st] = base.actives
    assert st.step_factor == 1.0
    c = caps(spec("a", BIG))
    c["devices"][0]["step_factors"] = {"int8/default": 0.5, "int8/off": 2.0, "bf16/default": 0.5}
    for compile, factor in (("default", 0.5), ("off", 2.0), ("max-autotune", 1.0)):
        n = Node(host="a", caps=NodeCaps.from_dict(c, "a"), precision="int8", compile=compile)
        [got] = make_plan([n], mc, OPTS).actives
        assert got.step_factor == factor
        assert got.predicted_s == pytest.approx(st.predicted_s * factor)
        assert dataclasses.replace(got, step_factor=1.0, predicted_s=st.predicted_s, compile="off",
                                   endpoint=st.endpoint) == st
    # a faster mode on one host draws layers to it (the factor is in the placement, not only the label)
    c2 = caps(spec("b", BIG))
    fast = dataclasses.replace(nodes_of([spec("a", BIG)])[0], caps=NodeCaps.from_dict(c, "a"), compile="default")
    c2["devices"][0]["step_factors"] = {"bf16/off": 1.0}
    p = make_plan([fast, Node(host="b", caps=NodeCaps.from_dict(c2, "b"), endpoint="tcp://127.0.0.1:9102")],
                  mc, OPTS, "auto")
    a, b = p.actives
    assert a.step_factor == 0.5 and b.step_factor == 1.0
    assert a.layers[1] - a.layers[0] > b.layers[1] - b.layers[0]
    # the factor travels in the plan's JSON
    assert make_plan([fast], mc, OPTS).to_dict()["stages"][0]["step_factor"] == 0.5


def test_a_plan_measured_after_launch_equals_the_next_plan():
    """deploy: plan, launch (workers time their step, the probe cache keeps the factor), the plan
    re-predicted from it; the next deploy plans exactly that, so it changes nothing."""
    from layerline.planner import with_measured_factors
    mc = _mc()
    specs = [spec("a", BIG), spec("b", BIG), spec("s", BIG, role="standby", standby_for="b")]
    first = plan(specs, mc, OPTS, "uniform")
    measured = {s["host"]: caps(s) for s in specs}
    for h, f in (("a", 0.37), ("b", 1.9)):
        measured[h]["devices"][0]["step_factors"] = {"bf16/off": f}
    got = with_measured_factors(Plan.from_dict(first), measured).to_dict()
    nodes = [dataclasses.replace(n, caps=NodeCaps.from_dict(measured[n.host], n.host)) for n in nodes_of(specs)]
    assert got == make_plan(nodes, mc, OPTS, "uniform").to_dict()
    assert [s["step_factor"] for s in got["stages"]] == [0.37, 1.9, 1.0]
    assert with_measured_factors(Plan.from_dict(got), measured).to_dict() == got, "measured again: the same plan"
    assert with_measured_factors(Plan.from_dict(first), {}).to_dict() == first


def test_hosts_on_one_machine_share_the_median_step_factor():
    """Four hosts on one machine: b's warm-up was measured while the others loaded (15x the
    model), e's in a quiet moment (0.3), c never measured. All four plan with the median, a's
    1.2, so b is not left out of this plan and, having no layers, never measured again, out of
    every later one, and e's luck does not make every stage's prediction short. Another machine
    keeps its own; of two, the lower middle one counts."""
    from layerline.planner import machine_step_factors, with_measured_factors
    mc = _mc()
    specs = [spec(h, BIG, machine_id="m1") for h in ("a", "b", "c", "e")] + [spec("d", BIG)]
    measured = {s["host"]: caps(s) for s in specs}
    for h, f in (("a", 1.2), ("b", 15.0), ("e", 0.3), ("d", 3.0)):
        measured[h]["devices"][0]["step_factors"] = {"bf16/off": f}
    nodes = [dataclasses.replace(n, caps=NodeCaps.from_dict(measured[n.host], n.host)) for n in nodes_of(specs)]
    for policy in ("uniform", "auto"):
        got = make_plan(nodes, mc, OPTS, policy).to_dict()
        factors = {s["host"]: s["step_factor"] for s in actives(got)}
        assert {h: factors.get(h) for h in "abce"} == dict.fromkeys("abce", 1.2), (policy, factors)
        assert factors.get("d") in (None, 3.0)
    first = plan(specs, mc, OPTS, "uniform")
    assert with_measured_factors(Plan.from_dict(first), measured).to_dict() == make_plan(nodes, mc, OPTS, "uniform").to_dict()
    two = [NodeCaps.from_dict(measured[h], h) for h in ("a", "b")]
    assert [f["bf16/off"] for f in machine_step_factors(two).values()] == [1.2]


def test_each_layer_adds_the_probed_fixed_cost_and_the_head_streams_at_its_bytes():
    """A stage's step is its streamed bytes at the probe's rate plus the probe's fixed seconds
    per layer: a stage of many small layers costs more than its bytes say, the LM head (one
    matrix) no more. Facts without the figure (an older probe) or with a broken one price
    bytes alone. int4 keeps its head at int8, so its head streams int8 bytes."""
    mc = _mc()
    L = mc.num_layers
    opts = CostOptions(context=256)
    for layer_s in (None, "x", -1.0, 2e-4):
        specs = [spec("a", BIG, layers=(0, L // 2), layer_s=layer_s),
                 spec("b", BIG, layers=(L // 2, L), layer_s=layer_s)]
        p = plan(specs, mc, opts, "manual")
        add = layer_s if isinstance(layer_s, float) and layer_s > 0 else 0.0
        for st in actives(p):  # noqa: F402 (the loop's stage; the strategies module is not used below)
            a, b = st["layers"]
            assert close(st["predicted_s"], s_time(mc, "bf16", 1e12, 1e11, a, b, 1) + (b - a) * add), (layer_s, st)
    head_only = mc.head_params + (mc.embed_params if mc.tied_embeddings else 0)
    for prec, per in (("int8", 1.0), ("int4", 1.0), ("bf16", 2.0)):
        st = actives(plan([spec("a", BIG, layers=(0, L - 1), precision=prec),
                           spec("b", BIG, layers=(L - 1, L), precision=prec)], mc, opts, "manual"))
        base = actives(plan([spec("a", BIG, layers=(0, L - 2), precision=prec),
                             spec("b", BIG, layers=(L - 2, L - 1), precision=prec),
                             spec("c", BIG, layers=(L - 1, L), precision=prec)], mc, opts, "manual"))
        # the last stage less the same layer alone (not last): what the head adds
        assert close(st[1]["predicted_s"] - base[1]["predicted_s"], head_only * per / 1e11), prec


def test_a_quantized_gguf_plans_at_its_stored_bytes():
    """Precision gguf (a quantized GGUF's default): each stage weighs and streams what its file stores."""
    from layerline.checkpoint import CheckpointIndex, TensorEntry
    from layerline.cost import head_read_bytes, model_cost
    h, v, L = 256, 1024, 4

    def e(name, shape, stype):
        n = math.prod(shape)
        stored = 4 * n if stype == "F32" else n // 32 * 18  # Q4_0: 32 weights in 18 bytes
        return TensorEntry(name, "F32" if stype == "F32" else "BF16", shape, "m.gguf",
                           n * (4 if stype == "F32" else 2), stored_type=stype, stored_bytes=stored, offset=0)
    entries = [e("model.embed_tokens.weight", (v, h), "Q4_0"), e("model.norm.weight", (h,), "F32")]
    for i in range(L):
        entries += [e(f"model.layers.{i}.input_layernorm.weight", (h,), "F32"),
                    e(f"model.layers.{i}.self_attn.k_proj.weight", (64, h), "Q4_0"),
                    e(f"model.layers.{i}.self_attn.v_proj.weight", (64, h), "Q4_0"),
                    e(f"model.layers.{i}.mlp.up_proj.weight", (4 * h, h), "Q4_0")]
    idx = CheckpointIndex("/synthetic.gguf", {"hidden_size": h, "vocab_size": v, "tie_word_embeddings": True,
                                              "gguf": {"file": "m.gguf"}}, {x.name: x for x in entries})
    mc = model_cost(idx)
    opts = CostOptions(context=64)
    p = plan([spec("a", 2**30, bw=1e9)], mc, opts)
    assert p["precision"] == "gguf"
    (st,) = actives(p)
    assert st["weight_bytes"] == idx.stored_bytes  # the tied embedding once
    # decode streams the stored layers and the stored head (the tied embedding), not bf16's bytes
    read = sum(mc.stored_dense_bytes) + head_read_bytes(mc, "gguf")
    assert st["predicted_s"] >= read / 1e9 and read < idx.total_bytes / 3
    table = plan_table(Plan.from_dict(p))
    assert "precision gguf (weights: the file's own blocks)" in table and " gguf " in table
    # the ladder may still go lower; a host may pin gguf on a ladder that names other rungs
    low = plan([spec("a", 2**30)], mc, CostOptions(context=64, precision_ladder=["int4"]))
    assert low["precision"] == "int4" and actives(low)[0]["weight_bytes"] > 0
    pinned = plan([spec("a", 2**30, precision="gguf")], mc, CostOptions(context=64, precision_ladder=["bf16"]))
    assert actives(pinned)[0]["precision"] == "gguf" and actives(pinned)[0]["weight_bytes"] == idx.stored_bytes
