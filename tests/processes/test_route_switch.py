"""A planned route switch, live: a server over three real stages moves to another set of
stages (POST /admin/route, what drain.yml and a rejoin call) while four clients stream greedy
tokens. Every request completes with 200 and exactly the undisturbed tokens; the old workers
can stop afterwards; a route whose stages do not answer is refused with the old one kept."""
from __future__ import annotations

import json
import os

import httpx
import pytest

from test_failover import Cluster, Server, check_same, ckpt, report, run_clients  # noqa: F401 - ckpt: fixture


@pytest.fixture(scope="module")
def two(ckpt, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """Route A (serving) and route B (started beside it on other ports), a server on A with admin keys."""
    tmp = tmp_path_factory.mktemp("switch")
    for d in ("a", "b"):
        (tmp / d).mkdir()
    a = Cluster(ckpt, tmp / "a")
    b = server = None
    try:
        b = Cluster(ckpt, tmp / "b")
        keys = tmp / "admin_keys"
        keys.write_text("admin-secret\n")
        os.chmod(keys, 0o600)
        server = Server(a, ckpt, tmp, "--admin-keys", str(keys))
        reference = run_clients(server.url)
        yield a, b, server, reference
    finally:
        if server is not None:
            server.stop()
        for c in (a, b):
            if c is not None:
                c.stop()


def post_route(url: str, plan: dict, key: str = "admin-secret") -> httpx.Response:
    return httpx.post(url + "/admin/route", json={"plan": plan}, timeout=60,
                      headers={"Authorization": f"Bearer {key}"} if key else {})


def test_switch_under_load_loses_nothing_and_refuses_a_dead_route(two):
    a, b, server, reference = two
    out = {}

    def switch():
        out["r"] = post_route(server.url, b.plan)
    got = run_clients(server.url, switch)
    r = out["r"]
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["epoch"] == 1 and body["stages"] == ["stage0", "stage1", "stage2"], body
    assert type(body["carried_over"]) is int and body["carried_over"] >= 0, body   # running sequences it moved
    check_same(reference, got)
    report("route switch under load", reference, got)
    assert "\nlayerline_route_epoch 1.0\n" in server.metrics()
    assert server.metric("layerline_route_switches_total", result="switched") == 1.0

    # the old route's workers go; the server keeps answering through the new one
    a.stop()
    again = run_clients(server.url)
    check_same(reference, again)
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert [s["endpoint"] for s in health["stages"]] == [s["endpoint"] for s in b.plan["stages"]], health

    # back to A, whose workers are gone: refused, nothing changes
    r = post_route(server.url, a.plan)
    assert r.status_code == 409, r.text
    assert "does not answer" in r.json()["error"]["message"] and "unchanged" in r.json()["error"]["message"]
    check_same(reference, run_clients(server.url))

    # the same route again: nothing to do
    r = post_route(server.url, b.plan)
    assert r.status_code == 200 and r.json().get("unchanged") is True, r.text


def test_admin_route_needs_the_admin_key(two):
    _, b, server, _ = two
    for key in (None, "wrong", ""):
        r = post_route(server.url, b.plan, key=key)
        assert r.status_code == 401, r.text
    r = httpx.post(server.url + "/admin/route", content=b"{nope", timeout=10,
                   headers={"Authorization": "Bearer admin-secret"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/admin/route", json={"plan": {"stages": "x"}}, timeout=10,
                   headers={"Authorization": "Bearer admin-secret"})
    assert r.status_code == 409 and "not a plan" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/admin/route", json={"plan": []}, timeout=10,
                   headers={"Authorization": "Bearer admin-secret"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "plan"
    assert json.loads(httpx.get(server.url + "/health", timeout=10).text)["status"] == "ok"


def test_the_plays_admin_client_switches_gates_and_waits(two, tmp_path):
    """layerline.server.admin, what the layerline_server_admin task asks (drain.yml's gate and switch,
    deploy.yml's wait), against this server: its one-line verdicts, the admin key read from its file and
    never returned."""
    from layerline.server.admin import ask
    a, b, server, reference = two
    endpoints = [s["endpoint"] for s in httpx.get(server.url + "/health", timeout=10).json()["stages"]]
    serving = next(c.plan for c in (a, b) if [s["endpoint"] for s in c.plan["stages"]] == endpoints)
    other = b.plan if serving is a.plan else a.plan
    key, wrong = tmp_path / "admin_key", tmp_path / "wrong_key"
    key.write_text("admin-secret\n")
    wrong.write_text("not-the-key\n")
    assert ask("wait", server.url, timeout=10) == {"changed": False, "status": 200,
                                                    "msg": f"the server at {server.url} is healthy"}
    gate = ask("gate", server.url)
    assert not gate.get("failed") and gate["msg"] == "the pipeline is healthy" and gate["down"] == []
    same = ask("route", server.url, admin_key_file=str(key), plan=serving)
    assert not same.get("failed") and same["msg"] == "route unchanged" and same["changed"] is False, same
    refused = ask("route", server.url, admin_key_file=str(wrong), plan=other)
    assert refused["failed"] and refused["status"] == 401, refused
    assert refused["msg"].startswith(f"the server at {server.url} refused the new route (401): ")
    assert "not-the-key" not in json.dumps(refused) and "admin-secret" not in json.dumps(same)
    missing = ask("route", server.url, admin_key_file=str(tmp_path / "none"), plan=other)
    assert missing["failed"] and "the server's admin key cannot be read" in missing["msg"]
    check_same(reference, run_clients(server.url))   # nothing of that moved the route
