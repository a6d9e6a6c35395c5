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

import traceback

from ansible.module_utils.basic import AnsibleModule

LAYERLINE_IMPORT_ERROR = None
try:
    from layerline.homesave import ARGUMENT_SPEC, keep
except ImportError:
    LAYERLINE_IMPORT_ERROR = traceback.format_exc()
    ARGUMENT_SPEC = dict(home=dict(type="path", required=True), file=dict(type="str", required=True),
                         content=dict(type="raw", required=False))


def main():
    # on the controller the action plugin of the same name runs layerline.homesave.keep in its own process;
    # this runs where it cannot (another connection, become)
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    if LAYERLINE_IMPORT_ERROR:
        module.fail_json(msg="layerline_save: cannot import layerline here; run it on the controller "
                             "(delegate_to: localhost) from the venv made by `make setup`",
                         exception=LAYERLINE_IMPORT_ERROR)
    result = keep(p["home"], p["file"], p["content"], check=module.check_mode, diff=module._diff)
    if result.pop("failed", False):
        module.fail_json(**result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
