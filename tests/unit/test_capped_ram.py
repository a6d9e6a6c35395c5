"""Hosts of one machine share its RAM in the plan, unless each has a memory cgroup of its own
(NodeCaps.ram_capped, read by the probe from the cgroup's limit)."""
from __future__ import annotations

from layerline.caps import NodeCaps
from layerline.planner import Node, _hosts
from layerline.cost import CostOptions

GIB = 2**30


def _caps(host: str, capped: bool) -> NodeCaps:
    return NodeCaps.from_dict({"addr": host, "hostname": host, "machine_id": "boot-1", "cores": 2,
                               "ram_total_bytes": 3 * GIB, "ram_available_bytes": 3 * GIB, "ram_capped": capped,
                               "devices": [{"name": "cpu", "kind": "cpu", "flops_per_s": 1e10,
                                            "mem_bw_bytes_per_s": 1e10}]}, host)


def test_capped_hosts_keep_their_own_ram_uncapped_ones_share_the_machine():
    for capped, each in ((False, GIB), (True, 3 * GIB)):
        nodes = [Node(host=h, caps=_caps(h, capped)) for h in ("a", "b", "c")]
        assert [h.budget for h in _hosts(nodes, CostOptions())] == [each] * 3
