# -*- coding: utf-8 -*-
"""The action plugins' shared step: a task whose module does a small job in Python (a JSON write, a
drive's subprocess, an HTTP request) does it in ansible's own process where it runs on the controller
(a local connection, no become, no task environment), since a module run costs a fresh interpreter and
Ansible's module_utils (about 0.3 s of CPU, 0.4-0.6 s on a deploy's or a drain's critical path).
Anywhere else its module runs as usual. Each subclass names its module, its layerline function and
the argument spec that function's module shares.
"""
from __future__ import annotations

import json

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase


class ControllerAction(ActionBase):
    TRANSFERS_FILES = False
    MODULE = ""        # the module's FQCN
    NEEDS = ""         # where its layerline code lives, for the error when it cannot be imported

    def run_here(self, args: dict, check: bool, diff: bool) -> dict:
        """The module's result, made in this process from the validated arguments."""
        raise NotImplementedError

    def argument_spec(self) -> dict:
        raise NotImplementedError

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        # a task environment ([{}] when none is set) reaches a module's process, not this one
        environment = [e for e in (self._task.environment or []) if e]
        if self._connection.transport != "local" or self._play_context.become or environment:
            result.update(self._execute_module(module_name=self.MODULE, module_args=dict(self._task.args),
                                               task_vars=task_vars))
            return result
        try:
            spec = self.argument_spec()
        except ImportError as e:
            raise AnsibleActionFail(f"{self.MODULE.rsplit('.', 1)[-1]}: cannot import {self.NEEDS} on the "
                                    f"controller ({e}); run ansible-playbook from the venv made by `make setup`") from None
        _, args = self.validate_argument_spec(argument_spec=spec)
        args = {k: plain(args.get(k)) for k in spec}
        result.update(self.run_here(args, check=bool(self._task.check_mode), diff=bool(self._task.diff)))
        return result


def plain(value):
    """Plain JSON data, as a module would receive it (not the task's templated containers)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise AnsibleActionFail(f"an argument is not JSON data ({e})") from None
