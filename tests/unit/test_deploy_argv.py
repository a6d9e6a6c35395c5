"""layerline.inventory and layerline.spec: inventory variables -> planner nodes -> each host's worker argv (DESIGN's flags)."""
from __future__ import annotations

import re

import pytest

from layerline.cost import KV_DTYPE_BYTES, ModelCost
from layerline import inventory as hosts_inventory
from layerline.inventory import node_from_vars
from layerline.errors import LayerlineError
from layerline.planner import Plan, PlanError
from layerline.spec import worker_spec


def plan_for_hosts(*args, **kw) -> dict:
    """The plan as the playbooks hold it (JSON)."""
    return hosts_inventory.plan_for_hosts(*args, **kw).to_dict()


def worker_argv(plan: dict, host: str, hvars: dict, python: str = "python3") -> list[str]:
    """What the layerline_worker_spec filter hands a playbook: the JSON plan read as a Plan."""
    return list(worker_spec(Plan.from_dict(plan), host, hvars, python).argv)

GiB = 2**30
BOOL_FLAGS = {"--first", "--last"}


def caps(hostname: str, ram: int = 64 * GiB, gpu: bool = False) -> dict:
    devices = [{"name": "cpu", "kind": "cpu", "memory_bytes": ram, "memory_free_bytes": ram,
                "flops_per_s": 1e12, "mem_bw_bytes_per_s": 5e10}]
    if gpu:
        devices.append({"name": "cuda:0", "kind": "cuda", "memory_bytes": 24 * GiB, "memory_free_bytes": 20 * GiB,
                        "flops_per_s": 1e14, "mem_bw_bytes_per_s": 9e11})
    return {"addr": "127.0.0.1", "hostname": hostname, "os": "linux", "cores": 8, "ram_total_bytes": ram,
            "ram_available_bytes": ram, "disk_free_bytes": 10**12, "disk_read_bytes_per_s": None,
            "devices": devices, "probe_seconds": 0.2}


COST = ModelCost(num_layers=12, stored_precision="bf16", dense_params=[2 * 10**6] * 12, expert_params=[0] * 12,
                 rows=[3000] * 12, embed_params=10**6, head_params=10**6 + 256, kv_width=256, hidden_size=256,
                 vocab_size=4000)
OBJ = {"context": 1024, "precision_ladder": ["bf16"]}


def hv(name: str, port: int, addr: str | None = None, **kw) -> dict:
    d = {"layerline_port": port, "layerline_checkpoint": "/srv/ckpt", "layerline_rng_seed": 1234,
         "layerline_state_dir": f"/var/lib/layerline-{name}", "layerline_caps": caps(f"m-{name}")}
    if addr:
        d["ansible_host"] = addr
    else:
        d["ansible_connection"] = "local"
    d.update(kw)
    return d


def parse(argv: list[str]) -> dict:
    """--flag value pairs and bare boolean flags; every flag at most once."""
    assert argv[1:3] == ["-m", "layerline.worker"]
    out, i = {}, 3
    while i < len(argv):
        flag = argv[i]
        assert flag.startswith("--") and flag not in out, argv
        if flag in BOOL_FLAGS:
            out[flag] = True
            i += 1
        else:
            out[flag] = argv[i + 1]
            i += 2
    return out


@pytest.fixture
def inventory() -> dict:
    """Actives a, b, c with a standby and a draining host sitting between them in inventory order."""
    return {
        "a": hv("a", 9100, "10.0.0.1", layerline_layers="0:3"),
        "s": hv("s", 9100, "10.0.0.9", layerline_role="standby", layerline_standby_for="b"),
        "d": hv("d", 9100, "10.0.0.8", layerline_role="draining"),
        "b": hv("b", 9200, "10.0.0.2", layerline_layers="3:8", layerline_precision="int8"),
        "c": hv("c", 9300, "10.0.0.3", layerline_layers="8:12"),
    }


