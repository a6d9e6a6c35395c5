#!/usr/bin/env python3
"""Test hosts on one machine: one network namespace per host, each with its own sshd.

    scripts/testhosts.py up N [--prefix llt] [--subnet 10.77.0.0/24] [--out DIR] [--python PY]
                              [--mem-limit SIZE[,SIZE...]]
    scripts/testhosts.py down [--prefix llt] [--out DIR]
    scripts/testhosts.py ping [--out DIR]          # ansible -m ping over the hosts, timed

`up` makes a bridge PREFIX-br0 holding the subnet's first address on the root side and N
namespaces PREFIX-h1..hN, each joined to the bridge by a veth pair and given the address
.11, .12, ... of the subnet. In each namespace an sshd runs inside `unshare --uts --mount`,
so the host has its own hostname (PREFIX-hK), its own /tmp (a tmpfs) and root's ~/.bashrc as a fresh
Debian machine has it (/etc/skel's, not the controller's); whatever runs through ssh inherits them.
Each sshd has its own host key, pidfile and ListenAddress, no PAM, key authentication only
(root with a key made here). Into --out go the client key, known_hosts (host key checking
stays on), an ssh_config and inventory.yml, an inventory in the shape of inventory/hosts.yml (group
layerline, hosts h1..hN).

With --mem-limit (bytes, or K/M/G suffixes; one size for every host or one per host) each host's
sshd starts inside a memory cgroup of its own, a child of this process's memory cgroup (v2 where
the unified tree holds the memory controller, else v1), so every ssh login and every worker it
starts is held to that limit by the kernel, and the probe reads it as the host's RAM.

Traffic goes only to the bridge and the namespaces: no route leaves them, no forwarding,
no NAT, iptables untouched. `down` kills every process in the namespaces (sshd, workers),
deletes namespaces, veths and the bridge; it is idempotent and safe on a partial setup.
Must run as root (namespaces, bridge). The filesystem is shared, so the controller's
venv and any checkpoint outside /tmp are visible on every host; --out must not be under
/tmp, which each host replaces with its own.
"""
from __future__ import annotations

import argparse
import fcntl
import ipaddress
import json
import os
import pwd
import shlex
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SSHD = "/usr/sbin/sshd"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
HOST_OFFSET = 10          # host K gets the subnet's address 10 + K
DEFAULT_PORT = 9100       # layerline_port in the inventory (every host has its own network stack)


def default_out(prefix: str) -> Path:
    return ROOT / ".cache" / f"testhosts-{prefix}"


def default_python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv if venv.exists() else sys.executable)  # not resolved: a venv's python is a link


def log(msg: str) -> None:
    print(f"testhosts: {msg}", file=sys.stderr, flush=True)


def run(*cmd: str, check: bool = True, capture: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=capture, text=True, **kw)
    if check and r.returncode != 0:
        raise SystemExit(f"testhosts: {' '.join(cmd)} exited {r.returncode}: {(r.stderr or r.stdout or '').strip()}")
    return r


class Layout:
    """Names and addresses for one prefix."""

    def __init__(self, prefix: str, subnet: str = "10.77.0.0/24"):
        if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", prefix):
            raise SystemExit(f"testhosts: --prefix {prefix!r} must be 1-6 lowercase letters/digits, starting "
                             "with a letter (interface names are at most 15 characters)")
        self.prefix = prefix
        self.net = ipaddress.ip_network(subnet, strict=True)
        if self.net.version != 4 or not self.net.is_private or self.net.prefixlen > 28:
            raise SystemExit(f"testhosts: --subnet {subnet} must be a private IPv4 network, /28 or wider")
        self.bridge = f"{prefix}-br0"
        self.gateway = self.net.network_address + 1

    def ns(self, k: int) -> str:
        return f"{self.prefix}-h{k}"

    def veth_root(self, k: int) -> str:
        return f"{self.prefix}-h{k}-r"

    def veth_ns(self, k: int) -> str:
        return f"{self.prefix}-h{k}-n"

    def addr(self, k: int) -> ipaddress.IPv4Address:
        a = self.net.network_address + HOST_OFFSET + k
        if a not in self.net or a == self.net.broadcast_address:
            raise SystemExit(f"testhosts: {k} hosts do not fit in {self.net}")
        return a

    def namespaces(self) -> list[str]:
        r = run("ip", "netns", "list", check=False)
        names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
        return sorted((n for n in names if re.fullmatch(rf"{re.escape(self.prefix)}-h\d+", n)),
                      key=lambda n: int(n.rsplit("h", 1)[1]))

    def links(self) -> list[str]:
        r = run("ip", "-o", "link", "show", check=False)
        out = []
        for line in r.stdout.splitlines():
            m = re.match(r"\d+:\s+([^:@\s]+)", line)
            if m and re.fullmatch(rf"{re.escape(self.prefix)}-(br0|h\d+-[rn])", m.group(1)):
                out.append(m.group(1))
        return out


