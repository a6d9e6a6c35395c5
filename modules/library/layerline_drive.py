#!/usr/bin/python
# -*- coding: utf-8 -*-

from __future__ import annotations

DOCUMENTATION = r"""
---
module: layerline_drive
short_description: Drive a prompt through a running layerline pipeline and say whether it passed
description:
  - Runs C(layerline drive ... --json) (its argv from the C(layerline_drive_argv) filter) on the
    controller and decides its verdict in C(layerline.operations.drive_verdict) - it passes when the
    drive exits 0 with a result, and the result, where it was checked against the one-process
    forward, matches. Otherwise it fails with one line - by how much the logits differ and the
    precision's tolerance, or the drive's own last error line.
  - Changes nothing (a drive only reads); in check mode it does not run.
  - Runs where layerline is importable, the controller (delegate_to localhost).
version_added: "0.1.0"
author:
  - layerline contributors
options:
  argv:
    description: The drive's command line.
    type: list
    elements: str
    required: true
  what:
    description: What the drive goes through, as the messages name it.
    type: str
    default: the pipeline
"""

EXAMPLES = r"""
- name: Drive through the new route
  layerline_drive:
    argv: "{{ layerline_plan | layerline_drive_argv(hostvars[inventory_hostname], ansible_playbook_python) }}"
    what: the new route
  delegate_to: localhost
  run_once: true
"""

RETURN = r"""
drive:
  description: The drive's JSON result (per-stage times, and with a reference check ok, max_abs_diff, tolerance).
  returned: when the drive printed one
  type: dict
msg:
  description: The verdict in words.
  returned: always
  type: str
  sample: the new route matches the one-process forward
"""

import traceback

from ansible.module_utils.basic import AnsibleModule

LAYERLINE_IMPORT_ERROR = None
try:
    from layerline.operations import DRIVE_ARGUMENT_SPEC as ARGUMENT_SPEC, run_drive
except ImportError:
    LAYERLINE_IMPORT_ERROR = traceback.format_exc()
    ARGUMENT_SPEC = dict(argv=dict(type="list", elements="str", required=True), what=dict(type="str"))


def main():
    # on the controller the action plugin of the same name runs the drive from ansible's own process;
    # this runs where it cannot (another connection, become, a task environment)
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    if LAYERLINE_IMPORT_ERROR:
        module.fail_json(msg="layerline_drive: cannot import layerline here; run it on the controller "
                             "(delegate_to: localhost) from the venv made by `make setup`",
                         exception=LAYERLINE_IMPORT_ERROR)
    result = run_drive(p["argv"], p["what"], check=module.check_mode)
    if result.pop("failed", False):
        module.fail_json(**result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
