"""What the layerline_save task does, decided once: its module runs it where layerline is installed and
its action plugin runs it in the controller's own process (a module run costs a fresh interpreter and
Ansible's module_utils, about 0.3 s of CPU, on the critical path of every deploy and drain).

`keep()` returns the task's result (changed, path, diff where asked; failed and msg on a bad argument
or a write that fails), never raises for the user's input.
"""
from __future__ import annotations

import json
import os

from .errors import LayerlineError
from .home import FILES, ControllerHome

KEY_FILES = ("admin_key", "api_keys")
# the task's options, for AnsibleModule and for the action's validate_argument_spec alike
ARGUMENT_SPEC = dict(home=dict(type="path", required=True),
                     file=dict(type="str", required=True, choices=[*FILES, *KEY_FILES]),
                     content=dict(type="raw", required=False))


def keep(home: str, what: str, content, check: bool = False, diff: bool = False) -> dict:
    """Keep one of the home's files (layerline_save's documentation says how); the task's result."""
    ch = ControllerHome.of(home)
    key = what in KEY_FILES
    if key and content is not None:
        return _failed(f"layerline_save {what}: takes no content (a new random key is made when there is none)")
    if not key and content is None:
        return _failed(f"layerline_save {what}: content is required")
    path = getattr(ch, what) if key else ch.file(what)
    if isinstance(content, str):
        try:
            content = json.loads(content)
        except ValueError:
            return _failed(f"layerline_save {what}: content is not JSON data", path)
    try:
        content = None if key else ch.stored(what, content)
    except LayerlineError as e:
        return _failed(str(e), path)
    before = None if key else _saved(path)
    # plan.json: what changes the deployment is the placement; its predictions follow measured step times
    view = _placement if what == "plan" else (lambda data: data)
    shown_before, shown_after = (None, None) if key else (_view(view, before), view(content))
    shown = {} if key or not diff else {"diff": {
        "before_header": path, "after_header": path,
        "before": "" if shown_before is None else _text(shown_before), "after": _text(shown_after)}}
    if check:   # a key is made only where there is none; a file changes where its data would
        return {"changed": not os.path.exists(path) if key else shown_before != shown_after, "path": path, **shown}
    try:
        if key:
            from .server.auth import ensure_key_file
            changed = ensure_key_file(path)
        else:
            changed = ch.save(what, content)
    except LayerlineError as e:
        return _failed(str(e), path)
    except OSError as e:
        return _failed(f"{path}: cannot be written ({e.strerror}); fix the permissions of layerline_home", path)
    if what == "plan":
        changed = shown_before != shown_after
    return {"changed": changed, "path": path, **shown}


def _failed(msg: str, path: str | None = None) -> dict:
    return {"failed": True, "msg": msg, **({"path": path} if path else {})}


def _placement(data):
    from .planner import Plan
    return Plan.from_dict(data).placement()


def _view(view, data):
    """The data as compared and shown, None where there is none or it is not a plan any more."""
    try:
        return None if data is None else view(data)
    except Exception:
        return None


def _saved(path: str):
    """The data a file holds now (None where there is none or it does not parse)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _text(data) -> str:
    """The data as --diff shows it: one key per line, sorted, so a plan's changed fields stand out."""
    return json.dumps(data, indent=1, sort_keys=True) + "\n"