class Lock:
    """One `up` or `down` per prefix at a time."""

    def __init__(self, prefix: str):
        self.path = f"/run/layerline-testhosts-{prefix}.lock"

    def __enter__(self):
        self.f = open(self.path, "w")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


# --- memory caps -----------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """'700M' -> bytes (K, M, G are powers of 1024; a plain number is bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)i?B?\s*", text, re.I)
    if not m:
        raise SystemExit(f"testhosts: --mem-limit {text!r}: give bytes or a size like 700M or 1.5G")
    n = float(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " ")
    if n < 64 << 20:
        raise SystemExit(f"testhosts: --mem-limit {text!r} is under 64M: sshd and python need more")
    return int(n)


def memory_cgroup_root() -> tuple[Path, str]:
    """This process's memory cgroup dir and its version ('v2' or 'v1'): caps are made below it."""
    entries = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
    unified = Path("/sys/fs/cgroup/cgroup.controllers")
    v2_memory = unified.exists() and "memory" in unified.read_text().split()
    for _, ctrls, path in entries:
        if ctrls == "" and v2_memory:  # v2 (not exercised here: these machines mount v1's memory controller)
            return Path("/sys/fs/cgroup") / path.lstrip("/"), "v2"
        if "memory" in ctrls.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "v1"
    raise SystemExit("testhosts: --mem-limit needs the memory cgroup controller (v1 or v2), and none is mounted")


def make_cap(lay: "Layout", k: int, limit: int) -> Path:
    """A memory cgroup for host k holding `limit` bytes (no swap beyond it where swap is accounted)."""
    root, version = memory_cgroup_root()
    cg = root / f"{lay.prefix}-h{k}"
    cg.mkdir(exist_ok=True)
    if version == "v2":
        (cg / "memory.max").write_text(str(limit))
        if (cg / "memory.swap.max").exists():
            (cg / "memory.swap.max").write_text("0")
    else:
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        if (cg / "memory.memsw.limit_in_bytes").exists():
            (cg / "memory.memsw.limit_in_bytes").write_text(str(limit))
    return cg


def remove_caps(lay: "Layout") -> None:
    """rmdir the prefix's host cgroups (their processes are gone by now)."""
    try:
        root, _ = memory_cgroup_root()
    except (SystemExit, OSError):
        return
    for cg in root.glob(f"{lay.prefix}-h*"):
        try:
            for pid in (cg / "cgroup.procs").read_text().split():
                _kill_pids([int(pid)], cg.name)
            cg.rmdir()
        except OSError as e:
            log(f"cgroup {cg}: not removed ({e})")


# --- sshd -----------------------------------------------------------------------------------

