# -*- coding: utf-8 -*-
"""layerline_server_admin's action: where the server runs on the controller (a local connection, no
become), what the module asks (layerline.server.admin.ask) is asked from ansible's own process, without
a module run's interpreter and module_utils (the route switch also needed the admin key read by a module
run of its own). Anywhere else, the module runs as usual.
"""
from __future__ import annotations

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

MODULE = "layerline.layerline.layerline_server_admin"


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        if self._connection.transport != "local" or self._play_context.become:
            result.update(self._execute_module(module_name=MODULE, module_args=dict(self._task.args),
                                               task_vars=task_vars))
            return result
        try:
            from layerline.server.admin import ARGUMENT_SPEC, ask
        except ImportError as e:
            raise AnsibleActionFail(f"layerline_server_admin: cannot import layerline on the controller ({e}); run "
                                    "ansible-playbook from the venv made by `make setup`") from None
        _, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        args = {k: args.get(k) for k in ARGUMENT_SPEC}
        if self._task.check_mode and args["op"] == "route":
            result.update(changed=False, status=None, msg="check mode: the route was not switched")
            return result
        if args["plan"] is not None:   # plain data, as the module would receive it
            import json
            args["plan"] = json.loads(json.dumps(args["plan"]))
        result.update(ask(**args))
        return result
