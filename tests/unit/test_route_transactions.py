"""Drain and rejoin as transactions (layerline.routes: decide, begin, plan_to_keep, commit; operations.drain_stops).

A model of what drain.yml and deploy.yml do, step by step, over a real controller home (plan.json, route.json
written by ControllerHome.save, as the layerline_save module writes them): the plan play keeps the change as
pending, the new slot's workers start, the server switches, the new plan and route are kept (the commit), the
slot that no longer serves stops. A run is stopped after every step (what SIGINT or SIGKILL of the controller
leaves: the files and processes as they were then) and run again with the same request: it must end where an
uninterrupted run ends, and never say "nothing to do" while the server routes through the old stages."""
from __future__ import annotations

import pytest

from layerline.errors import LayerlineError
from layerline.home import ControllerHome
from layerline.operations import drain_stops
from layerline.routes import (DrainState, begin, commit, decide, load_pending, load_route, next_route, plan_to_keep,
                              promote_in_place)

HOSTS = ["w1", "w2", "w3", "w4"]


def plan_of(hosts: list[str], slot: int, standby: str | None = None) -> dict:
    """A plan over hosts in slot (each endpoint names its host and slot); a standby of the last host."""
    n = len(hosts)
    stages = [{"host": h, "role": "active", "layers": [i, i + 1], "endpoint": f"tcp://{h}:{9000 + 10 * slot}",
               "standby_for": None} for i, h in enumerate(hosts)]
    if standby:
        stages.append({"host": standby, "role": "standby", "layers": [n - 1, n],
                       "endpoint": f"tcp://{standby}:{9000 + 10 * slot}", "standby_for": hosts[-1]})
    return {"precision": "fp32", "num_layers": n, "stages": stages}


class World:
    """The controller's home, the server's route and the workers that run: what a run changes."""

    def __init__(self, home, hosts: list[str], standby: str | None = None):
        self.home = ControllerHome.of(home)
        self.hosts = hosts
        actives = [h for h in hosts if h != standby]
        first = plan_of(actives, 0, standby)
        self.home.save("plan", first)
        self.home.save("route", DrainState().to_dict())
        self.serving = first                                      # the plan the server routes through
        self.workers = {(s["host"], 0) for s in first["stages"]}  # (host, slot) of every running worker

    def steps(self, drain=None, rejoin=None):
        """One run of drain.yml (or deploy.yml with a rejoin), as the steps it takes; each yields its name."""
        running = self.home.load_plan(False) or None
        route = decide(load_route(self.home), load_pending(self.home), self.hosts, drain, rejoin, running)
        plan_before = route["plan_before"]
        new = route["plan"] or plan_of([h for h in route["order"] if h not in route["drained"]], route["slot"])
        self.home.save("plan", plan_to_keep(route, new, plan_before))
        self.home.save("route", begin(route, new, plan_before))
        yield "plan"
        if route["moves"]:
            self.workers |= {(s["host"], route["slot"]) for s in new["stages"]}
            yield "started"
        if route["changed"]:
            self.serving = new
            yield "switched"
            self.home.save("plan", new)
            yield "plan kept"
            self.home.save("route", commit(route))
            yield "committed"
        for h in self.hosts:
            for slot in drain_stops(route, h, False):
                self.workers.discard((h, slot))
        yield "stopped"
        self.said = "nothing to do" if not route["changed"] else "switched"

    def run(self, stop_after: str | None = None, **kw) -> bool:
        """True when the run was stopped after stop_after (False: it has no such step and ran to its end)."""
        for step in self.steps(**kw):
            if step == stop_after:
                return True
        return False

    def state(self) -> tuple:
        return (load_route(self.home), load_pending(self.home), self.home.load_plan(), self.serving,
                sorted(self.workers))


def _uninterrupted(tmp_path, standby, kw) -> tuple:
    w = World(tmp_path / "clean", HOSTS, standby)
    w.run(**kw)
    return w.state()


CASES = [({"drain": "w2"}, None), ({"drain": "w4"}, "w3")]   # a re-plan into the other slot; a standby promoted