def ensure_sshd() -> None:
    """openssh-server for the hosts' sshd, systemd for `systemd-analyze verify` (the unit tests of
    layerline.units) and systemd-container for `make test-systemd`'s systemd-nspawn host, installed with
    apt-get where missing."""
    packages = [] if os.access(SSHD, os.X_OK) else ["openssh-server", "openssh-client"]
    if not shutil.which("systemd-analyze"):
        packages.append("systemd")
    if not shutil.which("systemd-nspawn"):
        packages.append("systemd-container")
    if not packages:
        return
    if not shutil.which("apt-get"):
        raise SystemExit(f"testhosts: {' '.join(packages)} missing and apt-get is not here; install them")
    log(f"installing {' '.join(packages)} (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # Keep the package's own sshd from starting on the machine: a policy-rc.d saying 101
    # (the Debian way); only made, and removed again, when there is none already.
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = not policy.exists()
    if made_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        run("apt-get", "update", "-q", env=env)
        run("apt-get", "install", "-y", "-q", "--no-install-recommends", *packages, env=env)
    finally:
        if made_policy:
            policy.unlink(missing_ok=True)
    if not os.access(SSHD, os.X_OK):
        raise SystemExit(f"testhosts: apt-get installed openssh-server but {SSHD} is still missing")


def keygen(path: Path, comment: str) -> None:
    for p in (path, Path(f"{path}.pub")):
        p.unlink(missing_ok=True)
    run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))
    path.chmod(0o600)


def sshd_config(lay: Layout, k: int, out: Path) -> str:
    d = out / "hosts" / f"h{k}"
    return "\n".join([
        f"# test host {lay.ns(k)} (scripts/testhosts.py); runs inside its namespace",
        f"ListenAddress {lay.addr(k)}:22",
        f"HostKey {d / 'ssh_host_ed25519_key'}",
        f"PidFile {d / 'sshd.pid'}",
        f"AuthorizedKeysFile {out / 'authorized_keys'}",
        "UsePAM no",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "HostbasedAuthentication no",
        # the key files sit under a dir of the caller's choosing (/var/tmp is world-writable)
        "StrictModes no",
        "UseDNS no",
        "X11Forwarding no",
        "AllowTcpForwarding no",
        "PrintMotd no",
        "MaxSessions 32",
        "MaxStartups 64:30:128",
        "AcceptEnv LANG LC_*",
        # a process of its own per transfer where the binary is there (a test can kill one copy)
        f"Subsystem sftp {SFTP_SERVER if os.access(SFTP_SERVER, os.X_OK) else 'internal-sftp'}",
        "",
    ])


def fresh_shell_rc() -> str:
    """The mount that gives a host root's ~/.bashrc as a fresh Debian machine has it (/etc/skel's, which
    does nothing unless interactive), or "" where there is nothing to replace. sshd runs every command
    through the login shell, and Debian's bash reads ~/.bashrc when sshd starts it: this controller's
    (pyenv's init, about 60 processes) ran before every Ansible task on every host, 0.13 s of CPU each
    time (docs/testing.md). A remote machine does not run the controller's interactive setup."""
    rc = Path(pwd.getpwnam("root").pw_dir) / ".bashrc"   # the hosts' ssh user (ssh_config's User root)
    skel = Path("/etc/skel/.bashrc")
    if not rc.is_file():
        return ""
    return f" && mount --bind {shlex.quote(str(skel) if skel.is_file() else '/dev/null')} {shlex.quote(str(rc))}"


# --- up / down ------------------------------------------------------------------------------

