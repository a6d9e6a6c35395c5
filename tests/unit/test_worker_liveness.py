"""A worker answers its control socket while its compute thread is busy: health never waits on a
long forward (issue 37, item 1).

The real Worker in this process (the small checkpoint, real CURVE sockets on loopback, keys made
here), its compute held inside one forward until the test lets go, so "long" does not depend on
how fast this machine is: health, stats and set_next are answered meanwhile, the held forward
then completes, and shutdown stops both threads.
"""
from __future__ import annotations

import threading

import torch

from layerline.pipeline import Pipeline, control


def test_health_is_answered_while_a_forward_computes(worker):
    w, kd = worker
    entered, release = threading.Event(), threading.Event()
    real = w.compute.forward

    def held(h, tensors):   # a forward that takes as long as the test says
        entered.set()
        assert release.wait(60)
        return real(h, tensors)
    w.compute.forward = held
    ctl = w.net.control_addr
    ask = dict(keys_dir=kd["controller"], peer="w", timeout_s=5.0)
    with Pipeline(w.args.bind, keys_dir=kd["controller"], first_key="w", timeout_s=60) as pipe:
        rid = pipe.submit(torch.tensor([[1, 2, 3]]))
        assert entered.wait(30), "the forward never reached the stage"
        try:
            for _ in range(3):   # each within its deadline while the forward is held
                h = control(ctl, "health", **ask)
                assert h["op"] == "ok" and h["name"] == "w"
            assert control(ctl, "stats", **ask)["requests"] == 1
        finally:
            release.set()
        got, res = pipe.collect()
        assert got == rid and res.logits.shape == (1, 3, 500)
    assert control(ctl, "shutdown", **ask)["op"] == "ok"
