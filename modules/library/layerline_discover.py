#!/usr/bin/python
# -*- coding: utf-8 -*-

from __future__ import annotations

DOCUMENTATION = r"""
module: layerline_discover
short_description: Find machines for a layerline cluster by checking their SSH port
description:
  - Runs on the controller. Checks every candidate concurrently with a TCP connect to
    O(port) under O(timeout_ms), and by default reads the server's first line, which
    must start with C(SSH-).
  - Candidates are the hosts of O(ssh_hosts) and every address of O(subnet).
  - Idempotent by address. A candidate whose name or address is in O(known) (the
    inventory's hosts) is skipped, so hand-written hosts win and running it again adds
    nothing.
  - A host that does not answer is reported in RV(failures), never fatal. For a
    O(subnet) scan only addresses that answered but are not SSH are reported there;
    silent addresses are counted in RV(scanned) and left out.
  - Changes nothing; adding the hosts to the inventory is C(ansible.builtin.add_host)'s
    job (see EXAMPLES and C(playbooks/discover.yml)).
version_added: "0.1.0"
author:
  - layerline authors
options:
  ssh_hosts:
    description:
      - Host names or addresses to check, each optionally C(HOST:PORT) (C([V6ADDR]:PORT)
        for IPv6). Each one that fails is reported in RV(failures).
    type: list
    elements: str
    default: []
  subnet:
    description:
      - A network in CIDR notation whose every host address is checked, for example
        C(10.0.0.0/24). IPv4 no wider than C(/16), IPv6 no wider than C(/112).
    type: str
  port:
    description:
      - The SSH port to check (also the C(ansible_port) of what is found).
    type: int
    default: 22
  timeout_ms:
    description:
      - Milliseconds to wait for each connect, and again for the SSH banner.
    type: int
    default: 300
  banner:
    description:
      - Whether an open port must also send an SSH banner (a first line starting with C(SSH-)).
    type: bool
    default: true
  worker_port:
    description:
      - The layerline worker port the found hosts get (C(layerline_port)).
    type: int
    default: 9100
  device:
    description:
      - The C(layerline_device) the found hosts get; omitted when not set.
    type: str
  precision:
    description:
      - The C(layerline_precision) the found hosts get; omitted when not set.
    type: str
  known:
    description:
      - Names and addresses the inventory already has (C(ansible_host), C(layerline_addr),
        or the inventory name). Candidates matching one are skipped.
    type: list
    elements: str
    default: []
  workers:
    description:
      - How many candidates are checked at once.
    type: int
    default: 128
notes:
  - Supports C(check_mode); the module only reads, so it runs the same in check mode.
  - Traffic goes only to the candidates given, on O(port).
"""

EXAMPLES = r"""
- name: Find SSH hosts on the lab network and two named machines
  layerline_discover:
    subnet: 10.77.0.0/24
    ssh_hosts: [gpu-box, "10.1.2.3:2222"]
    timeout_ms: 300
    worker_port: 9100
    known: "{{ groups['layerline'] | map('extract', hostvars, 'ansible_host') | list }}"
  register: found

- name: Add what was found to the layerline group
  ansible.builtin.add_host:
    name: "{{ item.name }}"
    groups: layerline
    ansible_host: "{{ item.addr }}"
    ansible_port: "{{ item.port }}"
    layerline_port: "{{ item.worker_port }}"
  loop: "{{ found.found }}"
  loop_control:
    label: "{{ item.name }}"
"""

