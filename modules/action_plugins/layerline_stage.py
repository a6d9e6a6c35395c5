# -*- coding: utf-8 -*-
"""layerline_stage's action: state shipped ships a host its stage in one task (the module documents it).

Ansible's copy asked each file's checksum and then its mode, two module runs a file and host even when
nothing was sent; here a host costs two module runs whatever its stage holds - what it lacks (the module,
state pruned), each of those files sent into Ansible's temporary dir on the host (no module run), then
their check and move into place (state installed). Every other state is the module's alone.
"""
from __future__ import annotations

import os

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

MODULE = "layerline.layerline.layerline_stage"


class ActionModule(ActionBase):
    TRANSFERS_FILES = False   # a temporary dir only when there is something to send

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        if args.get("state") != "shipped":
            result.update(self._execute_module(module_name=MODULE, module_args=args, task_vars=task_vars))
            return result
        src = args.pop("src", None)
        if not src:
            raise AnsibleActionFail("layerline_stage: state shipped needs src, the controller's dir of the stage's files")
        src = os.path.expanduser(str(src))
        pruned = self._execute_module(module_name=MODULE, module_args={**args, "state": "pruned"},
                                      task_vars=task_vars)
        if pruned.get("failed") or pruned.get("unreachable"):
            result.update(pruned)
            return result
        send = sorted(pruned.get("send") or {})
        result.update(removed=pruned.get("removed", []), path=pruned.get("path"), send=pruned.get("send", {}),
                      shipped=[], shipped_bytes=0)
        if self._task.check_mode or (not send and pruned.get("whole")):
            result["changed"] = bool(pruned.get("changed") or send or not pruned.get("whole"))
            return result
        missing = [n for n in send if not os.path.isfile(os.path.join(src, n))]
        if missing:
            raise AnsibleActionFail(f"layerline_stage: {os.path.join(src, missing[0])} is not on the controller; "
                                    "cut the stage again (playbooks/stage.yml)")
        sent = {}
        if send:
            tmpdir = self._connection._shell.tmpdir or self._make_tmp_path()
            for name in send:
                sent[name] = self._connection._shell.join_path(tmpdir, name)
                self._transfer_file(os.path.join(src, name), sent[name])
            self._fixup_perms2([tmpdir, *sent.values()], execute=False)
        # no file to send but the manifest to write: installed with nothing sent marks the stage whole
        installed = self._execute_module(module_name=MODULE, module_args={**args, "state": "installed",
                                                                          "sent": sent}, task_vars=task_vars)
        result.update(installed)
        # what the first run removed stays reported (the second removes nothing)
        result["removed"] = pruned.get("removed", [])
        result["changed"] = bool(installed.get("changed") or pruned.get("changed"))
        return result