def test_argv_flags_follow_the_plan(inventory):
    plan = plan_for_hosts(inventory, COST.to_dict(), OBJ)
    stages = {s["host"]: s for s in plan["stages"]}
    assert set(stages) == {"a", "s", "b", "c"}
    ends = {"a": "tcp://10.0.0.1:9100", "b": "tcp://10.0.0.2:9200", "c": "tcp://10.0.0.3:9300",
            "s": "tcp://10.0.0.9:9100"}
    nxt = {"a": ends["b"], "b": ends["c"], "s": ends["c"], "c": None}
    for host, st in stages.items():
        argv = worker_argv(plan, host, inventory[host], python="/opt/venv/bin/python")
        assert argv[0] == "/opt/venv/bin/python"
        f = parse(argv)
        assert f["--checkpoint"] == "/srv/ckpt"
        assert f["--layers"] == f"{st['layers'][0]}:{st['layers'][1]}"
        assert f["--device"] == st["device"] == "cpu"
        assert f["--precision"] == st["precision"]
        assert f["--kv-context"] == "1024"
        assert f["--kv-dtype"] == st["kv_dtype"]
        assert f["--rng-seed"] == "1234"
        assert f["--bind"] == ends[host]
        assert f["--keys"].startswith(f"/var/lib/layerline-{host}")
        assert f.get("--next") == nxt[host], host
        assert f.get("--first", False) == (st["layers"][0] == 0)
        assert f.get("--last", False) == (st["layers"][1] == 12)
    # the pinned precision reaches the worker, and the standby runs its principal's
    assert parse(worker_argv(plan, "b", inventory["b"]))["--precision"] == "int8"
    assert parse(worker_argv(plan, "s", inventory["s"]))["--precision"] == "int8"
    assert parse(worker_argv(plan, "s", inventory["s"]))["--layers"] == "3:8"
    assert parse(worker_argv(plan, "a", inventory["a"]))["--precision"] == "bf16"


def test_next_hop_by_name_not_position():
    """The same hosts in another inventory order: each still points at its true successor."""
    inv = {
        "s1": hv("s1", 9400, "10.1.0.9", layerline_role="standby"),
        "x": hv("x", 9100, "10.1.0.1", layerline_layers="0:4"),
        "dr": hv("dr", 9500, "10.1.0.8", layerline_role="draining"),
        "y": hv("y", 9200, "10.1.0.2", layerline_layers="4:9"),
        "s2": hv("s2", 9600, "10.1.0.7", layerline_role="standby", layerline_standby_for="y"),
        "z": hv("z", 9300, "10.1.0.3", layerline_layers="9:12"),
    }
    plan = plan_for_hosts(inv, COST, OBJ)
    act = [s for s in plan["stages"] if s["role"] == "active"]
    assert [s["host"] for s in act] == ["x", "y", "z"]
    succ = {act[k]["host"]: act[k + 1]["endpoint"] for k in range(len(act) - 1)}
    for s in plan["stages"]:
        f = parse(worker_argv(plan, s["host"], inv[s["host"]]))
        principal = s["standby_for"] or s["host"]
        assert f.get("--next") == succ.get(principal), s["host"]
        assert "--last" in f if s["layers"][1] == 12 else "--last" not in f
    assert sum("--first" in parse(worker_argv(plan, s["host"], inv[s["host"]])) for s in act) == 1


def test_local_connection_binds_loopback_and_defaults():
    inv = {"w1": hv("w1", 9100), "w2": hv("w2", 9102)}
    for v in inv.values():
        del v["layerline_rng_seed"], v["layerline_state_dir"]
    plan = plan_for_hosts(inv, COST, {"context": 64, "kv_dtype": "fp32"}, policy="uniform")
    f1, f2 = (parse(worker_argv(plan, h, inv[h])) for h in ("w1", "w2"))
    assert (f1["--bind"], f2["--bind"]) == ("tcp://127.0.0.1:9100", "tcp://127.0.0.1:9102")
    assert f1["--next"] == "tcp://127.0.0.1:9102" and "--next" not in f2
    assert f1["--kv-dtype"] == f2["--kv-dtype"] == "fp32" and f1["--kv-context"] == "64"
    assert f1["--rng-seed"] == "0"
    assert f1["--layers"] == "0:6" and f2["--layers"] == "6:12"


def test_kv_dtype_matches_what_the_stage_was_costed_at(inventory):
    plan = plan_for_hosts(inventory, COST, OBJ)
    for s in plan["stages"]:
        f = parse(worker_argv(plan, s["host"], inventory[s["host"]]))
        n_layers = s["layers"][1] - s["layers"][0]
        worker_kv = COST.kv_width * KV_DTYPE_BYTES[f["--kv-dtype"]] * int(f["--kv-context"]) * n_layers
        assert worker_kv == s["kv_bytes"], s["host"]


# --- errors ------------------------------------------------------------------------------------------

