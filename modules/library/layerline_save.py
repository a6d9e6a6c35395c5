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
  - Runs where layerline is importable, the controller (delegate_to localhost).
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
    choices: [plan, route, drive, request]
  content:
    description: What it holds (JSON data).
    type: raw
    required: true
"""

EXAMPLES = r"""
- name: Keep the plan on the controller
  layerline_save:
    home: "{{ layerline_home }}"
    file: plan
    content: "{{ layerline_plan }}"
  run_once: true
  delegate_to: localhost
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
except ImportError:
    LAYERLINE_IMPORT_ERROR = traceback.format_exc()


def main():
    module = AnsibleModule(
        argument_spec=dict(home=dict(type="path", required=True),
                           file=dict(type="str", required=True, choices=["plan", "route", "drive", "request"]),
                           content=dict(type="raw", required=True)),
        supports_check_mode=True)
    p = module.params
    if LAYERLINE_IMPORT_ERROR:
        module.fail_json(msg="layerline_save: cannot import layerline here; run it on the controller "
                             "(delegate_to: localhost) from the venv made by `make setup`",
                         exception=LAYERLINE_IMPORT_ERROR)
    content = p["content"]
    if isinstance(content, str):
        try:
            content = json.loads(content)
        except ValueError:
            module.fail_json(msg="layerline_save %s: content is not JSON data" % p["file"])
    home = ControllerHome.of(p["home"])
    path = home.file(p["file"])
    if module.check_mode:
        module.exit_json(changed=not os.path.exists(path), path=path)
    try:
        changed = home.save(p["file"], content)
    except LayerlineError as e:
        module.fail_json(msg=str(e), path=path)
    except OSError as e:
        module.fail_json(msg="%s: cannot be written (%s); fix the permissions of layerline_home" % (path, e.strerror),
                         path=path)
    module.exit_json(changed=changed, path=path)


if __name__ == "__main__":
    main()
