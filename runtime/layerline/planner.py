"""Placement: which contiguous layers each host holds, at which precision, with which KV reserve.

Pure functions over data. Hosts keep the order they are given in (the pipeline order, which
the inventory controls to keep hops short); pinned ranges are honoured. For that order the
placement is exact for its objective:

- throughput: smallest slowest-stage time, by bisection over the bottleneck with a greedy
  feasibility check (each host takes as many layers as fit the candidate time and its memory;
  stage cost is monotone in the range, so the greedy is optimal for a fixed order);
- latency: smallest sum of stage times and hops, by dynamic programming over (host, layer);
- memory: fewest machines (the greedy at unbounded time), then balanced among those.

The precision ladder is stepped down only as far as needed; nothing fitting ends in one line
that says how many bytes are short at the last rung.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .caps import CapsError, NodeCaps
from .cost import (PRECISION_BYTES, CostOptions, KvProfile, ModelCost, edge_bytes, edge_flops, factor_for,
                   head_read_bytes, kv_profile, read_bytes, usable_factor, weight_bytes)
from .errors import LayerlineError
from .model import COMPILE_MODES  # how a worker runs its step: the model's to say
from .precision import PRECISIONS

POLICIES = ("auto", "ram_balanced", "uniform", "manual")
ROLES = ("active", "standby", "draining")
GiB = 2**30
DEFAULT_HOP_S = 0.0005  # per hop, when no round trip was measured and layerline_objective.hop_secs is unset
SPIN_SHARED = 10_000    # OpenMP spins before sleeping: short, so an idle stage frees the cores
SPIN_ALONE = 300_000    # libgomp's own default: a stage alone on its machine may spin


class PlanError(LayerlineError):
    """No valid plan: the text names the host or field, and what would make it fit."""


@dataclass(frozen=True)
class Node:
    """One host as the planner sees it: probed caps plus its inventory knobs."""
    host: str
    caps: NodeCaps
    device: str = "cpu"
    role: str = "active"
    layers: tuple[int, int] | None = None     # pinned [start, end)
    precision: str | None = None               # pinned precision
    standby_for: str | None = None
    max_ram_bytes: int | None = None
    endpoint: str | None = None
    threads: int | None = None                 # pinned CPU threads; default: the host's cores
    compile: str = "off"                       # the worker's decode step: eager or torch.compile'd

    def __post_init__(self):
        if not isinstance(self.caps, NodeCaps):  # JSON from a probe: typed once, here
            object.__setattr__(self, "caps", NodeCaps.from_dict(self.caps, self.host))


@dataclass(frozen=True)
class _Host:
    """A node with what the planner derived for it: its memory budget and measured speeds."""
    node: _Host
    budget: int
    flops: float
    mem_bw: float
    disk_bw: float | None
    step_factors: dict | None = None     # the probe cache's measured step / model, per mode
    layer_s: float = 0.0                 # the probe's fixed seconds per layer per step (0: not measured)

    def factor(self, precision: str) -> float:
        """What this host's steps at `precision` (and its compile mode) measured against the model."""
        return factor_for(self.step_factors, precision, self.node.compile)

    @property
    def host(self) -> str:
        return self.node.host

    @property
    def layers(self):
        return self.node.layers

    @property
    def precision(self):
        return self.node.precision


@dataclass(frozen=True)
class StagePlan:
    """One worker of the plan: everything its launch needs."""
    host: str
    role: str                        # active | standby
    layers: tuple[int, int]          # [start, end)
    device: str
    precision: str
    weight_bytes: int
    kv_bytes: int
    kv_dtype: str
    mem_budget_bytes: int
    predicted_s: float
    endpoint: str | None = None
    standby_for: str | None = None
    step_factor: float = 1.0         # the measured factor predicted_s includes (cost.step_factor)
    experts_paged: bool = False
    expert_cache_bytes: int = 0
    disk_s: float = 0.0
    disk_read_bytes_per_s: float | None = None
    machine: str | None = None       # hosts with the same machine share its cores and RAM
    compile: str = "off"
    threads: int | None = None
    shares_cores_with: int = 0       # other CPU stages on this machine
    cores: int | None = None         # its machine's cores (CPU stages): with threads, how many stages compute at once
    spin: int | None = None          # OpenMP spin before sleeping (GOMP_SPINCOUNT)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"layers": list(self.layers)}

    @classmethod
    def from_dict(cls, d: dict) -> "StagePlan":
        try:
            kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
            kw["layers"] = (int(d["layers"][0]), int(d["layers"][1]))
            return cls(**kw)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise PlanError(f"plan: a stage is malformed ({e!r}); re-plan (playbooks/plan.yml or `layerline plan`)") from None


