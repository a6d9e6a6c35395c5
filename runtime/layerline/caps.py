"""NodeCaps: one host's probed facts as the planner reads them (DESIGN.md, "Contracts").

The probe writes them as JSON on each host; the Ansible and CLI boundaries turn that JSON
into these typed records once (`NodeCaps.from_dict`), with one clear line naming the host and
the field when something the planner needs is missing. Pure data: no torch, no I/O.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .endpoints import LOOPBACK
from .errors import LayerlineError


class CapsError(LayerlineError):
    """Probe facts the planner cannot use; the text names the host, the field and the fix."""


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class DeviceCaps:
    name: str                          # "cpu", "cuda:0", ...
    kind: str = "cpu"
    memory_bytes: int | None = None
    memory_free_bytes: int | None = None
    flops_per_s: float | None = None   # measured matmul
    mem_bw_bytes_per_s: float | None = None  # measured streaming rate
    layer_overhead_s: float | None = None    # measured fixed seconds per layer per decode step
    step_factors: dict | None = None   # "precision/compile" -> measured step / cost model (cost.step_factor)

    @classmethod
    def from_dict(cls, d, host: str) -> "DeviceCaps":
        if not isinstance(d, dict) or not isinstance(d.get("name"), str):
            raise CapsError(f"{host}: probe facts have a device without a name; re-run the probe (layerline_probe)")
        kw = {k: d.get(k) for k in cls.__dataclass_fields__ if k in d}
        lo = kw.get("layer_overhead_s")  # an older probe's facts lack it; a broken one prices bytes alone
        kw["layer_overhead_s"] = float(lo) if _num(lo) and 0 < lo < 1 else None
        return cls(**kw)


@dataclass(frozen=True)
class NodeCaps:
    addr: str = LOOPBACK
    hostname: str | None = None
    machine_id: str | None = None      # the kernel's boot id: hosts with the same one share a machine
    os: str | None = None
    cores: int = 1
    ram_total_bytes: int | None = None
    ram_available_bytes: int | None = None
    ram_capped: bool = False           # a memory cgroup's own limit: not a share of its machine's RAM
    disk_free_bytes: int | None = None
    disk_read_bytes_per_s: float | None = None   # measured; None when not measured, never 0
    disk_read_cached: bool = False
    devices: tuple[DeviceCaps, ...] = ()
    probe_seconds: float | None = None
    rtt_s: dict = field(default_factory=dict)    # peer "ADDR:PORT" -> measured round trip, or None

    @classmethod
    def from_dict(cls, d, host: str) -> "NodeCaps":
        """Typed caps from a probe's JSON; CapsError naming the field when the planner could not use them."""
        if isinstance(d, NodeCaps):
            return d
        if not isinstance(d, dict):
            raise CapsError(f"{host}: no layerline_caps facts; run the probe play (playbooks/probe.yml) first")
        devices = d.get("devices")
        if not isinstance(devices, list):
            raise CapsError(f"{host}: probe facts have no devices list; re-run the probe (layerline_probe)")
        cores = d.get("cores")
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k not in ("devices", "cores", "rtt_s")}
        disk = d.get("disk_read_bytes_per_s")
        kw["disk_read_bytes_per_s"] = float(disk) if _num(disk) and disk > 0 else None
        rtt = d.get("rtt_s")
        return cls(**kw, devices=tuple(DeviceCaps.from_dict(x, host) for x in devices),
                   cores=int(cores) if _num(cores) and cores >= 1 else 1,
                   rtt_s=dict(rtt) if isinstance(rtt, dict) else {})

    def to_dict(self) -> dict:
        return asdict(self) | {"devices": [asdict(x) for x in self.devices]}

    def device(self, name: str, host: str) -> DeviceCaps:
        for d in self.devices:
            if d.name == name:
                return d
        raise CapsError(f"{host}: layerline_device {name!r} is not on this host "
                        f"(probed: {', '.join(d.name for d in self.devices)})")

    @property
    def machine(self) -> str:
        """Which machine this host runs on: hosts with the same value share its cores and RAM."""
        return self.machine_id or self.hostname or self.addr

    def round_trips(self) -> list[float]:
        return [float(v) for v in self.rtt_s.values() if _num(v)]
