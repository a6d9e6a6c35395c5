"""ControllerHome: the controller's files for one deployment (layerline_home), each path decided here.

    HOME/plan.json            the plan the Plan play kept; later plays and the server run it
    HOME/route.json           drained hosts, promoted standbys, the workers' slot (layerline.routes)
    HOME/drive.json           the last drive's result
    HOME/request.json         an example request for the server (the printed curl line sends it)
    HOME/keys/store           every host's keypair and the controller's (the keys role)
    HOME/keys/controller      the controller's own keys dir (drive, server)
    HOME/keys/api_keys        the server's API keys (Bearer), HOME/keys/admin_key its admin key
    HOME/state/server         the server's supervisor state, log and ready file
    HOME/state/HOST           a host's worker state dir by default, for a host on the controller
                              (layerline.settings.HostSettings.default_state_dir)
    HOME/stages/HOST          a host's staged tensors, cut on the controller
    HOME/wheels               the layerline wheel the runtime role installs (SOURCE/.cache/wheels
                              without a layerline_home: wheel_dir)

Every write is atomic (files.atomic_write_json): a reader sees the old file or the new one whole.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .errors import LayerlineError
from .files import atomic_write_json

FILES = {"plan": "plan.json", "route": "route.json", "drive": "drive.json", "request": "request.json"}
SERVER_STATE_NAME = "server"   # HOME/state/server: the server's; HOME/state/HOST: a host's on the controller


@dataclass(frozen=True)
class ControllerHome:
    root: str

    @classmethod
    def of(cls, home: "str | os.PathLike | ControllerHome | None") -> "ControllerHome":
        if isinstance(home, ControllerHome):
            return home
        if home in (None, ""):
            raise LayerlineError("layerline_home is not set; set it to the controller dir that keeps the deployment's "
                                 "plan, keys and state (the embedded inventory: .cache in the checkout)")
        return cls(os.fspath(home))

    def file(self, what: str) -> str:
        if what not in FILES:
            raise LayerlineError(f"layerline_home: no file {what!r}; one of {', '.join(FILES)}")
        return os.path.join(self.root, FILES[what])

    @property
    def plan(self) -> str:
        return self.file("plan")

    @property
    def route(self) -> str:
        return self.file("route")

    @property
    def drive(self) -> str:
        return self.file("drive")

    @property
    def request(self) -> str:
        return self.file("request")

    @property
    def keys_store(self) -> str:
        return os.path.join(self.root, "keys", "store")

    @property
    def keys_controller(self) -> str:
        return os.path.join(self.root, "keys", "controller")

    @property
    def api_keys(self) -> str:
        return os.path.join(self.root, "keys", "api_keys")

    @property
    def admin_key(self) -> str:
        return os.path.join(self.root, "keys", "admin_key")

    @property
    def server_state(self) -> str:
        return os.path.join(self.root, "state", SERVER_STATE_NAME)

    def host_state(self, host: str) -> str:
        """A host's worker state dir under this home (the default for a host on the controller)."""
        return os.path.join(self.root, "state", host)

    def stages(self, host: str) -> str:
        return os.path.join(self.root, "stages", host)

    @property
    def wheels(self) -> str:
        return os.path.join(self.root, "wheels")

    # -- reads and atomic writes ------------------------------------------------------------------

    def read_json(self, what: str, fix: str):
        """The JSON a file holds; None when there is none. fix: what the user does about a bad one."""
        path = self.file(what)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise LayerlineError(f"{path}: cannot be read ({e.strerror}); fix its permissions or {fix}") from None
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError as e:
            raise LayerlineError(f"{path}: not valid JSON ({e}); {fix}") from None

    def load_plan(self, required: bool = True) -> dict:
        """The plan kept in plan.json ({} when there is none and required is false). Its contents are
        checked by whoever runs it (Plan.from_dict)."""
        plan = self.read_json("plan", "run deploy.yml again to plan anew")
        if plan is None:
            if not required:
                return {}
            raise LayerlineError(f"{self.plan}: no plan was kept here; run deploy.yml first, or set layerline_home "
                                 "to the deployment's")
        if not isinstance(plan, dict):
            raise LayerlineError(f"{self.plan}: not a JSON object; run deploy.yml again to plan anew")
        return plan

    @staticmethod
    def stored(what: str, value):
        """The data save() writes for a value: route.json keeps only the route state's own keys and a
        pending change (layerline.routes.route_record). Check mode compares it with what the file holds."""
        if what == "route":
            from .routes import route_record
            return route_record(value)
        if what == "plan" and not (isinstance(value, dict) and "stages" in value):
            raise LayerlineError("plan.json: refusing to keep a plan without stages (run the Plan play first)")
        return value

    def save(self, what: str, value, mode: int = 0o600) -> bool:
        """Write one of the home's files atomically (the data stored() gives); True when its bytes changed."""
        value = self.stored(what, value)
        os.makedirs(self.root, exist_ok=True)
        return atomic_write_json(self.file(what), value, mode, if_changed=True)


def wheel_dir(home: "str | os.PathLike | None", source: "str | os.PathLike") -> str:
    """Where the runtime role builds the layerline wheel: HOME/wheels, or SOURCE/.cache/wheels (the checkout
    the wheel is built from) for a play without a layerline_home."""
    if home in (None, ""):
        from .version import source_root
        src = os.fspath(source) or source_root()
        home = os.path.join(src, ".cache") if src else os.path.join(os.path.expanduser("~"), ".cache", "layerline")
    return ControllerHome.of(home).wheels
