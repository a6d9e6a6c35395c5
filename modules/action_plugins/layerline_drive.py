# -*- coding: utf-8 -*-
"""layerline_drive's action: on the controller (a local connection, no become, no task environment),
the drive runs from ansible's own process (layerline.operations.run_drive), without a module run's
interpreter and module_utils between (about 0.3 s of CPU and 0.4 s of every deploy's and drain's wall
time). Anywhere else, the module runs as usual.
"""
from __future__ import annotations

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

MODULE = "layerline.layerline.layerline_drive"


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        # a task environment ([{}] when none is set) reaches a module's process, not this one
        environment = [e for e in (self._task.environment or []) if e]
        if self._connection.transport != "local" or self._play_context.become or environment:
            result.update(self._execute_module(module_name=MODULE, module_args=dict(self._task.args),
                                               task_vars=task_vars))
            return result
        try:
            from layerline.operations import DRIVE_ARGUMENT_SPEC, run_drive
        except ImportError as e:
            raise AnsibleActionFail(f"layerline_drive: cannot import layerline on the controller ({e}); run "
                                    "ansible-playbook from the venv made by `make setup`") from None
        _, args = self.validate_argument_spec(argument_spec=DRIVE_ARGUMENT_SPEC)
        result.update(run_drive([str(a) for a in args["argv"]], str(args["what"]),
                                check=bool(self._task.check_mode)))
        return result
