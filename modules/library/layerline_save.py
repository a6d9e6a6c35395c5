#!/usr/bin/python
# -*- coding: utf-8 -*-

from __future__ import annotations

DOCUMENTATION = r"""
---
module: layerline_save
short_description: Keep one of a layerline deployment's files in the controller's home (layerline_home)
description:
  - Writes plan.json, route.json, drive.json or request.json in O(home), atomically (a reader sees
    the old file or the new one whole) and only when its bytes change. Paths and formats are
    decided by C(layerline.home.ControllerHome); route.json keeps only the route state's own keys.
  - The server's key files, O(file=admin_key) and O(file=api_keys), take no O(content) - they are made
    once with a new random key (C(layerline.server.auth.ensure_key_file)), atomically, mode 0600 in a
    0700 dir; a file that holds a key is kept (its mode set to 0600). The key is never returned; run
    such a task with C(no_log) all the same.
  - Runs where layerline is importable, the controller (delegate_to localhost), or for the key files
    where the server runs.
version_added: "0.1.0"
author:
  - layerline contributors
options:
  home:
    description: The controller's layerline_home dir (made when missing).
    type: path
    required: true
  file:
    description: Which file to keep.
    type: str
    required: true
    choices: [plan, route, drive, request, admin_key, api_keys]
  content:
    description: What it holds (JSON data). Required for every file but the key files, which take none.
    type: raw
"""

EXAMPLES = r"""
- name: Keep the plan on the controller
  layerline_save:
    home: "{{ layerline_home }}"
    file: plan
    content: "{{ layerline_plan }}"
  run_once: true
  delegate_to: localhost

- name: Make the server's admin key when there is none
  layerline_save:
    home: "{{ layerline_home }}"
    file: admin_key
  no_log: true
"""

RETURN = r"""
path:
  description: The file written (or that would be, in check mode).
  returned: always
  type: str
  sample: /srv/layerline/plan.json
"""

import json
import os
import traceback

from ansible.module_utils.basic import AnsibleModule

LAYERLINE_IMPORT_ERROR = None
try:
    from layerline.errors import LayerlineError
    from layerline.home import ControllerHome
    from layerline.planner import Plan
    from layerline.server.auth import ensure_key_file
except ImportError:
    LAYERLINE_IMPORT_ERROR = traceback.format_exc()


KEY_FILES = ["admin_key", "api_keys"]


def main():
    module = AnsibleModule(
        argument_spec=dict(home=dict(type="path", required=True),
                           file=dict(type="str", required=True, choices=["plan", "route", "drive", "request"] + KEY_FILES),
                           content=dict(type="raw", required=False)),
        supports_check_mode=True)
    p = module.params
    if LAYERLINE_IMPORT_ERROR:
        module.fail_json(msg="layerline_save: cannot import layerline here; run it on the controller "
                             "(delegate_to: localhost) from the venv made by `make setup`",
                         exception=LAYERLINE_IMPORT_ERROR)
    home = ControllerHome.of(p["home"])
    key = p["file"] in KEY_FILES
    if key and p["content"] is not None:
        module.fail_json(msg="layerline_save %s: takes no content (a new random key is made when there is none)"
                             % p["file"])
    if not key and p["content"] is None:
        module.fail_json(msg="layerline_save %s: content is required" % p["file"])
    path = getattr(home, p["file"]) if key else home.file(p["file"])
    try:
        content = None if key else home.stored(p["file"], _content(module, p))
    except LayerlineError as e:
        module.fail_json(msg=str(e), path=path)
    before = None if key else _saved(path)
    # plan.json: what changes the deployment is the placement; its predictions follow measured step times
    view = _placement if p["file"] == "plan" else (lambda data: data)
    shown_before, shown_after = (None, None) if key else (_view(view, before), view(content))
    diff = {} if key or not module._diff else {"diff": {
        "before_header": path, "after_header": path,
        "before": "" if shown_before is None else _text(shown_before), "after": _text(shown_after)}}
    if module.check_mode:  # a key is made only where there is none; a file changes where its data would
        module.exit_json(changed=not os.path.exists(path) if key else shown_before != shown_after, path=path, **diff)
    try:
        changed = ensure_key_file(path) if key else home.save(p["file"], content)
    except LayerlineError as e:
        module.fail_json(msg=str(e), path=path)
    except OSError as e:
        module.fail_json(msg="%s: cannot be written (%s); fix the permissions of layerline_home" % (path, e.strerror),
                         path=path)
    if not key and p["file"] == "plan":
        changed = shown_before != shown_after
    module.exit_json(changed=changed, path=path, **diff)


def _placement(data):
    return Plan.from_dict(data).placement()


def _view(view, data):
    """The data as compared and shown, None where there is none or it is not a plan any more."""
    try:
        return None if data is None else view(data)
    except Exception:
        return None


def _saved(path):
    """The data a file holds now (None where there is none or it does not parse)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _text(data):
    """The data as --diff shows it: one key per line, sorted, so a plan's changed fields stand out."""
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def _content(module, p):
    content = p["content"]
    if isinstance(content, str):
        try:
            content = json.loads(content)
        except ValueError:
            module.fail_json(msg="layerline_save %s: content is not JSON data" % p["file"])
    return content


if __name__ == "__main__":
    main()
