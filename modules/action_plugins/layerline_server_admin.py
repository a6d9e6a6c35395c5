# -*- coding: utf-8 -*-
"""layerline_server_admin's action: where the server runs on the controller, what the module asks
(layerline.server.admin.ask) is asked from ansible's own process (plugin_utils/controller_action.py says
when and why); elsewhere the module runs."""
from __future__ import annotations

from ansible_collections.layerline.layerline.plugins.plugin_utils.controller_action import ControllerAction


class ActionModule(ControllerAction):
    MODULE = "layerline.layerline.layerline_server_admin"
    NEEDS = "layerline.server.admin"

    def argument_spec(self) -> dict:
        from layerline.server.admin import ARGUMENT_SPEC
        return ARGUMENT_SPEC

    def run_here(self, args: dict, check: bool, diff: bool) -> dict:
        from layerline.server.admin import ask
        return ask(**args, check=check)
