"""What drain.yml decides, decided in layerline.operations (the playbook only calls it through the
layerline_drain_outcome / layerline_drain_stops filters and the layerline_drive module): what failed
and the one line the play fails with, which worker slots stop on each host, and a drive's verdict."""
from __future__ import annotations

import json

import pytest

from layerline.operations import HOST_ERROR, RESTORE_ERROR, SWITCH_ERROR, drain_outcome, drain_stops, drive_verdict


def _route(before: dict, after: dict, changed: bool, moves: bool) -> dict:
    return {**after, "changed": changed, "moves": moves, "before": before}


def test_nothing_noted_is_no_failure():
    assert drain_outcome({"w1": {}, "w2": {HOST_ERROR: None, SWITCH_ERROR: ""}}, "w2") == \
        {"errors": [], "failed": False, "msg": ""}


def test_every_error_once_in_play_order_in_one_line():
    noted = {"w1": {HOST_ERROR: "port 29150 is taken", SWITCH_ERROR: "Drive: the new route's logits differ"},
             "w3": {HOST_ERROR: "w3: could not write its stage to /s",
                    SWITCH_ERROR: "Drive: the new route's logits differ", RESTORE_ERROR: "server gone"},
             "w2": {}}
    out = drain_outcome(noted, ["w2", "w4"])
    assert out["failed"] and out["errors"] == [
        "w1: port 29150 is taken", "w3: could not write its stage to /s", "Drive: the new route's logits differ",
        "and the restore failed: server gone"]
    assert out["msg"].startswith("drain of w2,w4 failed (w1: port 29150 is taken; w3: could not write")
    assert "restored: the server routes through the old plan again, w2,w4 still serves" in out["msg"]
    assert "\n" not in out["msg"]


BEFORE = {"slot": 0, "drained": []}


@pytest.mark.parametrize("failed, want", [(False, {"w1": [0], "w2": [0], "w3": [0]}),
                                          (True, {"w1": [1], "w2": [1], "w3": [1]})])
def test_a_moving_drain_stops_the_slot_that_no_longer_serves(failed, want):
    route = _route(BEFORE, {"slot": 1, "drained": ["w2"]}, changed=True, moves=True)
    assert {h: drain_stops(route, h, failed) for h in want} == want


def test_a_promotion_in_place_stops_only_the_newly_drained_host():
    route = _route({"slot": 1, "drained": ["w5"]}, {"slot": 1, "drained": ["w5", "w3"], "promoted": {"w4": "w3"}},
                   changed=True, moves=False)
    assert {h: drain_stops(route, h, False) for h in ("w1", "w3", "w4", "w5")} == {"w1": [], "w3": [1], "w4": [],
                                                                                 "w5": []}
    assert drain_stops(route, "w3", True) == [], "gone back: the drained host still serves"


def test_nothing_to_switch_stops_what_a_finished_drain_leaves_stopped():
    """Drained already (or a run stopped after its commit, run again): the slot that does not serve, and a
    drained host's worker in either slot, stop (stopping a worker that is not running changes nothing)."""
    route = _route({"slot": 1, "drained": ["w2"]}, {"slot": 1, "drained": ["w2"]}, changed=False, moves=False)
    assert drain_stops(route, "w2", False) == [0, 1] and drain_stops(route, "w1", False) == [0]


def test_drive_verdicts():
    checked = {"ok": True, "max_abs_diff": 0.0, "tolerance": 1e-4, "precision": "fp32", "stages": []}
    assert drive_verdict(0, json.dumps(checked), "", "the new route") == \
        (True, "the new route matches the one-process forward", checked)
    assert drive_verdict(0, "warming up\n" + json.dumps({"stages": []}), "")[:2] == \
        (True, "the pipeline answers a drive")
    bad = {**checked, "ok": False, "max_abs_diff": 0.5}
    passed, msg, got = drive_verdict(1, json.dumps(bad), "", "the new route")
    assert not passed and got == bad
    assert msg == "the new route's logits differ from the one-process forward by 0.5, over the fp32 tolerance 0.0001"
    passed, msg, got = drive_verdict(2, "", "Traceback...\nlayerline: tcp://10.0.0.2:29150: no answer in 30 s\n")
    assert not passed and got is None
    assert msg == ("the drive through the pipeline failed (exit status 2): "
                   "layerline: tcp://10.0.0.2:29150: no answer in 30 s")
    assert drive_verdict(0, "not json", "")[0] is False, "exit 0 without a result is no pass"
