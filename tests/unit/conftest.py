"""Fixtures of the unit tier."""
from __future__ import annotations

import threading

import pytest

from layerline import keys
from layerline.local import free_ports


@pytest.fixture
def worker(small_ckpt, tmp_path, monkeypatch):
    """A real Worker in this process holding the whole small checkpoint (first and last stage), on
    real CURVE sockets on loopback with keys made here, serving on a thread: (worker, keys dirs)."""
    from layerline.worker.cli import parse_args
    from layerline.worker.serve import Worker
    monkeypatch.setenv("LAYERLINE_STEP_TIMING", "off")
    kd = keys.local_keys(str(tmp_path / "keys"), ["w"])
    (port,) = free_ports(1)
    args = parse_args(["--checkpoint", str(small_ckpt), "--layers", "0:4", "--first", "--last", "--threads", "1",
                       "--bind", f"tcp://127.0.0.1:{port}", "--keys", kd["w"], "--name", "w", "--awake-ms", "0",
                       "--kv-context", "64"])
    w = Worker(args)
    t = threading.Thread(target=w.serve, daemon=True)
    t.start()
    yield w, kd
    w.running = False
    t.join(10)
    assert not t.is_alive()