RETURN = r"""
found:
  description: Hosts that answered, in candidate order (O(ssh_hosts) first, then the subnet).
  returned: always
  type: list
  elements: dict
  contains:
    name:
      description: Inventory name to give the host (the O(ssh_hosts) entry's host part, or the address).
      type: str
      sample: 10.77.0.3
    addr:
      description: The address that answered.
      type: str
      sample: 10.77.0.3
    port:
      description: The SSH port that answered.
      type: int
      sample: 22
    worker_port:
      description: O(worker_port).
      type: int
      sample: 9100
    device:
      description: O(device), when given.
      type: str
      sample: cpu
    precision:
      description: O(precision), when given.
      type: str
      sample: bf16
    banner:
      description: The SSH banner the host sent (empty when O(banner=false)).
      type: str
      sample: SSH-2.0-OpenSSH_9.6
  sample: [{"name": "10.77.0.3", "addr": "10.77.0.3", "port": 22, "worker_port": 9100, "banner": "SSH-2.0-OpenSSH_9.6"}]
failures:
  description: Candidates that did not answer as an SSH host, with the reason. Never fatal.
  returned: always
  type: list
  elements: dict
  contains:
    addr:
      description: The candidate as given (C(HOST) or C(HOST:PORT)) or the subnet address.
      type: str
      sample: gpu-box
    reason:
      description: What went wrong.
      type: str
      sample: "connection refused on port 22"
already_known:
  description: Candidates left alone because the inventory already has them.
  returned: always
  type: list
  elements: str
  sample: [10.77.0.2]
scanned:
  description: How many candidates were checked.
  returned: always
  type: int
  sample: 254
"""

import errno
import ipaddress
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from ansible.module_utils.basic import AnsibleModule

MAX_ADDRESSES = 2 ** 16  # a /16 of IPv4 (or a /112 of IPv6)


class DiscoverError(Exception):
    """A spec the module cannot act on; the message names the field and the fix."""


def subnet_addresses(subnet):
    """Every host address of a CIDR network no wider than /16 (IPv4) or /112 (IPv6)."""
    try:
        net = ipaddress.ip_network(str(subnet).strip(), strict=False)
    except ValueError as e:
        raise DiscoverError("layerline_discover.subnet: %r is not a network in CIDR notation (%s); "
                            "write it like 10.0.0.0/24" % (subnet, e)) from None
    if net.num_addresses > MAX_ADDRESSES:
        widest = 16 if net.version == 4 else 112
        raise DiscoverError("layerline_discover.subnet: %s is wider than /%d (%d addresses); scan at most "
                            "%d addresses at a time, e.g. split it into /%d networks"
                            % (net, widest, net.num_addresses, MAX_ADDRESSES, widest))
    if net.num_addresses <= 2:  # /31, /32 (and /127, /128): every address is a host
        return [str(a) for a in net]
    return [str(a) for a in net.hosts()]


def split_host_port(entry, default_port):
    """'host', 'host:port', '[v6]:port' or a bare IPv6 address -> (host, port)."""
    s = str(entry).strip()
    if not s:
        raise DiscoverError("layerline_discover.ssh_hosts: an entry is empty; give a host name or address")
    if s.startswith("["):
        host, sep, rest = s[1:].partition("]")
        if not sep:
            raise DiscoverError("layerline_discover.ssh_hosts: %r misses the closing ']'" % s)
        port = rest[1:] if rest.startswith(":") else ""
    elif s.count(":") == 1:
        host, port = s.split(":")
    else:  # a name, IPv4, or a bare IPv6 address
        host, port = s, ""
    if port:
        try:
            port = int(port)
            if not 1 <= port <= 65535:
                raise ValueError
        except ValueError:
            raise DiscoverError("layerline_discover.ssh_hosts: %r has port %r; give a port in 1..65535"
                                % (s, port)) from None
    else:
        port = default_port
    return host, port


def _reason(exc, port):
    if isinstance(exc, socket.gaierror):
        return "name does not resolve (%s)" % (exc.strerror or exc)
    if isinstance(exc, socket.timeout):
        return "no answer on port %d (timed out)" % port
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused on port %d" % port
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "unreachable (%s)" % (exc.strerror or exc)
    return "%s on port %d" % (getattr(exc, "strerror", None) or exc, port)


def check(host, port, timeout_s, banner=True):
    """(addr, banner, None) when host:port answers as SSH, else (addr or None, None, reason)."""
    deadline = time.monotonic() + timeout_s
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return None, None, _reason(e, port) if isinstance(e, socket.gaierror) else "bad host name"
    family, _, _, _, sockaddr = infos[0]
    addr = sockaddr[0]
    data = b""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(sockaddr)
            if not banner:
                return addr, "", None
            s.settimeout(max(timeout_s, deadline - time.monotonic()))
            try:
                while b"\n" not in data and len(data) < 256:
                    chunk = s.recv(256)
                    if not chunk:
                        break
                    data += chunk
            except socket.timeout:
                if not data:
                    return addr, None, ("port %d is open but sent no SSH banner within %d ms"
                                        % (port, round(timeout_s * 1000)))
    except OSError as e:
        return addr, None, _reason(e, port)
    line = data.split(b"\n", 1)[0].strip().decode("ascii", "replace")
    if not line.startswith("SSH-"):
        shown = line[:40] if line else "nothing"
        return addr, None, "port %d is open but sent %r, not an SSH banner" % (port, shown)
    return addr, line, None


