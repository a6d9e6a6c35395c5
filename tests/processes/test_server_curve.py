"""The server speaks CURVE to every stage (data path and health op), loopback included, so it
cannot start without the controller's keys. (Serving over CURVE is what every server test does:
tests/processes/test_server.py and test_failover.py run on loopback, where CURVE runs too.)"""
from __future__ import annotations

import subprocess
import sys


def test_server_without_keys_is_one_line():
    for curve in ("auto", "on"):   # loopback, whatever --curve says
        r = subprocess.run([sys.executable, "-m", "layerline.server", "--first", "tcp://127.0.0.1:9", "--curve", curve],
                           capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--keys" in r.stderr, r.stderr