@dataclass(frozen=True)
class Plan:
    """The plan (DESIGN's contract); JSON only at the Ansible and CLI boundary (to_dict / from_dict)."""
    precision: str
    objective: str
    policy: str
    kv: KvProfile
    num_layers: int
    stages: tuple[StagePlan, ...]
    predicted_token_s: float
    bottleneck_s: float
    hop_s: float
    hop_source: str

    @property
    def actives(self) -> list[StagePlan]:
        return [s for s in self.stages if s.role == "active"]

    @property
    def depth(self) -> int:
        """Micro-batches the engine keeps in flight through the actives (pipeline_depth)."""
        return pipeline_depth(self.actives)

    def stage(self, host: str) -> StagePlan | None:
        """This host's stage (looked up by name, never by position)."""
        return next((s for s in self.stages if s.host == host), None)

    def next_of(self, stage: StagePlan) -> StagePlan | None:
        """The active stage that takes this stage's output (standbys feed the same next hop)."""
        return next((s for s in self.actives if s.layers[0] == stage.layers[1]), None)

    def placement(self) -> dict:
        """What the plan places where (hosts, roles, layers, devices, precisions, endpoints): a change here changes
        the deployment; the predictions that follow measured step times do not (layerline_save's changed, --diff)."""
        return {"precision": self.precision, "kv": dataclasses.asdict(self.kv),
                "stages": [{"host": s.host, "role": s.role, "layers": list(s.layers), "device": s.device,
                            "precision": s.precision, "endpoint": s.endpoint, "standby_for": s.standby_for}
                           for s in self.stages]}

    def to_dict(self) -> dict:
        return {"precision": self.precision, "objective": self.objective, "policy": self.policy,
                "kv": dataclasses.asdict(self.kv), "num_layers": self.num_layers,
                "stages": [s.to_dict() for s in self.stages],
                "predicted_token_s": self.predicted_token_s, "bottleneck_s": self.bottleneck_s,
                "hop": {"s": self.hop_s, "source": self.hop_source}}

    @classmethod
    def from_dict(cls, d) -> "Plan":
        if isinstance(d, Plan):
            return d
        try:
            kv = d["kv"]
            hop = d.get("hop") or {}
            plan = cls(precision=str(d["precision"]), objective=str(d["objective"]), policy=str(d.get("policy", "auto")),
                       kv=KvProfile(int(kv["context"]), str(kv["dtype"]), int(kv["bytes_per_token"]),
                                    str(kv.get("source", "index"))),
                       num_layers=int(d["num_layers"]), stages=tuple(StagePlan.from_dict(s) for s in d["stages"]),
                       predicted_token_s=float(d["predicted_token_s"]), bottleneck_s=float(d["bottleneck_s"]),
                       hop_s=float(hop.get("s", DEFAULT_HOP_S)), hop_source=str(hop.get("source", "default")))
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"plan: malformed ({e!r}); re-plan (playbooks/plan.yml or `layerline plan`)") from None
        validate_plan(plan)
        return plan


