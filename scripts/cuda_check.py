"""The CUDA path on a GPU machine: the probe, workers started from the deploy's launch spec, a drive
against one process on the CPU, and the server answering over HTTP with an API key. Two models:
the demo checkpoint at bf16, and a random GGUF of quantized blocks (Q8_0, Q4_K, Q6_K) at precision
gguf (on CUDA its matrices are dequantized to float32). Run by hand where a GPU is lent; never in
tests or CI.

    python scripts/cuda_check.py OUTDIR [DEVICE]   (DEVICE cuda:0 by default; cpu to try the script)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from layerline.checkpoint import read_index, write_demo_checkpoint
from layerline.local import controller_keys, free_ports, local_keys, local_plan, stop_local
from layerline.model.loader import load_stage
from layerline.pipeline import pipeline_for_plan
from layerline.spec import worker_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "multihost"))
from big_gguf import Shape, write_big_gguf  # noqa: E402  (random quantized blocks, as the big-model test writes)


def wait_ready(procs, timeout: float = 300) -> None:
    for p, spec in procs:
        deadline = time.time() + timeout
        while not os.path.exists(spec.ready_file):
            assert p.poll() is None and time.time() < deadline, f"{spec.host} did not start"
            time.sleep(0.2)


def serve_and_ask(out: str, tag: str, plan_path: str, ctl: str, ckpt: str, prompt) -> dict:
    """The server over the running workers: 401 without the key, 200 and a stream with it."""
    port = free_ports(1)[0]
    keyfile = os.path.join(os.path.dirname(plan_path), "api-keys")
    with open(os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write("sk-cuda-check\n")
    srv = subprocess.Popen([sys.executable, "-m", "layerline.server", "--plan", plan_path, "--keys", ctl,
                            "--checkpoint", ckpt, "--model-name", tag, "--port", str(port), "--api-keys", keyfile],
                           stdout=open(os.path.join(out, f"server-{tag}.log"), "w"), stderr=subprocess.STDOUT)
    rep: dict = {}
    try:
        url, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer sk-cuda-check"}
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert srv.poll() is None and time.time() < deadline, "server did not come up"
            time.sleep(0.3)
        body = {"model": tag, "prompt": prompt, "max_tokens": 16, "temperature": 0}
        rep["no_key_status"] = httpx.post(url + "/v1/completions", json=body, timeout=60).status_code
        t = time.time()
        r = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=180)
        rep["status"], rep["seconds"] = r.status_code, round(time.time() - t, 2)
        rep["text"] = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
        chunks = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=auth,
                          timeout=180) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:])["choices"][0]["text"])
        rep["stream_equals"] = "".join(chunks) == rep["text"]
        rep["health"] = httpx.get(url + "/health", timeout=10).json().get("status")
        assert rep["no_key_status"] == 401 and r.status_code == 200 and rep["stream_equals"], rep
    finally:
        srv.terminate()
        srv.wait(20)
    return rep


def check(out: str, tmp: str, tag: str, ckpt: str, precision: str, device: str, prompt) -> dict:
    """Two workers on `device` at `precision`, a drive against the whole model at fp32 on the CPU,
    and the server."""
    rep: dict = {"precision": precision}
    work = os.path.join(tmp, f"run-{tag}")
    os.makedirs(work)
    ports = free_ports(2)
    keys_root = local_keys(work, 2)
    hv = {f"stage{i}": {"ansible_connection": "local", "layerline_port": ports[i], "layerline_checkpoint": ckpt,
                        "layerline_state_dir": os.path.join(work, f"stage{i}"), "layerline_device": device,
                        "layerline_precision": precision, "layerline_keys_dir": os.path.join(keys_root, f"stage{i}")}
          for i in range(2)}
    plan = local_plan(ckpt, 2, precision, hv)
    rep["plan"] = [{"host": s.host, "layers": list(s.layers), "device": s.device, "precision": s.precision}
                   for s in plan.stages]
    procs = []
    try:
        for st in plan.stages:
            spec = worker_spec(plan, st.host, hv[st.host], python=sys.executable)
            os.makedirs(spec.state_dir, mode=0o700, exist_ok=True)
            procs.append((subprocess.Popen(spec.argv, stdout=open(os.path.join(out, f"{tag}-{st.host}.log"), "w"),
                                           stderr=subprocess.STDOUT), spec))
        t = time.time()
        wait_ready(procs)
        rep["workers_ready_s"] = round(time.time() - t, 1)
        ctl = controller_keys(work)
        pipe = pipeline_for_plan(plan, keys_dir=ctl)
        ids = torch.tensor([[5, 17, 42, 99, 7, 200, 12, 8, 64, 3, 250, 77]])
        t = time.time()
        logits = pipe.forward(ids, seq="c1", pos=0).logits.float()
        rep["drive_forward_s"] = round(time.time() - t, 3)
        ref = load_stage(ckpt, 0, read_index(ckpt).num_layers, True, True, "fp32")(ids, start_pos=0).float()
        rep["max_abs_diff_vs_fp32_cpu"] = float((logits - ref).abs().max())
        rep["ref_abs_max"] = float(ref.abs().max())
        rep["top1_agree"] = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        assert rep["top1_agree"] >= 0.75, rep
        plan_path = os.path.join(work, "plan.json")
        with open(plan_path, "w") as f:
            json.dump(plan.to_dict(), f)
        rep["server"] = serve_and_ask(out, tag, plan_path, ctl, ckpt, prompt)
    finally:
        stop_local([p for p, _ in procs])
    return rep


def main(out: str, device: str) -> int:
    os.makedirs(out, exist_ok=True)
    report: dict = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    tmp = tempfile.mkdtemp(prefix="ll-cuda-")
    ok = False
    try:
        demo = str(write_demo_checkpoint(os.path.join(tmp, "demo"), layers=4, hidden=256, vocab=1000,
                                         dtype="float32", seed=3))
        # 1. the probe, as the worker's --probe mode runs it
        t = time.time()
        caps = json.loads(subprocess.run([sys.executable, "-m", "layerline.worker", "--probe", "--checkpoint", demo,
                                          "--device", device], check=True, capture_output=True, text=True).stdout)
        report["probe"] = {"seconds": round(time.time() - t, 1),
                           "devices": [{k: d.get(k) for k in ("name", "kind", "memory_bytes", "flops_per_s",
                                                                "mem_bw_bytes_per_s")} for d in caps["devices"]]}
        assert any(d["name"] == device for d in caps["devices"]), f"probe found no {device}"
        # 2. the demo model at bf16
        report["demo_bf16"] = check(out, tmp, "demo", demo, "bf16", device, [5, 17, 42, 99])
        # 3. a GGUF of quantized blocks at precision gguf
        shape = Shape(layers=4, hidden=512, ffn=1536, heads=8, kv_heads=2, context=512)
        gguf = str(write_big_gguf(Path(tmp) / "q.gguf", shape))
        report["gguf"] = check(out, tmp, "gguf", gguf, "gguf", device, "Hello there")
        ok = True
    finally:
        report["ok"] = ok
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(json.dumps(report, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cuda-check-out", sys.argv[2] if len(sys.argv) > 2 else "cuda:0"))