@pytest.mark.parametrize("kw, standby", CASES)
@pytest.mark.parametrize("stop_after", ["plan", "started", "switched", "plan kept", "committed"])
def test_a_drain_stopped_anywhere_and_run_again_ends_as_one_that_was_not(tmp_path, kw, standby, stop_after):
    want = _uninterrupted(tmp_path, standby, kw)
    w = World(tmp_path / "home", HOSTS, standby)
    stopped = w.run(stop_after=stop_after, **kw)
    if stopped and stop_after != "committed":
        # the change is pending, not kept as done, whichever route the server is on
        assert load_pending(w.home) is not None and kw["drain"] not in load_route(w.home).drained
    w.run(**kw)
    assert w.state() == want
    assert w.said == ("switched" if stopped and stop_after != "committed" else "nothing to do")
    route, pending, plan, serving, workers = w.state()
    assert pending is None and plan == serving and kw["drain"] in route.drained
    assert all(h != kw["drain"] for h, _ in workers), "the drained host runs no worker"


def test_nothing_to_do_only_once_the_server_routes_through_the_new_stages(tmp_path):
    """The bug this fixes: route.json said "drained" before the switch, so a re-run said so too while the
    server still routed through the old slot."""
    w = World(tmp_path, HOSTS)
    old = w.serving
    w.run(stop_after="started", drain="w2")
    assert w.serving == old and load_route(w.home) == DrainState(), "nothing kept as done before the switch"
    route = decide(load_route(w.home), load_pending(w.home), HOSTS, "w2", None, w.home.load_plan())
    assert route["changed"] and route["resumed"] and route["plan"] == load_pending(w.home).plan
    assert w.home.load_plan() == old, "plan.json names the stages that answer until the switch"


def test_a_rejoin_stopped_anywhere_and_run_again(tmp_path):
    for stop_after in ("plan", "started", "switched", "plan kept", "committed"):
        w = World(tmp_path / stop_after, HOSTS)
        w.run(drain="w2")
        drained = w.state()
        w.run(stop_after=stop_after, rejoin="w2")
        if stop_after == "committed":   # the rejoin is kept: run again it says so; a plain deploy finishes
            with pytest.raises(LayerlineError, match="w2 is not drained .* deploy.yml without -e finishes"):
                w.run(rejoin="w2")
            w.run()
        else:
            w.run(rejoin="w2")
        route, pending, plan, serving, workers = w.state()
        assert route.drained == () and pending is None and plan == serving, stop_after
        assert route.slot != drained[0].slot and {h for h, _ in workers} == set(HOSTS[:3] + ["w4"])
        assert all(slot == route.slot for _, slot in workers)


def test_another_change_while_one_is_pending_is_refused_in_one_line(tmp_path):
    w = World(tmp_path, HOSTS)
    w.run(stop_after="switched", drain="w2")
    with pytest.raises(LayerlineError, match=r"leaves w2 drained is under way .* asks for w3 drained\. Run that "
                                             r"drain or rejoin again"):
        decide(load_route(w.home), load_pending(w.home), HOSTS, "w3", None, w.home.load_plan())
    with pytest.raises(LayerlineError, match="asks for no host drained"):   # a plain deploy.yml meanwhile
        decide(load_route(w.home), load_pending(w.home), HOSTS, None, None, w.home.load_plan())


def test_a_failed_switch_that_went_back_leaves_nothing_pending(tmp_path):
    """drain.yml's restore writes the state before (route.json without `pending`) and the old plan."""
    w = World(tmp_path, HOSTS)
    before_plan = w.home.load_plan()
    w.run(stop_after="started", drain="w2")
    route = decide(load_route(w.home), load_pending(w.home), HOSTS, "w2", None, w.home.load_plan())
    w.home.save("route", route["before"])
    w.home.save("plan", route["plan_before"])
    assert load_pending(w.home) is None and load_route(w.home) == DrainState()
    assert w.home.load_plan() == before_plan


def test_route_file_pending_is_checked(tmp_path):
    home = ControllerHome.of(tmp_path)
    (tmp_path / "route.json").write_text('{"slot": 0, "drained": [], "pending": {"plan": 3}}')
    with pytest.raises(LayerlineError, match="pending .* must be {state, plan, plan_before}; re-run the drain"):
        load_pending(home)
    after, _ = next_route(DrainState(), HOSTS, drain="w2")
    assert promote_in_place(None, DrainState(), after) is None
