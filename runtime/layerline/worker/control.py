"""The control protocol: the ops a worker answers on its control socket.

health (name, pid, layers, next hop and its host, uptime, CURVE, bytes its prefix entries hold), stats (counters, sequences held,
compile and kernel state, the timed step, paged experts), set_next (a new next hop: a host name
whose key is in the keys dir's peers/), shutdown. Only the controller's key gets in
(layerline.worker.sockets). A bad op gets an error reply and counts as rejected. Answered on the
worker's control thread (layerline.worker.serve), never behind a forward.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING

import zmq

from .. import keys as keymod
from .. import version, wire
from ..model import cpu_kernels

if TYPE_CHECKING:
    from .serve import Worker

OPS = ("health", "stats", "set_next", "shutdown")


def answer(w: "Worker", h: dict) -> dict:
    """The reply to one control op (raises on a bad one)."""
    op = h["op"]
    c, net = w.compute, w.net
    if op == "health":
        return {"op": "ok", "name": w.name, "pid": os.getpid(), "layers": [w.args.start, w.args.end],
                "next": net.next_addr, "uptime_s": time.time() - c.stats.started,
                "curve": net.curve_bind, "next_key": net.next_key, "version": version.full(),
                "protocol": wire.PROTOCOL, "prefix_bytes": c.kv.entry_bytes}
    if op == "stats":
        s = c.stats
        reply = {"op": "ok", "name": w.name, "requests": s.requests, "errors": s.errors,
                 "rejected": s.rejected, "stale_dropped": s.stale_dropped, "compute_s": s.compute_s,
                 "ahead_used": s.ahead_used, "ahead_dropped": s.ahead_dropped,
                 "threads": {str(n): k for n, k in sorted(dict(s.threads).items())},
                 "sequences": len(c.kv), "prefix_entries": c.kv.entries, "prefix_bytes": c.kv.entry_bytes,
                 "compile": w.args.compile, "compile_s": c.compile_s,
                 "compiled": c.stage.compiled, "compile_error": c.stage.compile_error,
                 "kernels": cpu_kernels.status(), "step_s": c.step_s}
        if w.args.compile != "off":  # graphs compiled so far: serving should add none
            from torch._dynamo.utils import counters
            reply["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
        store = getattr(c.stage, "expert_store", None)
        if store is not None and hasattr(store, "stats"):  # paged experts: hits, misses, bytes read
            reply["experts"] = dataclasses.asdict(store.stats)
        return reply
    if op == "set_next":
        key = h.get("next_key")
        if key is not None and not (isinstance(key, str) and keymod.NAME_RE.match(key)):
            raise wire.WireError("header.next_key: must be a host name (its key is in the keys dir's peers/)")
        net.set_next(wire.require(h, "next", str), key, names_only=True)
        return {"op": "ok", "name": w.name, "next": net.next_addr}
    if op == "shutdown":
        w.running = False
        return {"op": "ok", "name": w.name}
    raise wire.WireError(f"header.op: {op!r} is not a control op ({', '.join(OPS)})")


def handle(w: "Worker", frames: list) -> None:
    """Answer one control message (ROUTER frames: the asker's id, then the message)."""
    ident, body = frames[0], frames[1:]
    h = None
    try:
        h, _ = wire.decode(body)
        bad = version.mismatch(body[0], "the controller", f"stage {w.name}")
        if bad:
            raise wire.WireError(bad)
        reply = answer(w, h)
    except Exception as e:  # noqa: BLE001
        w.compute.stats.rejected += 1
        reply = {"op": "error", "stage": w.name, "error": str(e)[:2000]}
    if h and isinstance(h.get("id"), str):  # decode checked it: the asker can match the answer
        reply["id"] = h["id"]
    try:
        w.net.control.send_multipart([ident, *wire.encode(reply)], flags=zmq.NOBLOCK)
    except zmq.ZMQError:  # an asker that is gone or not reading is not a reason to stall
        pass
