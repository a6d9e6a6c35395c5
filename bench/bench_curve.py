"""What CURVE costs per hop on loopback: the same wire messages echoed with and without CURVE.

    python bench/bench_curve.py [--hidden 2048] [--tokens 1,512] [--rounds 15] [--per-round 200]

Every worker, driver and server socket runs CURVE, loopback included (layerline.keys.curve_on),
so a pipeline cannot be run without it; this measures the transport alone. An echo process (a
ROUTER, as a worker's data socket) sends every message back; the client (a DEALER, as a driver)
times round trips of one forward message (`wire.encode` of a bf16 hidden state [1, T, hidden]:
T=1 is a decode step's hop, T=512 a prefill chunk's). Baseline: the same echo without CURVE, in
the same run, rounds interleaved so a noisy spell hits both. A hop is one direction: half a round
trip. Prints one JSON object: per size, the median ms per hop with and without CURVE, the extra
ms per hop and the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time


def _echo(port: int, keys_dir: str | None) -> None:
    import zmq

    from layerline import keys
    ctx = zmq.Context()
    srv = ctx.socket(zmq.ROUTER)
    if keys_dir:
        hk = keys.load_host_keys(keys_dir)
        keys.Allowlist(ctx, hk.allowed)   # as a worker: only the deployment's keys get in
        keys.serve_curve(srv, hk)
    srv.bind(f"tcp://127.0.0.1:{port}")
    while True:
        srv.send_multipart(srv.recv_multipart(copy=False), copy=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tokens", default="1,512", help="tokens per message, comma-separated")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--per-round", type=int, default=200, help="round trips per round (fewer for big messages)")
    a = p.parse_args(argv)
    import multiprocessing as mp

    import torch
    import zmq

    from layerline import keys, wire
    tmp = tempfile.mkdtemp(prefix="layerline-bench-curve-")
    kd = keys.local_keys(os.path.join(tmp, "keys"), ["worker"])
    ctx = zmq.Context()
    socks, procs = {}, []
    try:
        for mode in ("plain", "curve"):
            port = _free_port()
            pr = mp.get_context("spawn").Process(target=_echo, args=(port, kd["worker"] if mode == "curve" else None),
                                                 daemon=True)
            pr.start()
            procs.append(pr)
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, 60_000)   # an echo that died raises zmq.Again, not a hang
            if mode == "curve":
                hk = keys.load_host_keys(kd["controller"])
                keys.connect_curve(s, hk, hk.server_key("worker"))
            s.connect(f"tcp://127.0.0.1:{port}")
            socks[mode] = s
        out = {"hidden": a.hidden, "dtype": "bfloat16", "rounds": a.rounds, "sizes": []}
        for t in (int(x) for x in a.tokens.split(",")):
            x = torch.zeros(1, t, a.hidden, dtype=torch.bfloat16)
            msg = wire.encode({"op": "forward", "id": wire.new_id("r"), "seq": wire.new_id("s"), "pos": 0,
                               "cache": True, "timings": []}, {"hidden": x})
            n = max(5, a.per_round if t == 1 else a.per_round // 10)
            for s in socks.values():   # connect, handshake, warm
                for _ in range(5):
                    s.send_multipart(msg, copy=False)
                    s.recv_multipart()
            med: dict[str, list[float]] = {"plain": [], "curve": []}
            for _ in range(a.rounds):
                for mode, s in socks.items():
                    times = []
                    for _ in range(n):
                        t0 = time.perf_counter()
                        s.send_multipart(msg, copy=False)
                        s.recv_multipart(copy=False)
                        times.append(time.perf_counter() - t0)
                    med[mode].append(statistics.median(times))
            plain, curve = (statistics.median(med[m]) / 2 * 1e3 for m in ("plain", "curve"))  # ms per hop
            out["sizes"].append({"tokens": t, "bytes": x.numel() * 2, "plain_ms_per_hop": round(plain, 4),
                                 "curve_ms_per_hop": round(curve, 4), "curve_extra_ms_per_hop": round(curve - plain, 4),
                                 "ratio": round(curve / plain, 2)})
        print(json.dumps(out))
        return 0
    finally:
        for s in socks.values():
            s.close(0)
        ctx.term()
        for pr in procs:
            pr.kill()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
