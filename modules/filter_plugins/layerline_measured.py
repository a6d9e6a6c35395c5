# -*- coding: utf-8 -*-
"""layerline_plan_measured: a thin adapter over layerline.planner.with_measured_factors (the
plan's predictions from the step factors the launch just kept in each host's probe facts)."""
from __future__ import annotations

import json

from ansible.errors import AnsibleFilterError

try:
    from layerline import LayerlineError
    from layerline.planner import Plan, with_measured_factors
    IMPORT_ERROR = None
except ImportError as e:  # the controller's interpreter lacks the package
    IMPORT_ERROR = e


def layerline_plan_measured(plan, hostvars, hosts):
    """plan with each stage predicted from its host's measured step factor; layers unchanged."""
    if IMPORT_ERROR is not None:
        raise AnsibleFilterError(f"layerline filters: cannot import layerline on the controller ({IMPORT_ERROR}); "
                                 "run ansible-playbook from the venv made by `make setup`")
    caps = {h: json.loads(json.dumps(hostvars[h]["layerline_caps"])) for h in hosts
            if "layerline_caps" in hostvars[h]}
    try:
        return with_measured_factors(Plan.from_dict(json.loads(json.dumps(plan))), caps).to_dict()
    except LayerlineError as e:
        raise AnsibleFilterError(f"layerline_plan_measured: {e}") from None


class FilterModule:
    def filters(self):
        return {"layerline_plan_measured": layerline_plan_measured}