@dataclass
class _Table:
    """Prefix sums per precision so a stage's cost is O(1)."""
    cost: ModelCost
    precision: str
    kv_per_layer: int                    # bytes for one layer's KV window (context x batch)
    kv_dtype: str = ""
    wsum: list[int] = field(default_factory=list)
    fsum: list[float] = field(default_factory=list)

    def __post_init__(self):
        c, p = self.cost, self.precision
        self.wsum, self.fsum, self.dsum, self.esum, self.rsum = [0], [0.0], [0], [0.0], [0.0]
        for i in range(c.num_layers):
            self.wsum.append(self.wsum[-1] + weight_bytes(c, i, p))
            self.dsum.append(self.dsum[-1] + weight_bytes(c, i, p, experts=False))
            # FLOPs per token: dense + the active experts' share
            self.fsum.append(self.fsum[-1] + 2.0 * c.active_params(i))
            # expert bytes one token reads
            dense, experts = read_bytes(c, i, p)
            self.esum.append(self.esum[-1] + experts)
            self.rsum.append(self.rsum[-1] + dense + experts)
        # a paged stage keeps at least one layer's active experts resident
        self.min_cache = max((self.esum[i + 1] - self.esum[i] for i in range(c.num_layers)), default=0.0)

    def weight(self, a: int, b: int) -> int:
        L = self.cost.num_layers
        return self.wsum[b] - self.wsum[a] + edge_bytes(self.cost, self.precision, a == 0, b == L)

    def mem(self, a: int, b: int) -> int:
        """Bytes with every weight resident."""
        return self.weight(a, b) + (b - a) * self.kv_per_layer

    def paged_mem(self, a: int, b: int) -> int:
        """Bytes when routed experts are read from disk: dense weights, KV, and the expert cache floor."""
        L = self.cost.num_layers
        dense = self.dsum[b] - self.dsum[a] + edge_bytes(self.cost, self.precision, a == 0, b == L)
        return int(dense + (b - a) * self.kv_per_layer + self.min_cache)

    def paged(self, node: _Host, a: int, b: int) -> bool:
        """True when the stage fits only by paging its experts (never on an unmeasured disk)."""
        return (self.mem(a, b) > node.budget and node.disk_bw is not None
                and self.wsum[b] - self.wsum[a] > self.dsum[b] - self.dsum[a]
                and self.paged_mem(a, b) <= node.budget)

    def fits(self, node: _Host, a: int, b: int) -> bool:
        return self.mem(a, b) <= node.budget or self.paged(node, a, b)

    def disk_time(self, node: _Host, a: int, b: int) -> float:
        """Expert bytes a token reads from disk: the share the LRU cache misses (uniform routing)."""
        if not self.paged(node, a, b):
            return 0.0
        experts = (self.wsum[b] - self.wsum[a]) - (self.dsum[b] - self.dsum[a])
        cache = node.budget - (self.paged_mem(a, b) - self.min_cache)
        miss = max(0.0, 1.0 - cache / experts)
        return (self.esum[b] - self.esum[a]) * miss / node.disk_bw

    def time(self, node: _Host, a: int, b: int, batch: int) -> float:
        L = self.cost.num_layers
        flops = (self.fsum[b] - self.fsum[a] + edge_flops(self.cost, b == L)) * batch
        # decode reads each weight once per step: dense bytes + the active experts' bytes
        read = self.rsum[b] - self.rsum[a]
        if b == L:
            read += head_read_bytes(self.cost, self.precision)
        # each layer's fixed cost (its ops, norms, attention) on top of the bytes it streams
        model = max(flops / node.flops, read / node.mem_bw) + (b - a) * node.layer_s
        return model * node.factor(self.precision) + self.disk_time(node, a, b) * batch


def parse_layers(value, host: str) -> tuple[int, int] | None:
    if value in (None, ""):
        return None
    try:
        a, b = (int(x) for x in str(value).split(":"))
    except ValueError:
        raise PlanError(f"{host}: layerline_layers {value!r} must be \"A:B\" (half-open: layers A to B-1)") from None
    if not 0 <= a < b:
        raise PlanError(f"{host}: layerline_layers {value!r} must have 0 <= A < B")
    return a, b


def _hosts(nodes: list[Node], opts: CostOptions) -> list[_Host]:
    """Budget and speeds per node. Hosts on one machine (NodeCaps.machine) share its RAM, unless a
    memory cgroup gives each its own (NodeCaps.ram_capped)."""
    share: dict[str, int] = {}
    for n in nodes:
        if n.role != "draining" and n.device == "cpu" and not n.caps.ram_capped:
            share[n.caps.machine] = share.get(n.caps.machine, 0) + 1
    shared = machine_step_factors(n.caps for n in nodes)
    out = []
    for n in nodes:
        try:
            d = n.caps.device(n.device, n.host)
        except CapsError as e:
            raise PlanError(str(e)) from None
        for key in ("flops_per_s", "mem_bw_bytes_per_s"):
            v = getattr(d, key)
            if not isinstance(v, (int, float)) or v <= 0:
                raise PlanError(f"{n.host}: device {n.device} has no measured {key}; re-run the probe")
        if n.device == "cpu":
            avail = n.caps.ram_available_bytes
            if not isinstance(avail, int):
                raise PlanError(f"{n.host}: probe facts have no ram_available_bytes; re-run the probe")
            budget = avail // (1 if n.caps.ram_capped else max(1, share.get(n.caps.machine, 1))) - opts.reserve_ram_bytes
        else:
            budget = int(d.memory_free_bytes or d.memory_bytes or 0) - opts.reserve_ram_bytes
        if n.max_ram_bytes is not None:
            budget = min(budget, n.max_ram_bytes)
        out.append(_Host(n, max(0, int(budget)), float(d.flops_per_s), float(d.mem_bw_bytes_per_s),
                         n.caps.disk_read_bytes_per_s, shared.get((n.caps.machine, d.name), d.step_factors),
                         d.layer_overhead_s or 0.0))
    return out


