"""The worker process: its sockets, its compute and the loop that feeds one from the other.

Every data message is validated; any failure becomes an error reply (to the sender, and to the
driver's reply_to when it names one), never a dead worker. `op: release, seq` frees a sequence's
KV cache (or a prefix entry's) here and on every later stage; with `keep: ENTRY, len: N` its first
N tokens stay as prefix entry ENTRY (layerline.model.kv.KVPool.keep) for later forks. A stage that
is first and last runs ahead: between messages it computes the greedy steps it expects next
(layerline.worker.stage, "Running ahead").

Two threads: the compute thread (the process's main thread) reads the data socket and runs each
forward; the control thread owns the control socket and answers it (layerline.worker.control)
whatever the compute thread is doing, so a long prefill on a loaded machine never makes a worker
miss its health deadline. The only thing both touch is the DEALER to the next stage, which a
set_next swaps under Sockets.next_lock.
"""
from __future__ import annotations

import argparse
import os
import threading
import time

import zmq

from .. import awake, version, wire
from ..errors import LayerlineError
from ..files import atomic_write_json
from ..model import cpu_kernels
from ..model.kv import KVRows, Stale
from . import control
from .sockets import Sockets
from .stage import StageCompute


class Worker:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.name = args.name or f"stage{args.start}-{args.end}"
        # keys first: a host that cannot speak CURVE fails before it loads any layer
        self.net = Sockets(args, self.name)
        self.compute = StageCompute(args, self.name)
        self.net.open()
        self.running = True
        self.parked_by = None   # the sender's identity of the step StageCompute parked (compute.parked)
        # spinners as many as the threads a step runs on; they spin only after a message
        ms = awake.WINDOW_S * 1000 if args.awake_ms is None else args.awake_ms
        self.awake = awake.Awake(self.compute.torch.get_num_threads(), ms / 1000)
        self.compute.prepare(self.awake)

    def write_ready(self) -> None:
        if not self.args.ready_file:
            return
        c = self.compute
        info = {"pid": os.getpid(), "name": self.name, "bind": self.args.bind, "control": self.net.control_addr,
                "layers": [self.args.start, self.args.end], "precision": self.args.precision,
                "device": self.args.device, "curve": self.net.curve_bind, "compile": self.args.compile,
                "compiled": c.stage.compiled, "compile_s": c.compile_s,
                "compile_error": c.stage.compile_error, "kernels": cpu_kernels.status(),
                "step_s": c.step_s, "version": version.full(), "protocol": wire.PROTOCOL, "time": time.time()}
        os.makedirs(os.path.dirname(os.path.abspath(self.args.ready_file)), exist_ok=True)
        atomic_write_json(self.args.ready_file, info, mode=0o644)

    def handle_data(self, frames: list) -> None:
        ident, body = frames[0], frames[1:]
        stats = self.compute.stats
        h = None
        try:
            h, tensors = wire.decode(body)
            bad = version.mismatch(body[0], "the sender", f"stage {self.name}")
            if bad:   # a peer on other code: refused, naming both versions (to the sender and reply_to)
                raise wire.WireError(bad)
            if h["op"] == "release":
                self.compute.drop_ahead()
                seq = wire.require(h, "seq", str)
                kept = wire.keep(h, self.args.kv_context)
                if kept is None:
                    self.compute.kv.release(seq)
                else:
                    self.compute.kv.keep(seq, *kept)
                if self.net.next is not None:
                    fwd = {"op": "release", "seq": seq}
                    if kept is not None:
                        fwd.update(keep=kept[0], len=kept[1])
                    self.net.send_next(wire.encode(fwd))
                return
            if h["op"] != "forward":
                raise wire.WireError(f"header.op: {h['op']!r} is not a data op here (forward, release)")
            if "reply_to" in h:
                wire.endpoint(h["reply_to"], "header.reply_to")
            elif self.args.last:
                raise wire.WireError("header.reply_to: required, the last stage sends results there")
            stats.requests += 1
            out = self.compute.forward(h, tensors)
            if out is None:   # parked: answer_parked sends it
                self.parked_by = ident
                return
            self._send(h, *out)
        except Stale as e:  # answered: the sender drops it if it forgot the request, else fails just these
            stats.stale_dropped += 1
            self._error(ident, h, str(e), e.code, e.header)
        except (wire.WireError, KVRows) as e:  # the message's fault
            stats.rejected += 1
            self._error(ident, h, str(e))
        except Exception as e:  # noqa: BLE001 - the worker never dies of one request
            stats.errors += 1
            text = str(e) if isinstance(e, LayerlineError) else f"{e.__class__.__name__}: {e}"
            self._error(ident, h, text, getattr(e, "code", None), getattr(e, "header", None))

    def _send(self, h: dict, out_h: dict, out_t: dict) -> None:
        msg = wire.encode(out_h, out_t)
        if self.args.last:
            self.net.send(self.net.peer(h["reply_to"]), msg, h["reply_to"])
        else:
            self.net.send_next(msg)

    def answer_parked(self, force: bool) -> None:
        """Send the parked step's answer once it is due (StageCompute.unpark)."""
        p = self.compute.parked
        if p is None:
            return
        try:
            out = self.compute.unpark(force)
            if out is None:
                return
            self._send(p.h, *out)
            self.awake.poke()  # the next message is due within a step
        except Exception as e:  # noqa: BLE001 - the worker never dies of one request
            self.compute.abandon_parked()
            self.compute.stats.errors += 1
            self._error(self.parked_by, p.h, f"{e.__class__.__name__}: {e}")

    def _error(self, ident, h: dict | None, text: str, code: str | None = None, extra: dict | None = None) -> None:
        reply = {"op": "error", "stage": self.name, "error": text[:2000]}
        if code:
            reply["code"] = code
        if extra:
            reply.update(extra)
        if h and isinstance(h.get("id"), str):
            reply["id"] = h["id"]
        msg = wire.encode(reply)
        # the sender hears it; the driver waits on its result socket (reply_to), so it hears there too
        try:
            self.net.data.send_multipart([ident, *msg], flags=zmq.NOBLOCK)
            if h and "reply_to" in h:
                self.net.peer(h["reply_to"]).send_multipart(msg, flags=zmq.NOBLOCK)
        except Exception:  # noqa: BLE001 - an unreachable asker is not a reason to die
            pass

    POLL_MS = 200   # how soon either thread sees `running` go false (shutdown, SIGTERM)

    def serve(self) -> None:
        net = self.net
        self.control_thread = threading.Thread(target=self.serve_control, name="layerline-control", daemon=True)
        self.control_thread.start()
        self.write_ready()
        poller = zmq.Poller()
        poller.register(net.data, zmq.POLLIN)
        try:
            while self.running:
                if poller.poll(self.POLL_MS):
                    self.answer_parked(force=True)   # a parked step is answered before what came after it
                    frames = net.data.recv_multipart(copy=False)
                    if len(frames) >= 2:
                        self.handle_data(frames)
                        self.awake.poke()  # the next message is due within a pipeline's step
                # a stage holding the whole model computes the step it expects next while the
                # driver's round trip runs (StageCompute.run_ahead), unless a message waits
                while self.compute.can_run_ahead() and not poller.poll(0):
                    self.compute.run_ahead()
                    self.answer_parked(force=False)
                self.answer_parked(force=False)
        finally:
            self.running = False
            self.close()

    def serve_control(self) -> None:
        """The control thread: answers the control socket while the compute thread computes."""
        poller = zmq.Poller()
        poller.register(self.net.control, zmq.POLLIN)
        while self.running:
            if poller.poll(self.POLL_MS):
                frames = self.net.control.recv_multipart(copy=False)
                if len(frames) >= 2:
                    control.handle(self, frames)

    def close(self) -> None:
        t = getattr(self, "control_thread", None)
        if t is not None:
            t.join(5)   # it sees running false within POLL_MS: its socket closes after it stops
        self.awake.close()
        self.net.close()
        if self.args.ready_file:
            try:
                os.unlink(self.args.ready_file)
            except FileNotFoundError:
                pass