def test_host_not_in_plan(inventory):
    plan = plan_for_hosts(inventory, COST, OBJ)
    for host in ("d", "nowhere"):
        with pytest.raises(LayerlineError) as ei:
            worker_argv(plan, host, inventory.get(host, {}))
        assert host in str(ei.value) and "\n" not in str(ei.value)


def test_missing_checkpoint_var(inventory):
    plan = plan_for_hosts(inventory, COST, OBJ)
    del inventory["a"]["layerline_checkpoint"]
    with pytest.raises(LayerlineError, match="layerline_checkpoint"):
        worker_argv(plan, "a", inventory["a"])


def test_missing_caps():
    with pytest.raises(LayerlineError) as ei:
        node_from_vars("w9", {"layerline_port": 9100}, None)
    assert "w9" in str(ei.value) and "probe" in str(ei.value)
    inv = {"w1": hv("w1", 9100), "w2": hv("w2", 9102)}
    del inv["w2"]["layerline_caps"]
    with pytest.raises(LayerlineError) as ei:
        plan_for_hosts(inv, COST, OBJ)
    assert "w2" in str(ei.value)


@pytest.mark.parametrize("port", ["abc", 0, -1, 65535, 70000, "91.5"])
def test_bad_port(port):
    with pytest.raises(LayerlineError) as ei:
        node_from_vars("w1", hv("w1", port), caps("m"))
    msg = str(ei.value)
    assert "layerline_port" in msg and "w1" in msg and "\n" not in msg


def test_node_from_vars_fields():
    n = node_from_vars("g", hv("g", 9100, "10.2.0.5", layerline_device="cuda+cpu", layerline_layers="2:5",
                                layerline_precision="int8", layerline_role="standby",
                                layerline_standby_for="h", layerline_max_ram_gb=1.5), caps("m", gpu=True))
    assert (n.host, n.device, n.layers, n.precision, n.role, n.standby_for) == \
        ("g", "cuda:0", (2, 5), "int8", "standby", "h")
    assert n.max_ram_bytes == int(1.5 * GiB)
    assert n.endpoint == "tcp://10.2.0.5:9100"
    d = node_from_vars("h", {"ansible_connection": "local"}, caps("m"))
    assert (d.device, d.role, d.layers, d.endpoint) == ("cpu", "active", None, "tcp://127.0.0.1:9100")


@pytest.mark.parametrize("value", ["2-5", "5:2", "a:b", "3"])
def test_bad_layers_pin(value):
    with pytest.raises(PlanError) as ei:
        node_from_vars("w1", hv("w1", 9100, layerline_layers=value), caps("m"))
    assert "layerline_layers" in str(ei.value) and "w1" in str(ei.value)


def test_bad_max_ram():
    with pytest.raises(LayerlineError, match="layerline_max_ram_gb"):
        node_from_vars("w1", hv("w1", 9100, layerline_max_ram_gb="lots"), caps("m"))


def test_bad_objective_surfaces_as_one_line():
    inv = {"w1": hv("w1", 9100)}
    with pytest.raises(LayerlineError) as ei:
        plan_for_hosts(inv, COST, {"optimize": "speed"})
    assert "layerline_objective.optimize" in str(ei.value)
    with pytest.raises(PlanError, match="inventory"):
        plan_for_hosts({}, COST, OBJ)


