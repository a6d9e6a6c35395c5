"""What a drain (drain.yml) decides as it goes, in one place: whether a drive through the new route
passed (drive_verdict, for the layerline_drive module), what failed across the hosts and the play
(drain_outcome, the layerline_drain_outcome filter) and which of a host's worker slots stop
afterwards (drain_stops, the layerline_drain_stops filter). The playbook only calls these.
Pure functions over JSON data: no Ansible, no torch.
"""
from __future__ import annotations

import json
import subprocess

from .routes import DrainState

# the facts drain.yml notes in its rescues: each host's (its worker did not start), the switch's and
# the restore's (run_once: every host holds the same)
HOST_ERROR, SWITCH_ERROR, RESTORE_ERROR = "layerline_drain_error", "layerline_drain_switch_error", \
    "layerline_drain_restore_error"


def drive_verdict(rc: int, stdout: str, stderr: str, what: str = "the pipeline") -> tuple[bool, str, dict | None]:
    """(passed, one line, the drive's JSON result or None) of a `layerline drive --json` run: it passes
    when it exited 0 with a result that is not a mismatch against the one-process forward."""
    result = None
    for line in reversed((stdout or "").splitlines()):
        try:
            v = json.loads(line)
        except ValueError:
            continue
        if isinstance(v, dict):
            result = v
            break
    if result is not None and result.get("ok") is False:
        return False, (f"{what}'s logits differ from the one-process forward by {result.get('max_abs_diff')}, "
                       f"over the {result.get('precision')} tolerance {result.get('tolerance')}"), result
    if rc == 0 and result is not None:
        return True, f"{what} {'matches the one-process forward' if 'ok' in result else 'answers a drive'}", result
    said = next((ln.strip() for ln in reversed((stderr or "").splitlines()) if ln.strip()), "") or \
        (stdout or "").strip()[-300:] or "no output"
    return False, f"the drive through {what} failed (exit status {rc}): {said}", result


# the layerline_drive task's options, for its module's AnsibleModule and its action's validate_argument_spec
DRIVE_ARGUMENT_SPEC = dict(argv=dict(type="list", elements="str", required=True),
                           what=dict(type="str", default="the pipeline"))


def run_drive(argv: list[str], what: str = "the pipeline", check: bool = False) -> dict:
    """The layerline_drive task's result (its module's and, on the controller, its action's): the drive
    run with ARGV, its verdict (drive_verdict); failed set where it did not pass."""
    if check:
        return {"changed": False, "msg": f"check mode: {what} not driven"}
    try:
        r = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except OSError as e:
        rc, out, err = 127, "", f"{argv[0] if argv else 'argv'}: {e.strerror or e}"
    passed, msg, result = drive_verdict(rc, out, err, what)
    return {"changed": False, "rc": rc, "msg": msg, **({} if result is None else {"drive": result}),
            **({} if passed else {"failed": True})}


def drain_outcome(noted: dict[str, dict], drain=None) -> dict:
    """What failed in a drain so far, from the facts its hosts noted (host -> {fact: message}):
    {"errors": [...] (the hosts' in play order, then the switch's, then the restore's),
    "failed": bool, "msg": the play's one line when it failed, else ""}."""
    errors = [m if m.startswith(f"{h}: ") else f"{h}: {m}"   # a stage error names its host already
              for h, m in ((h, str(facts.get(HOST_ERROR) or "")) for h, facts in noted.items()) if m]
    for fact in (SWITCH_ERROR, RESTORE_ERROR):   # run_once facts: every host holds the same, report it once
        msg = next((facts[fact] for facts in noted.values() if facts.get(fact)), None)
        if msg:
            errors.append(f"and the restore failed: {msg}" if fact == RESTORE_ERROR else str(msg))
    names = drain if isinstance(drain, str) else ",".join(drain or [])
    msg = (f"drain of {names} failed ({'; '.join(errors)}); restored: the server routes through the old plan "
           f"again, {names} still serves, the new route's workers are stopped") if errors else ""
    return {"errors": errors, "failed": bool(errors), "msg": msg}


def newly_drained(route: dict) -> list[str]:
    """The hosts this drain takes out: drained now, not before (layerline_route's `before`)."""
    before = DrainState.from_dict(route.get("before")).drained
    return [h for h in DrainState.from_dict(route).drained if h not in before]


def drain_stops(route: dict, host: str, failed: bool) -> list[int]:
    """The slots whose worker on `host` stops once the drain has switched (or gone back):
    - workers moved to the other slot: the slot that no longer serves (the old one, or after a
      failure the new one);
    - a standby promoted in place: the worker of the host it replaced, in the serving slot;
    - nothing to switch (drained already, or a run stopped after its commit run again): what a finished
      drain leaves stopped, the slot that does not serve and a drained host's worker in either."""
    before, after = DrainState.from_dict(route.get("before")), DrainState.from_dict(route)
    if not route.get("changed"):
        return [1 - after.slot] + ([after.slot] if host in after.drained else [])
    if route.get("moves"):
        return [after.slot if failed else before.slot]
    return [after.slot] if not failed and host in newly_drained(route) else []
