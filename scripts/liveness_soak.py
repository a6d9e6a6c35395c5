"""Liveness under load (issue 37, item 1's proof): streams plus a CPU hog, and the failovers counted.

    .venv/bin/python scripts/liveness_soak.py [--minutes 10] [--streams 8] [--hogs N] [--checkpoint DIR]
        [--prompt 256] [--new 64] [--stages 3]

Three local worker stages (`layerline.local.local_stages`, fresh keys), `python -m layerline.server`
over them with its default health settings (every 0.5 s, 2 s deadline, 2 misses in a row), `--streams`
clients streaming greedy completions back to back (long prompts: every prefill chunk is a long
forward), and `--hogs` busy processes (default: one per CPU) at the workers' own priority for the
whole run. At the end it reads the server's /metrics and log and prints one JSON object:
failovers (layerline_failovers_total, every action), the route epoch, how many health checks
were missed without counting as down, requests completed and failed. Zero failovers is the goal;
a missed check now and then is what the miss window is for. Not part of the test suite: minutes.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _hog(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def _metrics(url: str) -> dict[str, float]:
    import httpx
    out: dict[str, float] = {}
    for m in re.finditer(r"^(layerline_[a-z_]+)(\{[^}]*\})? (\S+)$", httpx.get(url + "/metrics", timeout=10).text,
                         re.M):
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy processes beside the workers")
    p.add_argument("--checkpoint", default=None, help="default: a 6-layer demo checkpoint (hidden 512)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens (long prefills)")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--stages", type=int, default=3)
    a = p.parse_args(argv)
    import httpx

    from layerline.checkpoint import write_demo_checkpoint
    from layerline.local import controller_keys, local_server, local_stages, stop_local, stop_server
    ckpt = a.checkpoint or str(write_demo_checkpoint(ROOT / ".cache" / "liveness-soak-ckpt", layers=6, hidden=512,
                                                     vocab=2048, dtype="float32", seed=0))
    procs, first, tmp, depth = local_stages(ckpt, a.stages, "fp32", threads=1)
    server = None
    hogs: list = []
    try:
        log = os.path.join(tmp, "server.log")
        server, url = local_server(["--first", first, "--first-key", "stage0", "--keys", controller_keys(tmp),
                                    "--checkpoint", ckpt, "--model-name", "soak", "--microbatches", str(depth),
                                    "--log-file", log], tmp, timeout_s=120)
        t0 = time.time()
        stop_at = t0 + a.minutes * 60
        hogs = [mp.get_context("spawn").Process(target=_hog, args=(stop_at,), daemon=True) for _ in range(a.hogs)]
        for h in hogs:
            h.start()
        done, failed, errors = [0], [0], []
        lock = threading.Lock()

        def client(k: int) -> None:
            j = 0
            with httpx.Client(timeout=600) as c:
                while time.time() < stop_at:
                    prompt = [(k * 131 + j * 17 + i) % 2000 + 3 for i in range(a.prompt)]
                    j += 1
                    body = {"model": "soak", "prompt": prompt, "max_tokens": a.new, "temperature": 0,
                            "stream": True, "ignore_eos": True}
                    try:
                        n, err = 0, None
                        with c.stream("POST", url + "/v1/completions", json=body) as r:
                            for line in r.iter_lines():
                                if line.startswith("data: ") and line != "data: [DONE]":
                                    d = json.loads(line[6:])
                                    err = d.get("error") or err
                                    n += len((d.get("choices") or [{}])[0].get("token_ids") or [])
                        ok = r.status_code == 200 and err is None and n == a.new
                    except httpx.HTTPError as e:
                        ok, err = False, repr(e)
                    with lock:
                        (done if ok else failed)[0] += 1
                        if not ok and len(errors) < 5:
                            errors.append(str(err)[:300])
        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(a.streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        m = _metrics(url)
        text = Path(log).read_text() if os.path.exists(log) else ""
        report = {"minutes": a.minutes, "streams": a.streams, "hogs": a.hogs, "stages": a.stages,
                  "prompt": a.prompt, "new": a.new,
                  "failovers": sum(v for k, v in m.items() if k.startswith("layerline_failovers_total")),
                  "route_epoch": m.get("layerline_route_epoch"),
                  "stages_down_logged": len(re.findall(r" is down: ", text)),
                  "health_misses_below_the_limit": len(re.findall(r"missed a health check", text)),
                  "requests_completed": done[0], "requests_failed": failed[0], "errors": errors,
                  "seconds": round(time.time() - t0, 1)}
        print(json.dumps(report), flush=True)
        return 0 if report["failovers"] == 0 else 1
    finally:
        for h in hogs:
            h.kill()
        stop_server(server)
        stop_local(procs)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
