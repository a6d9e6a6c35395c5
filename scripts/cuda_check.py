"""The CUDA path on a GPU machine (device=cuda:0, bf16): the probe, two workers, a drive against one
process, and the server answering over HTTP. Run by hand where a GPU is lent; never in tests or CI.

    python scripts/cuda_check.py OUTDIR [DEVICE]   (DEVICE cuda:0 by default; cpu to try the script)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
import torch

from layerline.checkpoint import read_index, write_demo_checkpoint
from layerline.local import controller_keys, free_ports, local_keys, local_plan, stop_local
from layerline.model.loader import load_stage
from layerline.pipeline import pipeline_for_plan
from layerline.spec import worker_spec


def main(out: str, device: str) -> int:
    os.makedirs(out, exist_ok=True)
    report: dict = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    tmp = tempfile.mkdtemp(prefix="ll-cuda-")
    ckpt = write_demo_checkpoint(os.path.join(tmp, "ckpt"), layers=4, hidden=256, vocab=1000, dtype="float32", seed=3)

    # 1. the probe, as the worker's --probe mode runs it
    t = time.time()
    caps = json.loads(subprocess.run([sys.executable, "-m", "layerline.worker", "--probe", "--checkpoint", ckpt,
                                      "--device", device], check=True, capture_output=True, text=True).stdout)
    report["probe"] = {"seconds": round(time.time() - t, 1),
                       "devices": [{k: d.get(k) for k in ("name", "kind", "memory_bytes", "flops_per_s",
                                                            "mem_bw_bytes_per_s")} for d in caps["devices"]]}
    assert any(d["name"] == device for d in caps["devices"]), f"probe found no {device}"

    # 2. two workers on cuda:0 at bf16, planned and started as a deploy would
    ports = free_ports(2)
    keys_root = local_keys(tmp, 2)
    hv = {f"stage{i}": {"ansible_connection": "local", "layerline_port": ports[i], "layerline_checkpoint": ckpt,
                        "layerline_state_dir": os.path.join(tmp, f"stage{i}"), "layerline_device": device,
                        "layerline_precision": "bf16", "layerline_keys_dir": os.path.join(keys_root, f"stage{i}")}
          for i in range(2)}
    plan = local_plan(ckpt, 2, "bf16", hv)
    report["plan"] = [{"host": s.host, "layers": list(s.layers), "device": s.device, "precision": s.precision}
                      for s in plan.stages]
    procs = []
    try:
        for st in plan.stages:
            spec = worker_spec(plan, st.host, hv[st.host], python=sys.executable)
            os.makedirs(spec.state_dir, mode=0o700, exist_ok=True)
            procs.append((subprocess.Popen(spec.argv, stdout=open(os.path.join(out, f"{st.host}.log"), "w"),
                                           stderr=subprocess.STDOUT), spec))
        for p, spec in procs:
            deadline = time.time() + 300
            while not os.path.exists(spec.ready_file):
                assert p.poll() is None and time.time() < deadline, f"{spec.host} did not start"
                time.sleep(0.2)
        ctl = controller_keys(tmp)
        pipe = pipeline_for_plan(plan, keys_dir=ctl)
        ids = torch.tensor([[5, 17, 42, 99, 7, 300, 12, 8]])
        t = time.time()
        logits = pipe.forward(ids, seq="c1", pos=0).logits.float()
        report["drive_forward_s"] = round(time.time() - t, 3)
        ref = load_stage(ckpt, 0, read_index(ckpt).num_layers, True, True, "fp32")(ids, start_pos=0).float()
        diff = float((logits - ref).abs().max())
        report["max_abs_diff_vs_fp32_cpu"] = diff
        report["top1_agree"] = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        assert report["top1_agree"] >= 0.75, report

        # 3. the server over those workers, asked over HTTP
        plan_path = os.path.join(tmp, "plan.json")
        with open(plan_path, "w") as f:
            json.dump(plan.to_dict(), f)
        port = free_ports(1)[0]
        srv = subprocess.Popen([sys.executable, "-m", "layerline.server", "--plan", plan_path, "--keys", ctl,
                                "--checkpoint", ckpt, "--model-name", "demo", "--port", str(port)],
                               stdout=open(os.path.join(out, "server.log"), "w"), stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.time() + 120
            while True:
                try:
                    if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert srv.poll() is None and time.time() < deadline, "server did not come up"
                time.sleep(0.3)
            t = time.time()
            r = httpx.post(url + "/v1/completions", json={"model": "demo", "prompt": [5, 17, 42, 99],
                                                           "max_tokens": 16, "temperature": 0}, timeout=120)
            report["server_status"] = r.status_code
            report["server_seconds"] = round(time.time() - t, 2)
            report["server_body"] = r.json()
            report["health"] = httpx.get(url + "/health", timeout=10).json()
            assert r.status_code == 200, r.text
        finally:
            srv.terminate()
            srv.wait(20)
    finally:
        stop_local([p for p, _ in procs])
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cuda-check-out", sys.argv[2] if len(sys.argv) > 2 else "cuda:0"))
