# -*- coding: utf-8 -*-
"""layerline_save's action: on the controller (a local connection, no become), the module's work
(layerline.homesave.keep) runs in this process; a module run would start an interpreter and load
Ansible's module_utils for one small JSON write, about 0.3 s of CPU and 0.4-0.6 s of a deploy's or a
drain's wall time a file. Anywhere else, the module runs as usual.
"""
from __future__ import annotations

import json

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

MODULE = "layerline.layerline.layerline_save"


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        if self._connection.transport != "local" or self._play_context.become:
            result.update(self._execute_module(module_name=MODULE, module_args=dict(self._task.args),
                                               task_vars=task_vars))
            return result
        try:
            from layerline.homesave import ARGUMENT_SPEC, keep
        except ImportError as e:
            raise AnsibleActionFail(f"layerline_save: cannot import layerline on the controller ({e}); run "
                                    "ansible-playbook from the venv made by `make setup`") from None
        _, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        content = args.get("content")
        if content is not None and not isinstance(content, str):
            # plain data, as the module would receive it (not the task's templated containers)
            try:
                content = json.loads(json.dumps(content))
            except (TypeError, ValueError) as e:
                raise AnsibleActionFail(f"layerline_save {args['file']}: content is not JSON data ({e})") from None
        result.update(keep(args["home"], args["file"], content, check=bool(self._task.check_mode),
                           diff=bool(self._task.diff)))
        return result
