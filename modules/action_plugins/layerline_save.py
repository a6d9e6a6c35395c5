# -*- coding: utf-8 -*-
"""layerline_save's action: on the controller the module's work (layerline.homesave.keep) runs in
ansible's own process (plugin_utils/controller_action.py says when and why); elsewhere the module runs."""
from __future__ import annotations

from ansible_collections.layerline.layerline.plugins.plugin_utils.controller_action import ControllerAction


class ActionModule(ControllerAction):
    MODULE = "layerline.layerline.layerline_save"
    NEEDS = "layerline.homesave"

    def argument_spec(self) -> dict:
        from layerline.homesave import ARGUMENT_SPEC
        return ARGUMENT_SPEC

    def run_here(self, args: dict, check: bool, diff: bool) -> dict:
        from layerline.homesave import keep
        return keep(args["home"], args["file"], args["content"], check=check, diff=diff)