def _kill_pids(pids: list[int], what: str) -> None:
    pids = [p for p in pids if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for p in pids:
            try:
                os.kill(p, sig)
                alive.append(p)
            except ProcessLookupError:
                pass
        if not alive:
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            alive = [p for p in alive if Path(f"/proc/{p}").exists() and not _zombie(p)]
            if not alive:
                return
            time.sleep(0.05)
        pids = alive
    log(f"{what}: pids {pids} did not exit")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def netns_pids(ns: str) -> list[int]:
    r = run("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def down(lay: Layout, out: Path | None) -> None:
    for ns in lay.namespaces():
        _kill_pids(netns_pids(ns), ns)
        run("ip", "netns", "del", ns, check=False)
    # sshds whose namespace is already gone (deleted by hand): their pidfiles still name them
    if out is not None and (out / "hosts").is_dir():
        for pidfile in (out / "hosts").glob("h*/sshd.pid"):
            try:
                pid = int(pidfile.read_text().split()[0])
                if SSHD in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[0]:
                    _kill_pids([pid], pidfile.parent.name)
            except (OSError, ValueError, IndexError):
                pass
            pidfile.unlink(missing_ok=True)
    for link in lay.links():  # veths left by a partial setup, then the bridge
        if link != lay.bridge:
            run("ip", "link", "del", link, check=False)
    if lay.bridge in lay.links():
        run("ip", "link", "del", lay.bridge, check=False)
    remove_caps(lay)


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise SystemExit(f"testhosts: timed out waiting for {what}")


def _port_open(addr: str) -> bool:
    """sshd answers on ADDR:22, reached over the bridge."""
    try:
        with socket.create_connection((addr, 22), timeout=1) as s:
            return s.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def up(lay: Layout, n: int, out: Path, python: str, port: int, mem_limits: list[int] | None = None) -> dict:
    if n < 1:
        raise SystemExit("testhosts: up N needs N >= 1")
    if mem_limits is not None:
        if len(mem_limits) == 1:
            mem_limits = mem_limits * n
        if len(mem_limits) != n:
            raise SystemExit(f"testhosts: --mem-limit gives {len(mem_limits)} sizes for {n} hosts; give one or {n}")
    out = out.resolve()
    if out == Path("/tmp") or Path("/tmp") in out.parents:
        raise SystemExit(f"testhosts: --out {out} is under /tmp, which each host replaces with its own; "
                         "put it elsewhere (default: .cache/testhosts-PREFIX in the repo)")
    for k in range(1, n + 1):
        lay.addr(k)
    ensure_sshd()
    down(lay, out)
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir

    client_key = out / "id_ed25519"
    keygen(client_key, f"{lay.prefix}-testhosts")
    auth = out / "authorized_keys"
    auth.write_text(Path(f"{client_key}.pub").read_text())
    auth.chmod(0o600)

    plen = lay.net.prefixlen
    run("ip", "link", "add", lay.bridge, "type", "bridge")
    run("ip", "addr", "add", f"{lay.gateway}/{plen}", "dev", lay.bridge)
    run("ip", "link", "set", lay.bridge, "up")

    known = []
    hosts = {}
    for k in range(1, n + 1):
        ns, addr = lay.ns(k), str(lay.addr(k))
        hdir = out / "hosts" / f"h{k}"
        hdir.mkdir(parents=True, exist_ok=True)
        hdir.chmod(0o700)
        run("ip", "netns", "add", ns)
        run("ip", "link", "add", lay.veth_root(k), "type", "veth", "peer", "name", lay.veth_ns(k))
        run("ip", "link", "set", lay.veth_root(k), "master", lay.bridge, "up")
        run("ip", "link", "set", lay.veth_ns(k), "netns", ns)
        run("ip", "-n", ns, "link", "set", lay.veth_ns(k), "name", "eth0")
        run("ip", "-n", ns, "addr", "add", f"{addr}/{plen}", "dev", "eth0")
        run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "-n", ns, "link", "set", "eth0", "up")

        hostkey = hdir / "ssh_host_ed25519_key"
        keygen(hostkey, ns)
        cfg = hdir / "sshd_config"
        cfg.write_text(sshd_config(lay, k, out))
        cfg.chmod(0o600)
        run(SSHD, "-t", "-f", str(cfg))
        # sshd starts inside its own UTS and mount namespaces: hostname and a private /tmp for
        # it and for everything it spawns (ssh sessions, the workers they start)
        # a checkout under /tmp (its venv runs the hosts' modules) stays visible through the new /tmp
        keep = [p for p in {str(ROOT.resolve()), str(Path(python).parent.parent.resolve())}
                if p == "/tmp" or p.startswith("/tmp/")]
        old_tmp = hdir / "root-tmp"
        old_tmp.mkdir(exist_ok=True)
        rebind = "".join(f" && mkdir -p {shlex.quote(p)} && mount --bind {shlex.quote(str(old_tmp) + p[4:])} "
                         f"{shlex.quote(p)}" for p in sorted(keep))
        cap = make_cap(lay, k, mem_limits[k - 1]) if mem_limits else None
        # ip netns exec mounts a fresh /sys without cgroups: mount the memory hierarchy again so the
        # host's processes (the probe) can read their cap
        cgmount = ""
        if cap:
            cgmount = ("mount -t cgroup2 none /sys/fs/cgroup && " if memory_cgroup_root()[1] == "v2" else
                       "mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/memory && "
                       "mount -t cgroup -o memory memory /sys/fs/cgroup/memory && ")
        script = (f"hostname {ns} && {cgmount}mount --bind /tmp {shlex.quote(str(old_tmp))} && "
                  f"mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp{rebind}{fresh_shell_rc()} && "
                  f"exec {SSHD} -f {cfg} -E {hdir / 'sshd.log'}")
        start = ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "--propagation", "private",
                 "sh", "-c", script]
        if cap:  # join the host's cgroup first (ip netns exec remounts /sys): every login and worker inherits it
            start = ["sh", "-c", f"echo $$ > {shlex.quote(str(cap / 'cgroup.procs'))} && exec {shlex.join(start)}"]
        run(*start)
        kind, key = Path(f"{hostkey}.pub").read_text().split()[:2]
        known.append(f"{addr} {kind} {key}")
        hosts[f"h{k}"] = {"namespace": ns, "addr": addr, "hostname": ns}
        if cap:
            hosts[f"h{k}"].update(mem_limit_bytes=mem_limits[k - 1], cgroup=str(cap))

    kh = out / "known_hosts"
    kh.write_text("\n".join(known) + "\n")
    kh.chmod(0o600)
    ssh_opts = (f"-o UserKnownHostsFile={kh} -o GlobalKnownHostsFile=/dev/null -o StrictHostKeyChecking=yes "
                "-o IdentitiesOnly=yes -o PasswordAuthentication=no -o ConnectTimeout=10")
    ssh_config = [f"# scripts/testhosts.py: ssh -F {out / 'ssh_config'} {lay.ns(1)}"]
    for name, h in hosts.items():
        ssh_config += [f"Host {h['namespace']} {name}", f"  HostName {h['addr']}", "  User root",
                       f"  IdentityFile {client_key}", "  IdentitiesOnly yes", f"  UserKnownHostsFile {kh}",
                       "  GlobalKnownHostsFile /dev/null", "  StrictHostKeyChecking yes",
                       "  PasswordAuthentication no", "  ConnectTimeout 10", ""]
    (out / "ssh_config").write_text("\n".join(ssh_config))
    (out / "ssh_config").chmod(0o600)

    inventory = {"layerline": {
        "hosts": {name: {"ansible_host": h["addr"], "layerline_port": port} for name, h in hosts.items()},
        "vars": {
            "ansible_connection": "ssh",
            "ansible_user": "root",
            "ansible_ssh_private_key_file": str(client_key),
            "ansible_ssh_common_args": ssh_opts,
            # the filesystem is shared: the controller's venv (with layerline) is on every host
            "ansible_python_interpreter": python,
            # under the host's private /tmp: state dirs cannot collide
            "layerline_state_dir": "/tmp/layerline/state",
            # the controller's address on the bridge: the driver's result socket binds it
            "layerline_driver_addr": str(lay.gateway),
            "layerline_home": str(out / "home"),
            # test models are small: check the drive against a one-process forward
            "layerline_drive_reference": True,
            # the namespace hosts share this machine's cores: probe one at a time
            "layerline_probe_serial": True,
        }}}
    (out / "inventory.yml").write_text(
        "# Made by scripts/testhosts.py: hosts in network namespaces, each with its own sshd.\n"
        + json.dumps(inventory, indent=2) + "\n")  # JSON is YAML; no yaml dependency here
    (out / "home").mkdir(exist_ok=True)

    for h in hosts.values():
        _wait_for(lambda h=h: _port_open(h["addr"]), 20, f"sshd in {h['namespace']}")
    info = {"prefix": lay.prefix, "subnet": str(lay.net), "bridge": lay.bridge, "controller_addr": str(lay.gateway),
            "out": str(out), "inventory": str(out / "inventory.yml"), "ssh_config": str(out / "ssh_config"),
            "known_hosts": str(kh), "python": python, "hosts": hosts}
    (out / "testhosts.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def check(info: dict) -> None:
    """Every host answers over ssh with its own hostname: key auth, host key checked."""
    for name, h in info["hosts"].items():
        r = run("ssh", "-F", info["ssh_config"], "-o", "BatchMode=yes", h["namespace"], "hostname", check=False,
                timeout=30)
        if r.returncode != 0 or r.stdout.strip() != h["hostname"]:
            raise SystemExit(f"testhosts: ssh to {name} ({h['addr']}) failed: rc {r.returncode}, "
                             f"{(r.stdout + r.stderr).strip()[-500:]}")


def ping(out: Path) -> float:
    info = json.loads((out / "testhosts.json").read_text())
    ansible = Path(info["python"]).parent / "ansible"
    env = dict(os.environ, ANSIBLE_CONFIG=os.environ.get("ANSIBLE_CONFIG", str(ROOT / "ansible.cfg")))
    t0 = time.perf_counter()
    r = subprocess.run([str(ansible), "-i", info["inventory"], "layerline", "-m", "ansible.builtin.ping"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"testhosts: ansible ping failed:\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}")
    return dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="testhosts", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="make N hosts (tears down what the prefix had first)")
    u.add_argument("n", type=int)
    d = sub.add_parser("down", help="remove the prefix's hosts, bridge and processes")
    pg = sub.add_parser("ping", help="ansible -m ping over the hosts; prints seconds")
    sub.add_parser("install", help="install openssh-server, systemd and systemd-container where missing (CI calls this)")
    for s in (u, d, pg):
        s.add_argument("--prefix", default="llt")
        s.add_argument("--out", default=None, help="dir for keys, known_hosts, ssh_config, inventory.yml "
                                                   "(default .cache/testhosts-PREFIX); not under /tmp")
    u.add_argument("--subnet", default="10.77.0.0/24")
    u.add_argument("--python", default=default_python(), help="host interpreter (default: the repo's venv)")
    u.add_argument("--port", type=int, default=DEFAULT_PORT, help="layerline_port of every host")
    u.add_argument("--json", action="store_true", help="print what was made as JSON")
    u.add_argument("--mem-limit", default=None,
                   help="memory cap enforced by a cgroup: one size for every host or one per host, "
                        "comma-separated (e.g. 700M or 700M,700M,900M)")
    a = p.parse_args(argv)
    if a.cmd == "install":
        ensure_sshd()
        return 0
    out = Path(a.out) if a.out else default_out(a.prefix)
    if a.cmd == "ping":
        print(f"{ping(out):.2f}")
        return 0
    if os.geteuid() != 0:
        raise SystemExit("testhosts: must run as root (network namespaces, a bridge, sshd)")
    lay = Layout(a.prefix, getattr(a, "subnet", "10.77.0.0/24"))
    with Lock(a.prefix):
        if a.cmd == "down":
            down(lay, out)
            return 0
        try:
            limits = [parse_size(x) for x in a.mem_limit.split(",")] if a.mem_limit else None
            info = up(lay, a.n, out, a.python, a.port, limits)
            check(info)
        except BaseException:
            down(lay, out)
            raise
    if a.json:
        print(json.dumps(info, indent=2))
    else:
        for name, h in info["hosts"].items():
            cap = f"  cap {h['mem_limit_bytes'] / 2**20:.0f} MiB" if "mem_limit_bytes" in h else ""
            print(f"{name}  {h['namespace']}  {h['addr']}{cap}")
        print(f"inventory: {info['inventory']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
