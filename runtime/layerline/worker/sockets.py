"""The worker's ZeroMQ sockets and their CURVE keys.

Two ROUTER sockets: data at --bind (pipeline traffic) and control at --control (default: the bind
port + 1). A DEALER to --next (the route's next stage, re-pointed by the control op set_next) and
DEALERs to drivers' result sockets (reply_to), the most recent MAX_REPLY_PEERS kept.

CURVE (layerline.keys), with this host's keys from --keys DIR (required): the control socket
runs it always, loopback included, and lets in only the controller's key (DIR/allowed/
controller.key), so no other process can stop, redirect or even probe a worker. Every other
socket runs it too, loopback included (--curve auto and on alike: keys.curve_on), so a local
process without the deployment's keys can neither use the model nor release or rewind a
sequence; the data socket lets in only clients whose public key is in DIR/allowed/; the DEALER to --next
trusts only the key DIR/peers/NEXT.key (--next-key NEXT: a host name, a .key file or the z85
key); results go to a driver's reply_to only as the holder of DIR/peers/controller.key, never
to a key a message names.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from collections import OrderedDict

import zmq

from .. import keys as keymod
from .. import wire
from ..errors import LayerlineError
from ..wire import MAX_REPLY_PEERS
from .cli import control_endpoint


class Sockets:
    """Keys are loaded when made (a host that cannot speak CURVE fails before it loads any layer);
    `open()` binds and connects."""

    def __init__(self, args: argparse.Namespace, name: str):
        self.args, self.name = args, name
        self.control_addr = args.control or control_endpoint(args.bind)
        self.curve_bind = keymod.curve_on(args.curve, args.bind)
        why = "every worker socket runs CURVE, loopback included (only the deployment's keys may use a worker)"
        self.keys = keymod.load_host_keys(args.keys, "--keys", why, hint=keymod.LOCAL_HINT)
        if self.keys.controller is None:
            raise keymod.KeysError(f"--keys {args.keys}: has no allowed/{keymod.CONTROLLER}.key, the one key the "
                                   "control socket lets in; re-run playbooks/keys.yml (or `python -m layerline.keys "
                                   "local`)")
        if args.next and keymod.curve_on(args.curve, args.next):
            self.keys.server_key(args.next_key, "--next-key")
        self.ctx = self.auth = self.data = self.control = None
        self.next = None
        self.next_lock = threading.Lock()   # the control thread's set_next swaps what the compute thread sends on
        self.next_addr: str | None = None
        self.next_key: str | None = None
        self.peers: OrderedDict[str, zmq.Socket] = OrderedDict()

    def open(self) -> None:
        self.ctx = zmq.Context()
        # the ZAP handler must run before a CURVE server binds: without one, any key gets in
        self.auth = keymod.Allowlist(self.ctx, self.keys.allowed, on_deny=self._denied, control=self.keys.controller)
        self.data = self._bound(zmq.ROUTER, self.args.bind, self.curve_bind)
        self.control = self._bound(zmq.ROUTER, self.control_addr, True, control=True)
        if self.args.next:
            self.set_next(self.args.next, self.args.next_key)

    def _denied(self, public: str, domain: str = "") -> None:
        if domain == keymod.CONTROL_DOMAIN:
            where = f"the controller's ({os.path.join(self.keys.dir, 'allowed', keymod.CONTROLLER + '.key')})"
            print(f"layerline worker {self.name}: refused a control client whose key {public} is not {where}",
                  file=sys.stderr, flush=True)
            return
        print(f"layerline worker {self.name}: refused a CURVE client whose key {public} is not in "
              f"{os.path.join(self.keys.dir, 'allowed')}", file=sys.stderr, flush=True)

    def _bound(self, kind, addr: str, curve: bool, control: bool = False) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 1000)
        s.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # no frame a sender may send is larger than a tensor chunk (or, on control, a header), plus
        # room for CURVE's per-frame box: zmq drops a peer that announces more before it allocates
        # a byte, so a lying sender cannot make this process hold gigabytes
        limit = wire.MAX_HEADER_BYTES if control else wire.MAX_FRAME_BYTES
        s.setsockopt(zmq.MAXMSGSIZE, limit + 4096)
        if control:
            keymod.serve_control(s, self.keys)
        elif curve:
            keymod.serve_curve(s, self.keys)
        try:
            s.bind(addr)
        except zmq.ZMQError as e:
            raise LayerlineError(f"{self.name}: cannot bind {addr} ({e}); is another worker on this port? "
                                 "set layerline_port") from None
        return s

    def set_next(self, addr: str, key: str | None = None, names_only: bool = False) -> None:
        """Point the DEALER to the next stage at `addr`; with CURVE, `key` names its host (peers/)."""
        addr = wire.endpoint(addr, "next")
        server = None
        if keymod.curve_on(self.args.curve, addr):
            server = self.keys.server_key(key, "next_key" if names_only else "--next-key", names_only=names_only)
        s = self._dealer(addr, server, "next")   # on failure the old route stays
        with self.next_lock:
            if self.next is not None:
                self.next.close(linger=1000)
            # the next hop's host name is reported (health): the server follows it to find each
            # stage's key for the control socket
            self.next, self.next_addr, self.next_key = s, addr, key

    def _dealer(self, addr: str, server, what: str) -> zmq.Socket:
        """A DEALER connected to addr (CURVE toward `server`'s key when given); closed again when the
        connect fails, so no bad address leaks a socket."""
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 1000)
        try:
            if server is not None:
                keymod.connect_curve(s, self.keys, server)
            s.connect(addr)
        except zmq.ZMQError as e:
            s.close(linger=0)
            raise wire.WireError(f"{what}: cannot connect to {addr} ({e})") from None
        return s

    def peer(self, addr: str) -> zmq.Socket:
        """A DEALER to a driver's result socket (reply_to), kept for reuse. Under CURVE it only
        talks to the controller's key (peers/controller.key): whoever else listens at reply_to
        completes no handshake and reads nothing."""
        addr = wire.endpoint(addr, "header.reply_to")
        s = self.peers.pop(addr, None)
        if s is None:
            server = None
            if keymod.curve_on(self.args.curve, addr):
                server = self.keys.server_key(keymod.CONTROLLER, "header.reply_to", names_only=True)
            s = self._dealer(addr, server, "header.reply_to")
            while len(self.peers) >= MAX_REPLY_PEERS:
                self.peers.popitem(last=False)[1].close(linger=0)
        self.peers[addr] = s
        return s

    def send(self, sock: zmq.Socket, msg: list, where: str | None) -> None:
        """Never block the loop on a peer that is gone or full: the control socket must stay live."""
        try:
            sock.send_multipart(msg, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise LayerlineError(f"stage {self.name}: {where} is not taking messages (down, or its queue is "
                                 "full); check that worker's health") from None

    def send_next(self, msg: list) -> None:
        with self.next_lock:
            self.send(self.next, msg, self.next_addr)

    def close(self) -> None:
        for s in [self.data, self.control, self.next, *self.peers.values()]:
            if s is not None:
                s.close(linger=1000)
        if self.auth is not None:
            self.auth.stop()
        if self.ctx is not None:
            self.ctx.term()
