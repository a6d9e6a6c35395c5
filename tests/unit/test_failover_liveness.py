"""When the server's health monitor takes a stage for down (issue 37, item 1): after `misses`
missed health checks in a row, or at once when its port refuses connections (the process is
gone); never after one slow answer.

The monitor's probe loop runs here over a scripted health callable (what a worker answers, in
order), and pipeline.control over a real CURVE socket to a port nothing listens on.
"""
from __future__ import annotations

import pytest

from layerline import keys
from layerline.errors import LayerlineError
from layerline.local import free_ports
from layerline.pipeline import REFUSED, DriveError, control
from layerline.server.failover import DOWN, Failover, is_down
from layerline.server.route import StageState

OK = {"op": "ok", "pid": 7, "uptime_s": 1.0}
SLOW = DriveError("control tcp://127.0.0.1:9101: no answer to health within 2 s")
GONE = DriveError("control tcp://127.0.0.1:9101: nothing listens there (connection refused)", REFUSED)


def probe(script: list, misses: int = 2) -> tuple[StageState, list]:
    """Run one stage's probe loop over `script` (answers or errors, in order); the events it raised."""
    s = StageState("w1", "tcp://127.0.0.1:9100", "tcp://127.0.0.1:9101")
    answers = list(script)

    def health(stage, timeout_s):
        a = answers.pop(0)
        if not answers:   # the loop ends after this one
            fo.stop_ev.set()
        if isinstance(a, Exception):
            raise a
        return a
    fo = Failover([s], health=health, set_next=None, engine=None, open_pipe=None, interval=0.0, misses=misses)
    fo._probe_loop(s)
    events = []
    while not fo.events.empty():
        events.append(fo.events.get()[0])
    return s, events


def test_one_slow_answer_is_not_down():
    s, events = probe([OK, SLOW, OK, SLOW, OK])
    assert events == [] and s.up is True


def test_misses_in_a_row_are_down():
    s, events = probe([OK, SLOW, SLOW, SLOW])
    assert events == [DOWN] and s.up is False
    s, events = probe([OK, SLOW, SLOW, SLOW], misses=3)
    assert events == [DOWN]
    s, events = probe([OK, SLOW, SLOW, OK], misses=3)
    assert events == [] and s.up is True


def test_a_refused_connection_is_down_at_once():
    s, events = probe([OK, GONE])
    assert events == [DOWN] and s.up is False


def test_is_down():
    assert not is_down(1, 2, SLOW) and is_down(2, 2, SLOW) and is_down(1, 2, GONE)
    assert not is_down(1, 2, LayerlineError("other"))
    with pytest.raises(LayerlineError, match=r"--health-misses 0: must be at least 1"):
        Failover([], health=None, set_next=None, engine=None, open_pipe=None, misses=0)


def test_control_to_a_port_nothing_listens_on_says_refused(tmp_path):
    kd = keys.local_keys(str(tmp_path / "keys"), ["w"])
    (port,) = free_ports(1)
    with pytest.raises(DriveError, match=r"nothing listens there \(connection refused\)") as e:
        control(f"tcp://127.0.0.1:{port}", "health", timeout_s=30, keys_dir=kd["controller"], peer="w")
    assert e.value.code == REFUSED


def test_a_process_gone_mid_handshake_is_refused_not_a_key_refusal(tmp_path):
    """A port that takes the connection and then goes away (a worker SIGKILLed while the health check
    connects): the handshake fails, but the port refuses now, so it is the process that is gone, not
    a key the worker does not let in."""
    import socket
    import threading

    kd = keys.local_keys(str(tmp_path / "keys"), ["w"])
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def die_on_first_connection():
        conn, _ = listener.accept()
        listener.close()          # the port refuses from now on
        conn.close()              # and the handshake in progress fails
    t = threading.Thread(target=die_on_first_connection, daemon=True)
    t.start()
    with pytest.raises(DriveError, match=r"process is gone") as e:
        control(f"tcp://127.0.0.1:{port}", "health", timeout_s=30, keys_dir=kd["controller"], peer="w")
    t.join(5)
    assert e.value.code == REFUSED
    assert "refused the CURVE handshake" not in str(e.value)