def discover(ssh_hosts=(), subnet=None, port=22, timeout_ms=300, banner=True, worker_port=9100,
             device=None, precision=None, known=(), workers=128):
    """Check the candidates; returns {found, failures, already_known, scanned}. Pure but for the sockets."""
    if not 1 <= int(port) <= 65535:
        raise DiscoverError("layerline_discover.port: %r; give the SSH port, 1..65535 (default 22)" % port)
    if not 1 <= int(worker_port) <= 65534:
        raise DiscoverError("layerline_discover.worker_port: %r; give a port in 1..65534 (the next one is "
                            "the worker's control port)" % worker_port)
    if not 1 <= int(timeout_ms) <= 60000:
        raise DiscoverError("layerline_discover.timeout_ms: %r; give milliseconds in 1..60000 (default 300)"
                            % timeout_ms)
    known_set = {str(k).strip() for k in known or () if str(k).strip()}
    # (label for failures, host to connect, port, inventory name, report failures?)
    candidates, seen = [], set()
    for entry in ssh_hosts or ():
        host, p = split_host_port(entry, int(port))
        if (host, p) not in seen:
            seen.add((host, p))
            candidates.append((str(entry).strip(), host, p, host, True))
    if subnet:
        for a in subnet_addresses(subnet):
            if (a, int(port)) not in seen:
                seen.add((a, int(port)))
                candidates.append((a, a, int(port), a, False))

    skipped = [c[0] for c in candidates if c[1] in known_set or c[0] in known_set]
    todo = [c for c in candidates if c[1] not in known_set and c[0] not in known_set]
    timeout_s = int(timeout_ms) / 1000.0
    found, failures = [], []
    if todo:
        with ThreadPoolExecutor(max_workers=max(1, min(int(workers), len(todo)))) as pool:
            results = list(pool.map(lambda c: check(c[1], c[2], timeout_s, banner), todo))
        for (label, _host, p, name, report_all), (addr, text, reason) in zip(todo, results):
            if reason is None:
                if addr in known_set:  # a name for an address the inventory already has
                    skipped.append(label)
                    continue
                h = {"name": name, "addr": addr, "port": p, "worker_port": int(worker_port),
                     "banner": text or ""}
                if device:
                    h["device"] = device
                if precision:
                    h["precision"] = precision
                found.append(h)
            elif report_all or "open but" in reason:
                failures.append({"addr": label, "reason": reason})
    # one host per address: a name and its address given twice count once
    unique, addrs = [], set()
    for h in found:
        if (h["addr"], h["port"]) not in addrs:
            addrs.add((h["addr"], h["port"]))
            unique.append(h)
    return {"found": unique, "failures": failures, "already_known": skipped, "scanned": len(todo)}


def main():
    module = AnsibleModule(
        argument_spec=dict(
            ssh_hosts=dict(type="list", elements="str", default=[]),
            subnet=dict(type="str"),
            port=dict(type="int", default=22),
            timeout_ms=dict(type="int", default=300),
            banner=dict(type="bool", default=True),
            worker_port=dict(type="int", default=9100),
            device=dict(type="str"),
            precision=dict(type="str"),
            known=dict(type="list", elements="str", default=[]),
            workers=dict(type="int", default=128),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if p["workers"] < 1:
        module.fail_json(msg="layerline_discover: workers is %d; give at least 1" % p["workers"])
    try:
        result = discover(ssh_hosts=p["ssh_hosts"], subnet=p["subnet"], port=p["port"],
                          timeout_ms=p["timeout_ms"], banner=p["banner"], worker_port=p["worker_port"],
                          device=p["device"], precision=p["precision"], known=p["known"],
                          workers=p["workers"])
    except DiscoverError as e:
        module.fail_json(msg=str(e))
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
