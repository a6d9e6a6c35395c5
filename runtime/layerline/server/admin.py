"""A running server asked from outside, as the layerline_server_admin task asks it (its module where the
server runs, its action in ansible's own process on the controller): /health waited for after a start,
/health judged as a drain's gate (layerline.spec.health_gate), and POST /admin/route with the admin key.

Each returns the task's result: changed, msg (the one line the play shows), status and the server's
answer; failed where the server did not do what was asked. The admin key is read here from its file and
never returned. Plain urllib, without proxies (the server is this deployment's own), so the serving
host needs nothing beyond layerline's core.
"""
from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request

# the task's options, for the module's AnsibleModule and the action's validate_argument_spec
ARGUMENT_SPEC = dict(op=dict(type="str", required=True, choices=["wait", "gate", "route"]),
                     url=dict(type="str", required=True),
                     ca_path=dict(type="path", required=False),
                     admin_key_file=dict(type="path", required=False),
                     plan=dict(type="dict", required=False),
                     may_be_down=dict(type="list", elements="str", default=[]),
                     timeout=dict(type="int", default=30))
ROUTE_TIMEOUT_S = 180   # a switch checks every new stage's health first


def ask(op: str, url: str, ca_path: str | None = None, admin_key_file: str | None = None, plan: dict | None = None,
        may_be_down: list[str] = (), timeout: int = 30, check: bool = False) -> dict:
    """The task's result for OP; in check mode a route is not switched (wait and gate only read)."""
    if check and op == "route":
        return {"changed": False, "status": None, "msg": "check mode: the route was not switched"}
    if op == "wait":
        return wait_healthy(url, ca_path, timeout)
    if op == "gate":
        return gate(url, ca_path, list(may_be_down), timeout)
    if op == "route":
        if not admin_key_file or plan is None:
            return _failed("layerline_server_admin route: admin_key_file and plan are required")
        return switch_route(url, plan, admin_key_file, ca_path)
    return _failed(f"layerline_server_admin: op {op!r} is not one of wait, gate, route")


def wait_healthy(url: str, ca_path: str | None, timeout_s: float) -> dict:
    """/health answered 200 (every stage of the route answers) within timeout_s, asked once a second."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, body, why = _call(f"{url}/health", ca_path, timeout=10)
        if status == 200:
            return {"changed": False, "status": status, "msg": f"the server at {url} is healthy"}
        if time.monotonic() >= deadline:
            from ..spec import health_gate
            down = health_gate(url, status, body)["down"]   # which stages /health says do not answer
            last = f"it answered {status}" + (f"; stages down: {', '.join(down)}" if down else "") if status else why
            return _failed(f"the server at {url} did not answer /health with 200 in {timeout_s:.0f} s ({last}); "
                           "its log is server.log in its state dir", status=status)
        time.sleep(1.0)


def gate(url: str, ca_path: str | None, may_be_down: list[str], timeout_s: float = 30) -> dict:
    """A drain's gate: the server answers and no stage is down but those in may_be_down."""
    from ..spec import health_gate
    status, body, _ = _call(f"{url}/health", ca_path, timeout=timeout_s)
    verdict = health_gate(url, status, body, may_be_down)
    result = {"changed": False, "status": status, "down": verdict["down"], "msg": verdict["msg"]}
    return result if verdict["ok"] else {**result, "failed": True}


def switch_route(url: str, plan: dict, admin_key_file: str, ca_path: str | None) -> dict:
    """POST the plan's stages to /admin/route: the server checks every new stage's health first and keeps
    its route when one does not answer; else it switches at a step boundary."""
    try:
        with open(admin_key_file) as f:
            key = (f.readline() or "").strip()
    except OSError as e:
        return _failed(f"{admin_key_file}: the server's admin key cannot be read ({e.strerror}); run deploy.yml "
                       "(it makes the key)")
    if not key:
        return _failed(f"{admin_key_file}: holds no admin key; remove it and run deploy.yml (it makes one)")
    status, body, why = _call(f"{url}/admin/route", ca_path, timeout=ROUTE_TIMEOUT_S, body={"plan": plan}, key=key)
    body = body or {}
    if status != 200:
        said = (body.get("error") or {}).get("message") if isinstance(body.get("error"), dict) else None
        return _failed(f"the server at {url} refused the new route ({status or 'no answer'}): {said or why or 'no answer'}",
                       status=status)
    if body.get("unchanged"):
        msg = "route unchanged"
    else:
        # a server started by an older layerline names carried_over `replayed`
        carried = body.get("carried_over", body.get("replayed", "?"))
        msg = (f"route epoch {body.get('epoch')} through {', '.join(map(str, body.get('stages') or []))}; "
               f"{carried} running sequences carried over in {body.get('seconds')} s")
    return {"changed": not body.get("unchanged", False), "status": status, "route": body, "msg": msg}


def _failed(msg: str, **more) -> dict:
    return {"failed": True, "changed": False, "msg": msg, **more}


def _call(url: str, ca_path: str | None, timeout: float, body: dict | None = None,
          key: str | None = None) -> tuple[int | None, dict | None, str]:
    """(status, the JSON object answered or None, why nothing answered)."""
    handlers: list = [urllib.request.ProxyHandler({})]
    if url.startswith("https:"):
        handlers.append(urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=ca_path or None)))
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers,
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.build_opener(*handlers).open(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError, ValueError) as e:
        return None, None, str(getattr(e, "reason", None) or e)
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    return status, data if isinstance(data, dict) else None, ""