def test_hop_cost_is_the_measured_round_trip(inventory):
    """With no hop_secs set, the plan's hop is the median round trip the probes measured."""
    for i, h in enumerate(inventory):
        inventory[h]["layerline_caps"]["rtt_s"] = {f"10.0.0.{j}:22": 0.001 * (i + j) for j in range(3)}
    rtts = sorted(0.001 * (i + j) for i in range(len(inventory)) for j in range(3))
    plan = plan_for_hosts(inventory, COST.to_dict(), {k: v for k, v in OBJ.items() if k != "hop_secs"})
    assert plan["hop"]["s"] == rtts[len(rtts) // 2] and plan["hop"]["source"].startswith("measured")
    acts = [s for s in plan["stages"] if s["role"] == "active"]
    assert plan["predicted_token_s"] == pytest.approx(sum(s["predicted_s"] for s in acts)
                                                      + plan["hop"]["s"] * (len(acts) + 1))
    pinned = plan_for_hosts(inventory, COST.to_dict(), {**OBJ, "hop_secs": 0.25})
    assert pinned["hop"] == {"s": 0.25, "source": "layerline_objective.hop_secs"}


def test_peers_leave_out_local_hosts():
    from layerline.inventory import peers_of
    hv = {"a": {"ansible_host": "10.0.0.1"}, "b": {"ansible_host": "10.0.0.2", "ansible_port": 2222},
          "c": {"ansible_connection": "local"}}
    assert peers_of(hv, "a") == ["10.0.0.2:2222"]
    assert peers_of(hv, "c") == ["10.0.0.1:22", "10.0.0.2:2222"]


def test_measure_rtt_on_loopback():
    import socket as so
    from layerline.probe import measure_rtt
    srv = so.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    try:
        out = measure_rtt([f"127.0.0.1:{port}", "127.0.0.1:1"], timeout_s=0.2)
    finally:
        srv.close()
    assert 0 < out[f"127.0.0.1:{port}"] < 0.2 and out["127.0.0.1:1"] is None


def test_threads_spin_and_compile_follow_where_the_plan_puts_stages():
    """Stages on one machine (same probed hostname) sleep at once when idle; a lone one may spin."""
    inv = {"w1": hv("w1", 9100), "w2": hv("w2", 9102, layerline_compile="max-autotune"),
           "far": hv("far", 9100, "10.0.0.5", layerline_threads=3)}
    for h in ("w1", "w2"):
        inv[h]["layerline_caps"] = caps("box")
    plan = plan_for_hosts(inv, COST, OBJ)
    st = {s["host"]: s for s in plan["stages"]}
    assert st["w1"]["shares_cores_with"] == st["w2"]["shares_cores_with"] == 1
    assert st["far"]["shares_cores_with"] == 0
    f = {h: parse(worker_argv(plan, h, inv[h])) for h in inv}
    assert f["w1"]["--threads"] == f["w2"]["--threads"] == "8"  # the probed cores: all of them alone
    assert f["far"]["--threads"] == "3"                           # the host's own setting wins
    # beside each other, a message computes on its share of the 8 cores (planner.message_threads)
    assert f["w1"]["--cores"] == f["w2"]["--cores"] == "8" and f["w1"]["--sharing"] == f["w2"]["--sharing"] == "2"
    assert "--cores" not in f["far"] and "--sharing" not in f["far"]
    assert int(f["w1"]["--spin"]) < int(f["far"]["--spin"])
    # a lone stage keeps its CPUs awake between messages; stages that share cores do not
    assert f["w1"]["--awake-ms"] == f["w2"]["--awake-ms"] == "0" and "--awake-ms" not in f["far"]
    # and time their steps one at a time (layerline.timing_lock); a lone stage needs no lock.
    # One lock per deployment: another deployment's (or test's) workers never wait on them.
    lock = f["w1"]["--time-alone"]
    assert lock == f["w2"]["--time-alone"] and "/" not in lock and "--time-alone" not in f["far"]
    inv2 = {h: {**v, "layerline_port": v["layerline_port"] + 50} for h, v in inv.items()}
    plan2 = plan_for_hosts(inv2, COST, OBJ)
    assert parse(worker_argv(plan2, "w1", inv2["w1"]))["--time-alone"] != lock
    assert "--compile" not in f["w1"] and f["w2"]["--compile"] == "max-autotune"
    assert f["w2"]["--compile-cache"].startswith("/var/lib/layerline-w2/")
    assert st["w2"]["compile"] == "max-autotune" and st["w1"]["compile"] == "off"


@pytest.mark.parametrize("argv, error", [(["--cores", "2"], "--cores and --sharing go together"),
                                         (["--sharing", "3"], "--cores and --sharing go together"),
                                         (["--cores", "0", "--sharing", "3"], "--cores and --sharing must be 1-4096")])
def test_a_share_of_cores_needs_both_flags_in_range(argv, error, capsys):
    from layerline.worker.cli import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(["--checkpoint", "x", "--layers", "0:1", "--last", "--bind", "tcp://127.0.0.1:1", *argv])
    assert e.value.code == 2 and error in capsys.readouterr().err
    a = parse_args(["--checkpoint", "x", "--layers", "0:1", "--last", "--bind", "tcp://127.0.0.1:1",
                    "--cores", "2", "--sharing", "3"])
    assert (a.cores, a.sharing) == (2, 3)


def test_nice_reaches_the_worker_argv_only_when_set():
    inv = {"w1": hv("w1", 9100, layerline_nice=10), "w2": hv("w2", 9102, layerline_nice=0)}
    plan = plan_for_hosts(inv, COST, OBJ)
    f = {h: parse(worker_argv(plan, h, inv[h])) for h in inv}
    assert f["w1"]["--nice"] == "10" and "--nice" not in f["w2"]


@pytest.mark.parametrize("value", [-1, 20, "low", 2.5])
def test_bad_nice_names_the_variable(value):
    inv = {"w1": hv("w1", 9100, layerline_nice=value), "w2": hv("w2", 9102)}
    with pytest.raises(LayerlineError, match=r"w1: layerline_nice .* must be an integer 0-19"):
        worker_argv(plan_for_hosts(inv, COST, OBJ), "w1", inv["w1"])


@pytest.mark.parametrize("key,value", [("layerline_compile", "fast"), ("layerline_threads", 0),
                                       ("layerline_threads", "many")])
def test_bad_thread_or_compile_vars_name_the_variable(key, value):
    inv = {"w1": hv("w1", 9100, **{key: value}), "w2": hv("w2", 9102)}
    with pytest.raises(PlanError, match=key):
        plan_for_hosts(inv, COST, OBJ)


def test_hosts_sharing_a_kernel_share_cores_whatever_their_names():
    """Namespace hosts and containers have their own hostnames but one machine's cores."""
    inv = {h: hv(h, 9100 + 2 * i, f"10.0.0.{i + 1}") for i, h in enumerate(("n1", "n2", "n3"))}
    for h in ("n1", "n2"):
        inv[h]["layerline_caps"]["machine_id"] = "boot-a"
    inv["n3"]["layerline_caps"]["machine_id"] = "boot-b"
    st = {s["host"]: s for s in plan_for_hosts(inv, COST, OBJ)["stages"]}
    assert [st[h]["shares_cores_with"] for h in ("n1", "n2", "n3")] == [1, 1, 0]
    assert st["n1"]["spin"] == st["n2"]["spin"] < st["n3"]["spin"]


def test_check_vars_names_what_no_plan_takes_without_facts_or_model():
    """deploy.yml's first check: the plan's own checks that need neither probes nor the model."""
    loc = {"ansible_connection": "local"}
    good = {"w1": {**loc, "layerline_port": 9100}, "w2": {**loc, "layerline_port": 9110, "layerline_precision": "int8"}}
    hosts_inventory.check_vars(good, {"optimize": "latency"}, "uniform", 1)
    for host_vars, objective, policy, says in (
            ({**good, "w2": {**loc, "layerline_port": 9110, "layerline_precision": "int3"}}, None, None,
             "w2: layerline_precision 'int3' is not one of"),
            ({**good, "w2": {**loc, "layerline_port": 9101}}, None, None, "w2: layerline_port 9101 on 127.0.0.1 collides"),
            ({**good, "w1": {**loc, "layerline_port": 9100, "layerline_threads": 0}}, None, None, "w1: layerline_threads 0"),
            ({**good, "w1": {**loc, "layerline_port": 9100, "layerline_role": "spare"}}, None, None, "w1: layerline_role 'spare'"),
            (good, {"context": 0}, None, "layerline_objective.context: 0 must be a positive integer"),
            (good, None, "fastest", "layerline_policy: 'fastest' is not one of"),
            ({}, None, None, "inventory: no hosts to plan for")):
        with pytest.raises(LayerlineError, match=re.escape(says)):
            hosts_inventory.check_vars(host_vars, objective, policy)


def test_the_route_decides_what_is_planned():
    """plan.yml hands the route over (layerline_route_plan): the in-place plan where there is one, else a plan
    of the play's hosts in the route's order with its drained hosts left out."""
    from layerline.inventory import plan_for_route
    inv = {h: hv(h, 9100 + 10 * i) for i, h in enumerate(("w1", "w2", "w3"))}
    cost = COST.to_dict()
    kept = {"stages": [{"host": "w9"}]}
    assert plan_for_route(inv, cost, {"plan": kept, "order": ["w1"], "drained": []}) is kept
    plan = plan_for_route(inv, cost, {"plan": None, "order": ["w3", "w1", "w2"], "drained": ["w2"]})
    assert [s["host"] for s in plan["stages"]] == ["w3", "w1"], "route order, drained host left out"
    assert plan_for_route(inv, cost, {"order": ["w1", "w2", "w3", "gone"], "drained": []}) == plan_for_hosts(inv, cost)
