"""Addresses and ports, decided once: what loopback is, a worker's two ports, the two slots.

The lowest layer: no layerline imports, so wire, keys, the worker, the server and the
inventory code all ask the same functions.
"""
from __future__ import annotations

import ipaddress

LOOPBACK = "127.0.0.1"       # the address a machine reaches itself at (local connections, the default bind)
DEFAULT_PORT = 9100          # a worker's data port when the inventory gives none
CONTROL_OFFSET = 1           # a worker's control socket listens on its data port + this

CURVE_MODES = ("auto", "on")  # both: CURVE on every socket, loopback included (auto kept for existing inventories)

# A drain or rejoin starts the new route's workers beside the old ones, in the other slot: their
# ports are SLOT_PORT_STEP above the host's layerline_port and their state dir is STATE.1.
SLOTS = (0, 1)
SLOT_PORT_STEP = 50


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 (also as ::ffff:127.x.y.z, or in brackets) and localhost; a wildcard or any other
    name is not. The one definition: CURVE (keys), the server's bind check and its API keys use it."""
    host = host.strip()
    if host.lower() in ("localhost", "localhost.", "ip6-localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


WILDCARDS = ("0.0.0.0", "::", "*")   # a bind on every address


def is_wildcard(host: str) -> bool:
    """A bind address that listens on every address (reach it at LOOPBACK from the same machine)."""
    return host.strip().strip("[]") in WILDCARDS


def is_ip(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr.strip("[]"))
        return True
    except ValueError:
        return False


def endpoint_host(endpoint: str) -> str:
    """The host part of tcp://HOST:PORT (brackets of an IPv6 address removed)."""
    rest = endpoint.split("://", 1)[-1]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def control_port(port: int) -> int:
    """The control socket's port for a worker whose data socket is on `port`."""
    return int(port) + CONTROL_OFFSET


def worker_ports(port: int) -> tuple[int, int]:
    """(data, control): the two ports one worker takes."""
    return int(port), control_port(port)


def control_endpoint(bind: str) -> str:
    """The control endpoint of the worker whose data socket is `bind` (tcp://HOST:PORT)."""
    host, port = bind.rsplit(":", 1)
    return f"{host}:{control_port(int(port))}"


def slot_port(port: int, slot: int) -> int:
    """A worker's data port in a slot: the other slot's workers run SLOT_PORT_STEP above."""
    return int(port) + SLOT_PORT_STEP * int(slot)
