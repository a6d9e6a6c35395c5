"""layerline_discover and playbooks/discover.yml, on loopback addresses only (127.0.0.0/29).

Fake SSH servers listen on 127.0.0.2 and 127.0.0.3 and send a banner; 127.0.0.4 answers
but is not SSH; every other address of the /29 has nothing on the port. No traffic leaves
loopback.
"""
from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import threading

import pytest

from helpers import ROOT, playbook, recap

MODULE = ROOT / "modules" / "library" / "layerline_discover.py"
SUBNET = "127.0.0.0/29"
ADDRS = [f"127.0.0.{i}" for i in range(1, 7)]  # the /29's host addresses


def _load_module():
    spec = importlib.util.spec_from_file_location("layerline_discover", MODULE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


disc = _load_module()


class _Server:
    """Listens on addr:port; answers each connection with `greeting` (or nothing) and closes."""

    def __init__(self, sock: socket.socket, greeting: bytes | None):
        self.sock, self.greeting = sock, greeting
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            if self.greeting is None:
                self.conns.append(c)  # say nothing: the client's banner read times out
                continue
            try:
                c.sendall(self.greeting)
            except OSError:
                pass
            c.close()

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


def _port_free_everywhere() -> int:
    """A port free on every address of the /29 (so nothing else there answers on it)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
            port = s.getsockname()[1]
        socks = []
        try:
            for a in ADDRS:
                t = socket.socket()
                socks.append(t)
                t.bind((a, port))
            return port
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no port free on all of 127.0.0.1-6")


@pytest.fixture(scope="module")
def ssh_port():
    port = _port_free_everywhere()
    servers = []
    for addr, greeting in (("127.0.0.2", b"SSH-2.0-test\r\n"), ("127.0.0.3", b"SSH-2.0-test\r\n"),
                           ("127.0.0.4", b"HTTP/1.1 400 Bad Request\r\n\r\n")):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        s.listen(16)
        servers.append(_Server(s, greeting))
    yield port
    for s in servers:
        s.close()


def test_subnet_scan_finds_exactly_the_ssh_hosts(ssh_port):
    r = disc.discover(subnet=SUBNET, port=ssh_port, timeout_ms=300, worker_port=9300, device="cpu",
                      precision="bf16")
    assert [h["addr"] for h in r["found"]] == ["127.0.0.2", "127.0.0.3"]
    assert r["found"][0] == {"name": "127.0.0.2", "addr": "127.0.0.2", "port": ssh_port, "worker_port": 9300,
                             "banner": "SSH-2.0-test", "device": "cpu", "precision": "bf16"}
    # the answering non-SSH port is reported; silent addresses are only counted
    assert [f["addr"] for f in r["failures"]] == ["127.0.0.4"]
    assert "not an SSH banner" in r["failures"][0]["reason"]
    assert r["scanned"] == 6 and r["already_known"] == []


def test_banner_check_can_be_off(ssh_port):
    r = disc.discover(subnet=SUBNET, port=ssh_port, timeout_ms=300, banner=False)
    assert [h["addr"] for h in r["found"]] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


def test_named_host_that_is_down_is_reported_not_fatal(ssh_port):
    r = disc.discover(ssh_hosts=[f"127.0.0.2:{ssh_port}", f"127.0.0.5:{ssh_port}", "127.0.0.6"],
                      port=ssh_port, timeout_ms=300)
    assert [h["name"] for h in r["found"]] == ["127.0.0.2"]
    by_addr = {f["addr"]: f["reason"] for f in r["failures"]}
    assert set(by_addr) == {f"127.0.0.5:{ssh_port}", "127.0.0.6"}
    assert "connection refused" in by_addr[f"127.0.0.5:{ssh_port}"]


def test_silent_port_times_out_with_a_reason():
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        s.listen(4)
        server = _Server(s, None)
        port = s.getsockname()[1]
        r = disc.discover(ssh_hosts=[f"127.0.0.2:{port}"], timeout_ms=150)
        server.close()
    assert r["found"] == []
    assert "no SSH banner within 150 ms" in r["failures"][0]["reason"]


def test_known_addresses_are_skipped(ssh_port):
    r = disc.discover(subnet=SUBNET, ssh_hosts=[f"127.0.0.3:{ssh_port}"], port=ssh_port, timeout_ms=300,
                      known=["w1", "127.0.0.2", "127.0.0.3"])
    assert r["found"] == []
    assert r["already_known"] == [f"127.0.0.3:{ssh_port}", "127.0.0.2"]
    assert r["scanned"] == 4  # 127.0.0.1, 4, 5, 6: .3 came first as a named host, once, and both are known


@pytest.mark.parametrize("subnet", ["10.0.0.0/15", "0.0.0.0/0", "fd00::/64"])
def test_wide_subnet_is_refused(subnet):
    with pytest.raises(disc.DiscoverError, match=r"wider than /(16|112)"):
        disc.discover(subnet=subnet)


def test_bad_spec_values_name_the_field():
    with pytest.raises(disc.DiscoverError, match="layerline_discover.subnet"):
        disc.discover(subnet="10.0.0.300/24")
    with pytest.raises(disc.DiscoverError, match="layerline_discover.ssh_hosts"):
        disc.discover(ssh_hosts=["host:99999"])
    with pytest.raises(disc.DiscoverError, match="layerline_discover.port"):
        disc.discover(port=0)


def _module(args: dict) -> dict:
    """Run the module as Ansible does (args file), return its JSON result."""
    r = subprocess.run([sys.executable, str(MODULE)], input=json.dumps({"ANSIBLE_MODULE_ARGS": args}),
                       capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout)


def test_module_refuses_wide_subnet_and_supports_check_mode(ssh_port):
    r = _module({"subnet": "10.0.0.0/15"})
    assert r["failed"] and "wider than /16" in r["msg"] and "10.0.0.0/15" in r["msg"]
    r = _module({"subnet": SUBNET, "port": ssh_port, "timeout_ms": 300, "_ansible_check_mode": True})
    assert not r.get("failed") and r["changed"] is False
    assert [h["addr"] for h in r["found"]] == ["127.0.0.2", "127.0.0.3"]


def test_discover_play_adds_hosts(ssh_port):
    spec = {"subnet": SUBNET, "port": ssh_port, "timeout_ms": 300, "worker_port": 9300,
            "ssh_hosts": [f"127.0.0.7:{ssh_port}"]}
    r = playbook("playbooks/discover.yml", "-i", "inventory", "-e", json.dumps({"layerline_discover": spec}),
                 timeout=120)
    out = " ".join(r.stdout.split())
    assert "added: 127.0.0.2 127.0.0.3" in out
    # the inventory's local hosts are known at 127.0.0.1: hand-written hosts win
    assert "skipped (already in the inventory): 127.0.0.1" in out
    assert f"not added: 127.0.0.7:{ssh_port}: connection refused" in out
    assert "group layerline: w1 w2 w3 127.0.0.2 127.0.0.3" in out
    assert set(recap(r.stdout)) == {"w1"}  # once, for the first host: no localhost in the recap


def test_cluster_discover_is_idempotent(ssh_port, tmp_path):
    """Through layerline.Cluster, from an inventory with no hosts of its own yet (the play runs on localhost)."""
    from layerline import Cluster
    spec = {"subnet": SUBNET, "port": ssh_port, "timeout_ms": 300, "worker_port": 9300, "device": "cpu"}
    # no hosts yet, so the spec is an all-group var (localhost is in no other group)
    c = Cluster.from_config({"all": {"vars": {"layerline_discover": spec}},
                             "layerline": {"hosts": {}, "vars": {"layerline_checkpoint": str(tmp_path / "m")}}},
                            data_dir=tmp_path / "data", quiet=True)
    added, failures = c.discover()
    assert added == 2
    assert [a for a, _ in failures] == ["127.0.0.4"]
    assert c.discovered["127.0.0.2"]["ansible_host"] == "127.0.0.2"
    assert int(c.discovered["127.0.0.3"]["ansible_port"]) == ssh_port
    assert int(c.discovered["127.0.0.3"]["layerline_port"]) == 9300
    assert c.discovered["127.0.0.3"]["layerline_device"] == "cpu"
    # added hosts share the play's host's layerline_home (here localhost's: the Cluster's DATA_DIR/home)
    assert {h["layerline_home"] for h in c.discovered.values()} == {str(tmp_path / "data" / "home")}
    # the second run sees them in the inventory (by address) and adds nothing
    assert c.discover() == (0, [("127.0.0.4", failures[0][1])])
    assert sorted(c.discovered) == ["127.0.0.2", "127.0.0.3"]
