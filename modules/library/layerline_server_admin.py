#!/usr/bin/python
# -*- coding: utf-8 -*-

from __future__ import annotations

DOCUMENTATION = r"""
---
module: layerline_server_admin
short_description: Ask a running layerline server for its health or switch its route
description:
  - O(op=wait) asks C(/health) once a second until it answers 200 (every stage of the route answers),
    for O(timeout) seconds; after a start.
  - O(op=gate) asks C(/health) once and passes when the server answers and no stage is down but those
    in O(may_be_down) (C(layerline.spec.health_gate)); a drain's gate.
  - O(op=route) POSTs O(plan) to C(/admin/route) with the admin key read from O(admin_key_file) (never
    returned or logged); the server checks every new stage's health first and keeps its route when one
    does not answer, else switches at a step boundary. C(msg) says the new epoch and stages, or
    C(route unchanged).
  - What is asked and what the answer means is decided in C(layerline.server.admin). On the controller
    (a local connection) the action plugin of the same name runs it in ansible's own process.
  - Failures are one line (C(msg)) naming the server's URL and what it answered.
version_added: "0.1.0"
author:
  - layerline contributors
options:
  op:
    description: What to ask.
    type: str
    required: true
    choices: [wait, gate, route]
  url:
    description: The server's base URL (C(layerline.spec.server_spec)'s C(url)).
    type: str
    required: true
  ca_path:
    description: The CA file that checks the server's certificate over HTTPS.
    type: path
  admin_key_file:
    description: The file holding the server's admin key (first line); O(op=route) only.
    type: path
  plan:
    description: The plan whose active stages the server routes through; O(op=route) only.
    type: dict
  may_be_down:
    description: Stages the gate lets be down (the hosts being drained); O(op=gate) only.
    type: list
    elements: str
    default: []
  timeout:
    description: Seconds to wait for health (O(op=wait)) or for one answer (O(op=gate)).
    type: int
    default: 30
"""

EXAMPLES = r"""
- name: Switch the server to the plan's stages
  layerline_server_admin:
    op: route
    url: "{{ layerline_server_spec.url }}"
    admin_key_file: "{{ layerline_server_spec.admin_key_file }}"
    plan: "{{ layerline_plan }}"
"""

RETURN = r"""
msg:
  description: What happened, in one line.
  returned: always
  type: str
  sample: route epoch 2 through w1, w3; 1 running sequences carried over in 0.21 s
status:
  description: The HTTP status the server answered (null when nothing answered).
  returned: always
  type: int
route:
  description: The server's answer to the switch (epoch, stages, carried_over, seconds, unchanged).
  returned: op=route, on success
  type: dict
down:
  description: The stages that do not answer.
  returned: op=gate
  type: list
"""

import traceback

from ansible.module_utils.basic import AnsibleModule

LAYERLINE_IMPORT_ERROR = None
try:
    from layerline.server.admin import ARGUMENT_SPEC, ask
except ImportError:
    LAYERLINE_IMPORT_ERROR = traceback.format_exc()
    ARGUMENT_SPEC = dict(op=dict(type="str", required=True), url=dict(type="str", required=True),
                         ca_path=dict(type="path"), admin_key_file=dict(type="path"), plan=dict(type="dict"),
                         may_be_down=dict(type="list", elements="str", default=[]), timeout=dict(type="int"))


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    if LAYERLINE_IMPORT_ERROR:
        module.fail_json(msg="layerline_server_admin: cannot import layerline here; run it where the server runs, "
                             "after the runtime role", exception=LAYERLINE_IMPORT_ERROR)
    result = ask(**p, check=module.check_mode)
    if result.pop("failed", False):
        module.fail_json(**result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
