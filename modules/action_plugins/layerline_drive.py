# -*- coding: utf-8 -*-
"""layerline_drive's action: on the controller the drive (layerline.operations.run_drive) runs from
ansible's own process (plugin_utils/controller_action.py says when and why); elsewhere the module runs."""
from __future__ import annotations

from ansible_collections.layerline.layerline.plugins.plugin_utils.controller_action import ControllerAction


class ActionModule(ControllerAction):
    MODULE = "layerline.layerline.layerline_drive"
    NEEDS = "layerline.operations"

    def argument_spec(self) -> dict:
        from layerline.operations import DRIVE_ARGUMENT_SPEC
        return DRIVE_ARGUMENT_SPEC

    def run_here(self, args: dict, check: bool, diff: bool) -> dict:
        from layerline.operations import run_drive
        return run_drive([str(a) for a in args["argv"]], str(args["what"]), check=check)
