"""layerline.routes: the route state a drain or rejoin leaves, and standbys promoted in place."""
from __future__ import annotations

import pytest

from layerline.errors import LayerlineError
from layerline.routes import ROUTE_FILE, DrainState, host_order, load_route, next_route, promote_in_place

HOSTS = ["w1", "w2", "w3", "w4"]


def plan(*stages) -> dict:
    return {"precision": "fp32", "num_layers": 6, "stages": [
        {"host": h, "role": role, "layers": layers, "endpoint": f"tcp://127.0.0.1:{9000 + 10 * i}",
         "standby_for": sb} for i, (h, role, layers, sb) in enumerate(stages)]}


RUNNING = plan(("w1", "active", [0, 2], None), ("w2", "active", [2, 4], None), ("w3", "active", [4, 6], None),
               ("w4", "standby", [4, 6], "w3"))


def test_drain_flips_the_slot_and_rejoin_flips_it_back():
    s, changed = next_route(DrainState(), HOSTS, drain="w2")
    assert changed and s == DrainState(slot=1, drained=("w2",))
    s2, changed = next_route(s, HOSTS, rejoin=["w2"])
    assert changed and s2 == DrainState(slot=0, drained=())
    same, changed = next_route(s, HOSTS)
    assert not changed and same == s


@pytest.mark.parametrize("kw, says", [
    ({"drain": "w9"}, "layerline_drain: w9 is not a host of group layerline"),
    ({"drain": "w1,w2,w3,w4"}, "would leave no host to serve"),
    ({"rejoin": "w1"}, "layerline_rejoin: w1 is not drained"),
    ({"drain": "w1", "rejoin": "w1"}, "both name w1"),
    ({"drain": 3}, "must be a host name or a list of host names"),
])
def test_bad_names_are_one_line(kw, says):
    with pytest.raises(LayerlineError, match=says):
        next_route(DrainState(), HOSTS, **kw)


def test_route_file_is_checked():
    with pytest.raises(LayerlineError, match="slot 2 must be 0 or 1"):
        DrainState.from_dict({"slot": 2})
    with pytest.raises(LayerlineError, match="promoted .* must map a standby to the host it replaced"):
        DrainState.from_dict({"promoted": ["w4"]})
    s = DrainState.from_dict({"slot": 1, "drained": ["w3"], "promoted": {"w4": "w3"}})
    assert DrainState.from_dict(s.to_dict()) == s and s.to_dict()["promoted"] == {"w4": "w3"}


def test_the_kept_route_is_read_in_one_place(tmp_path):
    """load_route: no file or an empty one is slot 0 with nothing drained; a file cut short (a full
    disk, an editor) names itself and the fix, it does not read as an empty route."""
    assert load_route(tmp_path) == DrainState()
    f = tmp_path / ROUTE_FILE
    f.write_text("")
    assert load_route(tmp_path) == DrainState()
    f.write_text('{"slot": 1, "drained": ["w3"]}')
    assert load_route(tmp_path) == DrainState(slot=1, drained=("w3",))
    f.write_text('{"slot": 1, "drained": [')
    with pytest.raises(LayerlineError, match=rf"{f}: not valid JSON \(.*\); remove it to start from slot 0"):
        load_route(tmp_path)
    f.write_text('{"slot": 5}')
    with pytest.raises(LayerlineError, match="slot 5 must be 0 or 1"):
        load_route(tmp_path)


def test_a_drained_host_with_a_standby_is_replaced_in_place():
    before = DrainState()
    after, changed = next_route(before, HOSTS, drain="w3")
    new, state = promote_in_place(RUNNING, before, after)
    # the slot stays (nothing starts), the standby takes w3's place with w3's layers and its own endpoint
    assert state == DrainState(slot=0, drained=("w3",), promoted=(("w4", "w3"),))
    assert [(s["host"], s["role"], s["layers"], s["standby_for"]) for s in new["stages"]] == [
        ("w1", "active", [0, 2], None), ("w2", "active", [2, 4], None), ("w4", "active", [4, 6], None)]
    assert new["stages"][2]["endpoint"] == RUNNING["stages"][3]["endpoint"]
    assert RUNNING["stages"][3]["role"] == "standby", "the running plan is left alone"
    # a later deploy plans w4 where w3 stood, until w3 rejoins; then w4 is a standby again
    assert host_order(HOSTS, state) == ["w1", "w2", "w4", "w3"]
    back, changed = next_route(state, HOSTS, rejoin="w3")
    assert changed and back == DrainState(slot=1, drained=()) and host_order(HOSTS, back) == HOSTS


def test_a_drained_standby_just_leaves_and_no_standby_means_a_re_plan():
    before = DrainState()
    after, _ = next_route(before, HOSTS, drain="w4")
    new, state = promote_in_place(RUNNING, before, after)
    assert [s["host"] for s in new["stages"]] == ["w1", "w2", "w3"] and state.slot == 0
    after, _ = next_route(before, HOSTS, drain="w2")
    assert promote_in_place(RUNNING, before, after) is None, "w2 has no standby: re-plan"
    after, _ = next_route(before, HOSTS, drain="w3,w4")
    assert promote_in_place(RUNNING, before, after) is None, "w3's standby is drained too"


def test_a_promotion_ends_when_its_standby_is_drained():
    state = DrainState(slot=0, drained=("w3",), promoted=(("w4", "w3"),))
    after, changed = next_route(state, HOSTS, drain="w4")
    assert changed and after == DrainState(slot=1, drained=("w3", "w4"))