def machine_step_factors(caps) -> dict[tuple, dict]:
    """(machine, device name) -> the step factors every host on that machine plans that device
    with: per mode, the median of what they measured, the lower middle one of an even count
    (NodeCaps.machine; hosts without one keep their own). Stages that share a machine slow each
    other's warm-up (three workers loading or compiling at once), and a host that got no layers
    never measures again, so one disturbed warm-up would otherwise keep it out of every later
    plan; an unusually fast one (a quiet moment of a busy machine) is as far off the other way,
    and would make every stage's prediction short (bench/bench_predicted.py read 38% short with
    the smallest, within 20% with the median)."""
    seen: dict[tuple, dict] = {}
    for nc in caps:
        if not nc.machine:
            continue
        for d in nc.devices:
            mine = seen.setdefault((nc.machine, d.name), {})
            for mode, v in (d.step_factors if isinstance(d.step_factors, dict) else {}).items():
                if usable_factor(v):
                    mine.setdefault(mode, []).append(v)
    return {k: {mode: sorted(vs)[(len(vs) - 1) // 2] for mode, vs in modes.items()} for k, modes in seen.items()}


def hop_cost(nodes: list[Node], opts: CostOptions) -> tuple[float, str]:
    """Seconds per hop and where that figure came from: the objective, the hosts' measured
    round trips (their median), or a default."""
    if opts.hop_s is not None:
        return float(opts.hop_s), "layerline_objective.hop_secs"
    rtts = sorted(v for n in nodes for v in n.caps.round_trips())
    if rtts:
        return rtts[len(rtts) // 2], f"measured ({len(rtts)} round trips)"
    return DEFAULT_HOP_S, "default"


# --- placement for one precision -----------------------------------------------------------

def _fits(tab: _Table, n: _Host, a: int, b: int, limit: float, batch: int) -> bool:
    return tab.fits(n, a, b) and tab.time(n, a, b, batch) <= limit


def _greedy(tabs: list[_Table], nodes: list[_Host], limit: float, batch: int) -> list[tuple[int, int]] | None:
    """Each host in order takes as many layers as fit `limit` and its memory; None if not all fit."""
    L = tabs[0].cost.num_layers
    pins = [n.layers for n in nodes]
    stops, nxt = [L] * len(nodes), L  # where the next pinned range starts, per host
    for k in range(len(nodes) - 1, -1, -1):
        stops[k] = nxt
        if pins[k]:
            nxt = pins[k][0]
    out, a = [], 0
    for k, (n, tab) in enumerate(zip(nodes, tabs)):
        if pins[k]:
            pa, pb = pins[k]
            if pa != a or not _fits(tab, n, pa, pb, limit, batch):
                return None
            out.append((pa, pb))
            a = pb
            continue
        b, stop = a, stops[k]
        while b < stop and _fits(tab, n, a, b + 1, limit, batch):
            b += 1
        out.append((a, b))
        a = b
    return out if a == L else None


def _bottleneck(tabs, nodes, ranges, batch) -> float:
    return max((t.time(n, a, b, batch) for t, n, (a, b) in zip(tabs, nodes, ranges) if b > a), default=0.0)


def _throughput(tabs, nodes, batch) -> list[tuple[int, int]] | None:
    """Smallest bottleneck; among splits that reach it, fewest hops, then least total stage time
    (the faster hosts take the work)."""
    best = _greedy(tabs, nodes, math.inf, batch)
    if best is None:
        return None
    hi = _bottleneck(tabs, nodes, best, batch)
    lo = 0.0
    for _ in range(100):
        if hi - lo <= hi * 1e-12:
            break
        mid = (lo + hi) / 2
        r = _greedy(tabs, nodes, mid, batch)
        if r is None:
            lo = mid
        else:
            best, hi = r, _bottleneck(tabs, nodes, r, batch)
    if len(nodes) * tabs[0].cost.num_layers > _TIE_BREAK_MAX_WORK:
        return best  # very large clusters: ties go to the hosts first in pipeline order (the greedy's)
    limit = hi * (1 + 1e-9)

    def price(n, tab, a, b):  # lexicographic (hosts used, seconds): a host costs more than any time
        t = tab.time(n, a, b, batch)
        return math.inf if t > limit else _HOST_PRICE + t
    return _ordered_dp(tabs, nodes, price) or best


_HOST_PRICE = 1e6  # seconds: more than any sum of stage times
_TIE_BREAK_MAX_WORK = 50_000  # hosts x layers up to which ties are broken by the DP (~0.1 s)


def _ordered_dp(tabs, nodes, price) -> list[tuple[int, int]] | None:
    """Least total price of a contiguous split over hosts in order (any unpinned host may be
    skipped); price(node, tab, a, b) is what giving layers [a, b) to that host adds (inf: not
    allowed, nor is any longer range from a)."""
    L = tabs[0].cost.num_layers
    inf = math.inf
    best = [0.0] + [inf] * L          # best[b]: least price covering layers [0, b)
    choice: list[list[int]] = []
    for n, tab in zip(nodes, tabs):
        new, pick = best[:], list(range(L + 1))  # pick[b] == b: host unused
        if n.layers:  # a pinned host is always used, for its range
            pa, pb = n.layers
            new = [inf] * (L + 1)
            if best[pa] < inf and tab.fits(n, pa, pb):
                new[pb], pick[pb] = best[pa] + price(n, tab, pa, pb), pa
        else:
            for a in range(L):
                if best[a] == inf:
                    continue
                for b in range(a + 1, L + 1):
                    if not tab.fits(n, a, b):
                        break
                    p = price(n, tab, a, b)
                    if p == inf:  # stage cost only grows with b: nothing further fits either
                        break
                    t = best[a] + p
                    if t < new[b]:
                        new[b], pick[b] = t, a
        best = new
        choice.append(pick)
    if best[L] == inf:
        return None
    ranges, b = [], L
    for pick in reversed(choice):
        a = pick[b]
        ranges.append((a, b))
        b = a
    return list(reversed(ranges))


def _latency(tabs, nodes, batch, hop_s) -> list[tuple[int, int]] | None:
    """Least sum of stage times and hops."""
    return _ordered_dp(tabs, nodes, lambda n, tab, a, b: tab.time(n, a, b, batch) + hop_s)


def _fewest(tabs, nodes) -> list[int] | None:
    """Indices of the fewest hosts whose memory covers every layer."""
    ranges = _ordered_dp(tabs, nodes, lambda n, tab, a, b: 1)
    return None if ranges is None else [k for k, (a, b) in enumerate(ranges) if b > a]


def _proportional(nodes: list[_Host], L: int, weights: list[float]) -> list[tuple[int, int]]:
    """Largest-remainder split of L layers in proportion to weights."""
    total = sum(weights) or 1.0
    exact = [L * w / total for w in weights]
    counts = [int(x) for x in exact]
    for k in sorted(range(len(nodes)), key=lambda k: exact[k] - counts[k], reverse=True)[: L - sum(counts)]:
        counts[k] += 1
    out, a = [], 0
    for c in counts:
        out.append((a, a + c))
        a += c
    return out


def _place(policy: str, opts: CostOptions, hop_s: float, tabs, nodes) -> list[tuple[int, int]] | None:
    L = tabs[0].cost.num_layers
    if policy == "manual":
        ranges = [n.layers for n in nodes]
        if not all(ranges):
            missing = [n.host for n in nodes if not n.layers]
            raise PlanError(f"layerline_policy manual: host(s) {', '.join(missing)} have no layerline_layers pin")
    elif policy in ("ram_balanced", "uniform") and any(n.layers for n in nodes):
        pinned = [n.host for n in nodes if n.layers]
        raise PlanError(f"layerline_policy {policy}: splits every layer itself, but {', '.join(pinned)} pin "
                        "layerline_layers; use policy auto or manual with pins")
    elif policy == "ram_balanced":
        ranges = _proportional(nodes, L, [n.budget for n in nodes])
    elif policy == "uniform":
        ranges = _proportional(nodes, L, [1.0] * len(nodes))
    elif opts.objective == "latency":
        return _latency(tabs, nodes, opts.batch, hop_s)
    elif opts.objective == "memory":
        used = _fewest(tabs, nodes)
        if used is None:
            return None
        sub = _throughput([tabs[k] for k in used], [nodes[k] for k in used], opts.batch)
        out = [(0, 0)] * len(nodes)
        for k, r in zip(used, sub or []):
            out[k] = r
        return out if sub else None
    else:
        return _throughput(tabs, nodes, opts.batch)
    # fixed splits: check they cover and fit
    a = 0
    for n, tab, (ra, rb) in zip(nodes, tabs, ranges):
        if rb > ra and (ra != a or not tab.fits(n, ra, rb)):
            return None
        a = rb if rb > ra else a
    return ranges if a == L else None


# --- the plan ---------------------------------------------------------------------------------

def _order(actives: list[_Host]) -> list[_Host]:
    """Pipeline order: as given, except pinned hosts are put in the order of their pins."""
    pinned = sorted((n for n in actives if n.layers), key=lambda n: n.layers)
    it = iter(pinned)
    return [next(it) if n.layers else n for n in actives]


def _largest(actives: list[_Host]) -> str:
    """The host with the largest budget, its budget and the RAM (or cgroup cap) it came from."""
    h = max(actives, key=lambda n: n.budget)
    return f"{h.node.host}: budget {h.budget} bytes of its {h.node.caps.ram_total_bytes} RAM"


def _shortfall(cost: ModelCost, opts: CostOptions, rung: str, actives: list[_Host]) -> str:
    kvp = kv_profile(cost, opts, rung)
    tab = _Table(cost, rung, kvp.bytes_per_token * opts.context * opts.batch)
    need = tab.mem(0, cost.num_layers)
    have = sum(n.budget for n in actives)
    if need > have:
        return (f"model does not fit: needs {need} bytes at {rung} (weights {tab.weight(0, cost.num_layers)}, "
                f"KV {need - tab.weight(0, cost.num_layers)} for context {opts.context}) but the active hosts have "
                f"{have}; {need - have} bytes short (largest host {_largest(actives)}). Add a host or memory, "
                f"lower layerline_objective.context, "
                f"or add a lower rung to layerline_objective.precision_ladder")
    biggest = max(tab.mem(i, i + 1) for i in range(cost.num_layers))
    return (f"model does not fit as split: {need} bytes at {rung} fit the hosts' {have} in total, but no "
            f"contiguous split in this host order does (largest layer {biggest} bytes, largest host budget "
            f"{max((n.budget for n in actives), default=0)}); check layerline_layers pins, layerline_policy, "
            f"or lower layerline_objective.context")


def check_nodes(nodes: list[Node], policy: str = "auto", num_layers: int | None = None) -> None:
    """PlanError naming the first host setting (or the policy) no plan can take; what needs no
    measurement, so deploy.yml checks it before probing (num_layers None: layer pins unchecked)."""
    if policy not in POLICIES:
        raise PlanError(f"layerline_policy: {policy!r} is not one of {', '.join(POLICIES)}")
    for n in nodes:
        if n.role not in ROLES:
            raise PlanError(f"{n.host}: layerline_role {n.role!r} is not one of {', '.join(ROLES)}")
        if n.precision is not None and n.precision not in PRECISION_BYTES:
            raise PlanError(f"{n.host}: layerline_precision {n.precision!r} is not one of {', '.join(PRECISION_BYTES)}")
        if n.layers and num_layers is not None and n.layers[1] > num_layers:
            raise PlanError(f"{n.host}: layerline_layers {n.layers[0]}:{n.layers[1]} is past the model's "
                            f"{num_layers} layers")
        if n.compile not in COMPILE_MODES:
            raise PlanError(f"{n.host}: layerline_compile {n.compile!r} must be one of {', '.join(COMPILE_MODES)}")
        if n.threads is not None and (not isinstance(n.threads, int) or isinstance(n.threads, bool) or n.threads < 1):
            raise PlanError(f"{n.host}: layerline_threads {n.threads!r} must be a positive integer")


def make_plan(nodes: list[Node], cost: ModelCost, opts: CostOptions, policy: str = "auto") -> Plan:
    """The plan for these nodes, or PlanError naming what to change. Its inputs are left as they were.

    Ties between placements of equal bottleneck go to fewer hops (each host in pipeline order
    takes as many layers as fit), then to the hosts that come first in pipeline order.
    """
    check_nodes(nodes, policy, cost.num_layers)
    hosts = _hosts([n for n in nodes if n.role != "draining"], opts)
    actives = _order([h for h in hosts if h.node.role == "active"])
    if not actives:
        raise PlanError("inventory: no active hosts (every host is standby or draining)")
    hop_s, hop_source = hop_cost(nodes, opts)
    ladder = opts.precision_ladder or [cost.stored_precision]
    for rung in ladder:
        kvs = {p: kv_profile(cost, opts, p) for p in set([rung] + [n.precision for n in actives if n.precision])}
        tabs = [_Table(cost, n.precision or rung, kvs[n.precision or rung].bytes_per_token * opts.context * opts.batch,
                       kvs[n.precision or rung].dtype) for n in actives]
        ranges = _place(policy, opts, hop_s, tabs, actives)
        if ranges is not None:
            plan = _assemble(hosts, actives, tabs, ranges, opts, kvs[rung], rung, policy, cost.num_layers,
                             hop_s, hop_source)
            validate_plan(plan)  # actives cover every layer once, in order: never hand out less
            return plan
    raise PlanError(_shortfall(cost, opts, ladder[-1], actives))


def _stage(h: _Host, tab: _Table, a: int, b: int, role: str, batch: int, standby_for=None) -> StagePlan:
    paged = tab.paged(h, a, b)
    kv = (b - a) * tab.kv_per_layer
    weights = tab.paged_mem(a, b) - kv - int(tab.min_cache) if paged else tab.weight(a, b)
    return StagePlan(host=h.host, role=role, layers=(a, b), device=h.node.device, precision=tab.precision,
                     weight_bytes=weights, kv_bytes=kv, kv_dtype=tab.kv_dtype, mem_budget_bytes=h.budget,
                     predicted_s=tab.time(h, a, b, batch), endpoint=h.node.endpoint, standby_for=standby_for,
                     experts_paged=paged, expert_cache_bytes=h.budget - weights - kv if paged else 0,
                     disk_s=tab.disk_time(h, a, b) * batch, disk_read_bytes_per_s=h.disk_bw,
                     machine=h.node.caps.machine, compile=h.node.compile, step_factor=h.factor(tab.precision))


def core_group(machine: str | None, device: str, index: int = 0) -> tuple:
    """Which stages compute on the same cores: CPU stages on one machine share them; a GPU is
    its own. A stage whose machine is unknown (an older plan) counts alone when given its index."""
    if machine is None:
        return ("stage", index)
    return (machine, device if device.startswith("cuda") else "cpu")


def pipeline_depth(stages) -> int:
    """Micro-batches worth keeping in flight: one per core group along the route, or as many of a
    machine's stages as its cores hold, a core each (three stages on 2 cores: 2). Stages that share
    cores compute a message alone on all their threads and beside others on their share of the
    cores (message_threads), so their threads never fight: on the 2-vCPU Zen 4, three stages of
    SmolLM2 Q4_1 at 16 streaming clients served 128-149 tokens/s at one micro-batch of 2-thread
    steps and 197-215 at two of 1-thread steps (docs/serving.md).
    stages: the route's StagePlans, or their dicts (a plan as JSON); a field they lack is unknown."""
    groups: dict[tuple, list] = {}
    for i, s in enumerate(stages):
        get = s.get if isinstance(s, dict) else (lambda k, s=s: getattr(s, k, None))
        groups.setdefault(core_group(get("machine"), str(get("device") or "cpu"), i), []).append(
            (get("threads"), get("cores")))
    depth = 0
    for (_, kind), members in groups.items():
        threads = max((t or 0) for t, _ in members)
        cores = min((c or 0) for _, c in members)
        fits = cores if kind == "cpu" and threads and cores else 1
        depth += min(len(members), max(1, fits))
    return max(1, depth)


def message_threads(threads: int, cores: int, sharing: int, inflight: int) -> int:
    """The threads a stage that shares its machine's `cores` with `sharing` stages (itself included)
    computes one message on, when the driver has `inflight` messages out: all its `threads` alone,
    else its share of the cores among the messages that may compute on them at once, at least one."""
    return max(1, min(threads, cores // max(1, min(inflight, sharing))))


def _with_threads(stages: list[StagePlan], hosts: dict[str, _Host]) -> list[StagePlan]:
    """Each stage's CPU threads and spin policy, from which stages share its cores (core_group).

    Stages on one machine may each use all its cores for a message that is alone in flight (beside
    others, their share: message_threads), but an idle one must sleep at once rather than spin on
    cores a busy one needs.
    """
    sharing: dict[tuple, int] = {}
    for st in stages:
        if not st.device.startswith("cuda"):
            g = core_group(st.machine, st.device)
            sharing[g] = sharing.get(g, 0) + 1
    out = []
    for st in stages:
        n = hosts[st.host].node
        others = sharing.get(core_group(st.machine, st.device), 1) - 1
        out.append(dataclasses.replace(st, threads=n.threads or n.caps.cores, shares_cores_with=others,
                                       spin=SPIN_SHARED if others else SPIN_ALONE,
                                       cores=None if st.device.startswith("cuda") else n.caps.cores))
    return out


def _assemble(hosts, actives, tabs, ranges, opts, kvp: KvProfile, rung, policy, num_layers,
              hop_s, hop_source) -> Plan:
    stages = [_stage(h, t, a, b, "active", opts.batch) for h, t, (a, b) in zip(actives, tabs, ranges) if b > a]
    act = list(stages)  # principals are active stages only, never another standby
    tab_of = {h.host: t for h, t in zip(actives, tabs)}
    used = {s.host for s in act}
    mirrored: dict[str, int] = {}
    for h in hosts:
        n = h.node
        if n.role != "standby":
            continue
        if n.standby_for:
            principal = next((s for s in act if s.host == n.standby_for), None)
            if principal is None:
                raise PlanError(f"{n.host}: layerline_standby_for {n.standby_for!r} is not an active stage "
                                f"of this plan (active: {', '.join(sorted(used))})")
        else:
            # the least-mirrored active stage that fits, first in pipeline order
            fits = [s for s in act if tab_of[s.host].fits(h, *s.layers)]
            principal = min(fits, key=lambda s: mirrored.get(s.host, 0), default=None)
            if principal is None:
                raise PlanError(f"{n.host}: standby fits no active stage in its {h.budget} bytes; "
                                f"set layerline_standby_for or give it more memory")
        tab = tab_of[principal.host]  # a mirror: same layers, precision and KV as its principal
        a, b = principal.layers
        if not tab.fits(h, a, b):
            raise PlanError(f"{n.host}: standby for {principal.host} needs {tab.mem(a, b)} bytes but has "
                            f"{h.budget}; {tab.mem(a, b) - h.budget} bytes short")
        mirrored[principal.host] = mirrored.get(principal.host, 0) + 1
        stages.append(_stage(h, tab, a, b, "standby", opts.batch, standby_for=principal.host))
    stages = _with_threads(stages, {h.host: h for h in hosts})
    act = [s for s in stages if s.role == "active"]
    return Plan(precision=rung, objective=opts.objective, policy=policy, kv=kvp, num_layers=num_layers,
                stages=tuple(stages), predicted_token_s=_token_s(act, hop_s),
                bottleneck_s=max(s.predicted_s for s in act), hop_s=hop_s, hop_source=hop_source)


def _token_s(actives, hop_s: float) -> float:
    """A token's predicted time: every active stage in turn and a hop into, between and out of them."""
    return sum(s.predicted_s for s in actives) + hop_s * (len(actives) + 1)


def with_measured_factors(plan: Plan, caps_by_host: dict) -> Plan:
    """The plan, its layers unchanged, with each stage predicted from the step factor its host's
    caps now hold for the stage's mode (what its worker measured at warm-up, kept by the probe
    cache): the predictions the next plan makes, so a deploy that changes nothing plans the same.
    Stages whose host has no caps, or the same factor, keep theirs."""
    caps = {}
    for host, c in caps_by_host.items():
        try:
            caps[host] = NodeCaps.from_dict(c, host)
        except CapsError:
            pass
    shared = machine_step_factors(caps.values())   # as make_plan shares them, over the same hosts
    stages = []
    for st in plan.stages:
        f = st.step_factor
        if st.host in caps:
            nc, dev = caps[st.host], st.device.split("+")[0]
            try:
                f = factor_for(shared.get((nc.machine, dev), nc.device(dev, st.host).step_factors),
                               st.precision, st.compile)
            except CapsError:
                pass
        if f != st.step_factor:  # the disk's share is not the mode's: it stays as it was
            st = dataclasses.replace(st, step_factor=f,
                                     predicted_s=(st.predicted_s - st.disk_s) / st.step_factor * f + st.disk_s)
        stages.append(st)
    act = [s for s in stages if s.role == "active"]
    return dataclasses.replace(plan, stages=tuple(stages), predicted_token_s=_token_s(act, plan.hop_s),
                               bottleneck_s=max(s.predicted_s for s in act))


def validate_plan(plan: Plan) -> None:
    """Actives cover every layer exactly once, in pipeline order."""
    a = 0
    for s in plan.actives:
        if s.layers[0] != a or s.layers[1] <= a:
            raise PlanError(f"plan: stage on {s.host} holds {list(s.layers)} but layer {a} is next")
        a = s.layers[1]
    if a != plan.num_layers:
        raise PlanError(f"plan: active stages end at layer {a} of {plan.num_layers}")


# --- the table --------------------------------------------------------------------------------

def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", GiB), ("MiB", 2**20), ("KiB", 1024)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def _secs(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def plan_table(plan: Plan) -> str:
    """What each machine ends up holding, with disk speed and predicted stage time."""
    head = ["host", "role", "layers", "device", "prec", "threads", "weights", "kv", "budget", "disk read",
            "pred/token"]
    rows = []
    for s in plan.stages:
        role = s.role + (f" ({s.standby_for})" if s.standby_for else "")
        disk = s.disk_read_bytes_per_s
        weights = _size(s.weight_bytes) + (" +experts from disk" if s.experts_paged else "")
        pred = _secs(s.predicted_s) + (f" (disk {_secs(s.disk_s)})" if s.disk_s else "")
        prec = s.precision + ("+compile" if s.compile != "off" else "")
        threads = "-" if s.threads is None else (
            f"{s.threads}" + (f" (shared x{s.shares_cores_with + 1})" if s.shares_cores_with else ""))
        rows.append([s.host, role, f"{s.layers[0]}:{s.layers[1]}", s.device, prec, threads,
                     weights, _size(s.kv_bytes), _size(s.mem_budget_bytes),
                     f"{_size(disk)}/s" if disk else "not measured", pred])
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    kv = plan.kv
    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    row = PRECISIONS.get(plan.precision)
    stored = " (weights: the file's own blocks)" if row is not None and row.stored else ""
    out.append(f"precision {plan.precision}{stored}, objective {plan.objective}, policy {plan.policy}, "
               f"KV {kv.dtype} x {kv.context} tokens ({kv.bytes_per_token} B/token/layer)")
    out.append(f"predicted token time {_secs(plan.predicted_token_s)}, bottleneck {_secs(plan.bottleneck_s)}, "
               f"hop {_secs(plan.hop_s)} ({plan.hop_source})")
    return "\n".join(out)
