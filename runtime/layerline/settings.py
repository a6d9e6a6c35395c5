"""HostSettings: every `layerline_*` inventory variable, its default and its check, in one place.

A host's variables (what Ansible's hostvars hold for it, group vars included) become one frozen
HostSettings; every value is checked as it is read, and a bad one ends in one line naming the
host, the variable and the fix. The filter plugins, the planner's nodes, the worker's, server's
and drive's launch specs (layerline.spec) and layerline.Cluster all read variables through it,
so a default stands here and nowhere else.

Each field is the variable `layerline_<field>`. Field metadata says which roles take it as an
argument (their meta/argument_specs.yml and defaults/main.yml must agree with it: the unit test
tests/test_settings.py holds them, and the README's variable table, to this class).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from .cost import CostOptions
from .endpoints import CURVE_MODES, DEFAULT_PORT, LOOPBACK, SLOTS, is_ip, slot_port, worker_ports
from .home import SERVER_STATE_NAME, ControllerHome
from .planner import COMPILE_MODES, POLICIES, ROLES, Node, PlanError, parse_layers

PREFIX = "layerline_"
DEFAULT_SERVE_PORT = 8000
SERVE_PORT_FROM_BASE = 90       # with layerline_port_base set, the server listens at base + 90 (the demo: 29190)
READY_TIMEOUT_S = 300.0         # load the checkpoint, bind, answer: minutes at most
COMPILE_READY_TIMEOUT_S = 1800.0  # a compiling worker is ready only after its warm-up compile
SERVICE_MANAGERS = ("auto", "systemd", "supervisor")  # layerline_service_manager (layerline.units decides auto)
DEFAULT_PYTHON = "/usr/bin/python3"  # a host's interpreter when the inventory names none (ansible_python_interpreter)
# What each role is handed by the plays that are not inventory variables: computed values (a plan,
# the controller's interpreter, the hosts of a group), never set by hand.
ROLE_INPUTS = {
    "layerline_worker": ("layerline_worker_plan", "layerline_worker_stop_slots"),
    "layerline_server": ("layerline_server_plan", "layerline_server_gate_may_be_down"),
    "layerline_keys": ("layerline_keys_hosts", "layerline_keys_python"),
    "layerline_runtime": ("layerline_runtime_version", "layerline_runtime_source", "layerline_runtime_wheel_dir",
                          "layerline_runtime_dependencies"),
}
# Ansible's own variables a host's settings read (how it is reached).
ANSIBLE_KEYS = ("ansible_connection", "ansible_host", "ansible_port", "ansible_python_interpreter")


class SettingsError(PlanError):
    """A layerline_* variable no deployment can take (so no plan can: a PlanError); names host, variable, fix."""


# -- checks: each takes (value, where) and returns the typed value or raises SettingsError ------------

def _bad(where: str, v, must: str) -> SettingsError:
    return SettingsError(f"{where} {v!r} must be {must}")


def _bool(v, where):
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise _bad(where, v, "true or false")


def _int(lo: int | None = None, hi: int | None = None, fix: str = "") -> Callable:
    def check(v, where):
        try:
            if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
                raise ValueError
            n = int(str(v).strip()) if isinstance(v, str) else int(v)
            if (lo is not None and n < lo) or (hi is not None and n > hi):
                raise ValueError
        except (TypeError, ValueError):
            if lo == 1 and hi is None:
                raise _bad(where, v, f"a positive integer{fix}") from None
            rng = (f" {lo}-{hi}" if hi is not None else f" >= {lo}") if lo is not None else ""
            raise _bad(where, v, f"an integer{rng}{fix}") from None
        return n
    return check


def _number(positive: bool = False, what: str = "a number") -> Callable:
    def check(v, where):
        try:
            if isinstance(v, bool):
                raise ValueError
            x = float(v)
            if x < 0 or (positive and x == 0):
                raise ValueError
        except (TypeError, ValueError):
            raise _bad(where, v, f"{'a positive' if positive else 'a non-negative'} {what}") from None
        return x
    return check


def _slot(v, where):
    if str(v).strip() not in [str(x) for x in SLOTS] or isinstance(v, bool):
        raise _bad(where, v, "0 or 1 (drain.yml sets it; see layerline_home/route.json)")
    return int(v)


def _choice(options: tuple[str, ...], verb: str = "is not one of") -> Callable:
    def check(v, where):
        if str(v) not in options:
            raise SettingsError(f"{where} {v!r} {verb} {', '.join(options)}")
        return str(v)
    return check


def _str(v, where):
    if isinstance(v, (dict, list)):
        raise _bad(where, v, "a string")
    return str(v)


def _mapping(v, where):
    if not isinstance(v, dict):
        raise _bad(where, v, "a mapping")
    return dict(v)


DISCOVER_KEYS = ("ssh_hosts", "subnet", "port", "timeout_ms", "worker_port", "device", "precision")


def _discover(v, where):
    """layerline_discover: what the layerline_discover module takes (its defaults apply to keys left out)."""
    if not isinstance(v, dict) or set(v) - set(DISCOVER_KEYS) or isinstance(v.get("ssh_hosts", []), str) \
            or not isinstance(v.get("ssh_hosts", []), list):
        raise _bad(where, v, f"a mapping with keys among {', '.join(DISCOVER_KEYS)} (ssh_hosts a list)")
    return dict(v)


def _hosts(v, where):
    """A host or a list of hosts, as inventories and `-e` give them ("w2", "w2,w3", [w2, w3])."""
    if isinstance(v, str):
        return tuple(h.strip() for h in v.split(",") if h.strip())
    if isinstance(v, (list, tuple)) and all(isinstance(h, str) for h in v):
        return tuple(h.strip() for h in v if h.strip())
    raise _bad(where, v, "a host name or a list of host names")


def _any(v, where):
    return v


def _var(default: Any, check: Callable, *, roles: tuple[str, ...] = (), set_by: str = "", group: bool = False) -> Any:
    """A field that is the inventory variable layerline_<name>. roles: the roles that take it as an
    argument. set_by: a play sets it (not a knob for the inventory). group: one value for the whole
    deployment (group vars), so its errors name the variable, not a host."""
    meta = {"check": check, "roles": roles, "set_by": set_by, "group": group}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class HostSettings:
    """One host's layerline_* variables, typed and checked. None: not set (the derived default applies:
    see the properties below)."""
    host: str
    # how Ansible reaches the host (not layerline variables)
    connection: str = ""
    ansible_host: str = ""
    ansible_port: int = 22
    ansible_python_interpreter: str = ""
    # -- the model and the run (group vars) --
    checkpoint: str | None = _var(None, _str, group=True)
    checkpoint_shared: bool = _var(True, _bool, group=True)
    demo_checkpoint: bool = _var(False, _bool, group=True)
    home: str | None = _var(None, _str, group=True)
    seq: int = _var(16, _int(1), group=True)
    generate: int = _var(0, _int(0), group=True)
    rng_seed: int = _var(0, _int(), group=True)
    reserve_ram_gb: float = _var(0.0, _number(what="number of GiB"), group=True)
    policy: str = _var("auto", _choice(POLICIES), group=True)
    objective: dict = _var({}, _mapping, group=True)
    probe_refresh: bool = _var(False, _bool, group=True)
    probe_serial: bool = _var(False, _bool, group=True)
    discover: dict = _var({}, _discover, group=True)
    port_base: int | None = _var(None, _int(1, 65000), group=True)
    # -- the drive --
    # where the last stage sends results: the drive play uses loopback when unset, Cluster.drive the
    # address its route to the last stage leaves from
    driver_addr: str | None = _var(None, _str, group=True)
    drive_reference: bool = _var(False, _bool, group=True)
    prompt_ids: list | None = _var(None, _any, group=True)
    prompt: Any = _var(None, _any, group=True)
    sequences: int | None = _var(None, _int(1), group=True)
    sampling: dict = _var({}, _mapping, group=True)
    # -- the server --
    serve_port: int | None = _var(None, _int(1, 65535), group=True)
    serve_bind: str = _var(LOOPBACK, _str, group=True)
    serve_api_keys: bool = _var(False, _bool, group=True)
    serve_restart_wait: float = _var(30.0, _number(what="number of seconds"), group=True)
    serve_on_stage_lost: str = _var("", _str, group=True)
    serve_health_deadline: float = _var(2.0, _number(positive=True, what="number of seconds"), group=True)
    serve_prefix_cache: bool = _var(True, _bool, group=True)   # the server's --prefix-cache (layerline.prefix)
    # HTTPS: a certificate (PEM, chain after it) and its key (0600) on the serving host; the CA the playbooks
    # check it with (default: the certificate itself, for a self-signed one)
    serve_tls_cert: str | None = _var(None, _str, group=True)
    serve_tls_key: str | None = _var(None, _str, group=True)
    serve_tls_ca: str | None = _var(None, _str, group=True)
    server_python: str | None = _var(None, _str, group=True)
    server_ready_timeout: float = _var(300.0, _number(positive=True, what="number of seconds"), group=True)
    # -- operations --
    drain: tuple[str, ...] = _var((), _hosts, group=True)
    rejoin: tuple[str, ...] = _var((), _hosts, group=True)
    # -- each host --
    port: int = _var(DEFAULT_PORT, _int(1, 65534, " (the next port is the control socket)"))
    addr: str | None = _var(None, _str)
    bind_addr: str | None = _var(None, _str)
    device: str = _var("cpu", _str)
    precision: str | None = _var(None, _str)
    max_ram_gb: float | None = _var(None, _number(what="number of GiB"))
    layers: str | None = _var(None, _str)
    role: str = _var("active", _choice(ROLES))
    standby_for: str | None = _var(None, _str)
    state_dir: str | None = _var(None, _str)
    stage_dir: str | None = _var(None, _str)
    threads: int | None = _var(None, _int(1))
    nice: int = _var(0, _int(0, 19, " (19 yields the most; a worker may only lower its priority)"))
    compile: str = _var("off", _choice(COMPILE_MODES, "must be one of"))
    compile_cache: str | None = _var(None, _str)
    keys_dir: str | None = _var(None, _str)
    curve: str = _var("auto", _choice(CURVE_MODES))
    slot: int = _var(0, _slot, set_by="playbooks/plan.yml (from route.json)")
    runtime_install: bool = _var(True, _bool, roles=("layerline_runtime",))
    runtime_python: str | None = _var(None, _str, roles=("layerline_runtime",))
    runtime_connect_timeout: int = _var(15, _int(1), roles=("layerline_runtime",))
    # what runs the worker (and, on the serving host, the server): auto = a systemd unit where the host's PID 1 is
    # systemd and the play may use systemctl, else layerline's supervisor (layerline.units.resolve)
    service_manager: str = _var("auto", _choice(SERVICE_MANAGERS))
    start_at_boot: bool = _var(False, _bool)   # systemd units only: enabled, so they start at boot
    worker_python: str | None = _var(None, _str, roles=("layerline_worker",))
    worker_ready_timeout: float = _var(READY_TIMEOUT_S, _number(positive=True, what="number of seconds"),
                                       roles=("layerline_worker",))

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def from_vars(cls, host: str, hvars: dict | None) -> "HostSettings":
        """Every layerline_* variable of this host, checked; unset (None, "") ones keep their default."""
        hvars = hvars or {}
        kw: dict[str, Any] = {"host": str(host), "connection": str(hvars.get("ansible_connection") or ""),
                              "ansible_host": str(hvars.get("ansible_host") or ""),
                              "ansible_python_interpreter": str(hvars.get("ansible_python_interpreter") or "")}
        try:
            kw["ansible_port"] = int(hvars.get("ansible_port") or 22)
        except (TypeError, ValueError):
            raise SettingsError(f"{host}: ansible_port {hvars.get('ansible_port')!r} must be an integer") from None
        for f in variables():
            name = PREFIX + f.name
            v = hvars.get(name)
            if v is None or (isinstance(v, str) and v == ""):
                continue
            try:
                kw[f.name] = f.metadata["check"](v, f"{name}:" if f.metadata["group"] else f"{host}: {name}")
            except SettingsError as e:
                raise SettingsError(f"{e}; fix it in the inventory (or the -e that sets it)") from None
        s = cls(**kw)
        s.layer_pin  # noqa: B018  (checked here, so a bad pin fails before anything is measured)
        if bool(s.serve_tls_cert) != bool(s.serve_tls_key):
            raise SettingsError("layerline_serve_tls_cert and layerline_serve_tls_key go together: set both (a PEM "
                                "certificate and its key on the serving host) or neither; fix it in the inventory")
        return s

    @classmethod
    def of(cls, host: str, hvars: "HostSettings | dict | None") -> "HostSettings":
        return hvars if isinstance(hvars, HostSettings) else cls.from_vars(host, hvars)

    def to_vars(self) -> dict[str, Any]:
        """The variables as the inventory names them, with defaults filled in (None: derived), and how
        the host is reached: from_vars(host, to_vars()) is this HostSettings again."""
        return {PREFIX + f.name: getattr(self, f.name) for f in variables()} | {
            "ansible_connection": self.connection, "ansible_host": self.ansible_host, "ansible_port": self.ansible_port,
            "ansible_python_interpreter": self.ansible_python_interpreter}

    # -- derived values: each decided here once ---------------------------------------------------

    @property
    def local(self) -> bool:
        return self.connection == "local"

    @property
    def address(self) -> str:
        """The address other hosts reach this one at."""
        if self.addr:
            return self.addr
        if self.local:
            return LOOPBACK
        return self.ansible_host or self.host

    @property
    def bind_host(self) -> str:
        """What the worker binds: zmq binds IP addresses, not names, so a host known by name listens on
        every interface (off loopback, so CURVE is on)."""
        h = self.bind_addr or self.address
        return h if is_ip(h) else "*"

    def data_port(self, slot: int | None = None) -> int:
        return slot_port(self.port, self.slot if slot is None else slot)

    def ports(self, slot: int | None = None) -> tuple[int, int]:
        """(data, control) of this host's worker in a slot (default: the route's)."""
        return worker_ports(self.data_port(slot))

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.address}:{self.data_port()}"

    @property
    def default_state_dir(self) -> str:
        """The state dir when layerline_state_dir is not set: HOME/state/HOST (layerline.home) for a host on
        the controller (local connection) when layerline_home is set, else /tmp/layerline-HOST on the
        host itself (a remote host does not see the controller's dirs)."""
        if self.home and self.local:
            if self.host == SERVER_STATE_NAME:
                raise SettingsError(f"{self.host}: its default state dir would be the server's "
                                    f"({ControllerHome.of(self.home).server_state}); set layerline_state_dir for it")
            return ControllerHome.of(self.home).host_state(self.host)
        return f"/tmp/layerline-{self.host}"

    def state_dir_in(self, slot: int | None = None) -> str:
        base = self.state_dir or self.default_state_dir
        slot = self.slot if slot is None else slot
        return base if slot == 0 else f"{base}.{slot}"

    @property
    def home_state_dir(self) -> str:
        """Slot 0's state dir: keys, staged tensors and the compile cache serve both slots from here."""
        return self.state_dir_in(0)

    @property
    def caps_file(self) -> str:
        """The probe's cache (and the step factors the workers measured), in slot 0's state dir."""
        return os.path.join(self.home_state_dir, "caps.json")

    @property
    def stage_root(self) -> str:
        """Where the host keeps its staged checkpoints when the model's path is not shared: one dir per stage
        (stage_dir_for), layerline's own (a deploy or drain that committed removes what its plan does not run)."""
        return self.stage_dir or os.path.join(self.home_state_dir, "checkpoint")

    def stage_dir_for(self, layers: "tuple[int, int] | list[int]", num_layers: int) -> str:
        """The staged checkpoint of layers [start, end) of a num_layers model on this host (stage_name)."""
        return os.path.join(self.stage_root, stage_name(layers, num_layers))

    @property
    def checkpoint_path(self) -> str:
        """layerline_checkpoint as the controller opens it; one line naming the fix when it is not set."""
        if not self.checkpoint:
            raise SettingsError("layerline_checkpoint is not set; point it at a Hugging Face model dir or a .gguf file")
        return self.checkpoint

    @property
    def controller_home(self) -> ControllerHome:
        """layerline_home: the controller's files (plan, route, keys, server state); one line when unset."""
        return ControllerHome.of(self.home)

    def worker_checkpoint(self, layers: "tuple[int, int] | list[int]", num_layers: int) -> str:
        """The checkpoint path a worker of these layers opens on its host: the model's own when it is shared,
        else the stage of these layers (staged by playbooks/tasks/stage.yml)."""
        return self.checkpoint_path if self.checkpoint_shared else self.stage_dir_for(layers, num_layers)

    @property
    def probe_checkpoint(self) -> str:
        """What the probe times the disk of: where this host's weights will land (its stages' root: one
        path whatever the layers, so the probe's cache holds across drains)."""
        return str(self.checkpoint) if self.checkpoint_shared else self.stage_root

    @property
    def demo_checkpoint_stamp(self) -> str:
        """The file `layerline demo-checkpoint` leaves when the demo checkpoint is whole (a .gguf: itself)."""
        ckpt = str(self.checkpoint)
        return ckpt if ckpt.endswith(".gguf") else os.path.join(ckpt, "layerline-demo.json")

    @property
    def probe_throttle(self) -> int:
        """The probe task's throttle: 1 (one host at a time) with layerline_probe_serial, else 0 (no limit)."""
        return 1 if self.probe_serial else 0

    @property
    def probe_device(self) -> str:
        return self.device.split("+")[0]

    @property
    def host_python(self) -> str:
        """The host's interpreter as Ansible runs it: ansible_python_interpreter, else (also for Ansible's
        discovery modes, auto...) DEFAULT_PYTHON."""
        given = self.ansible_python_interpreter
        return DEFAULT_PYTHON if not given or given.startswith("auto") else given

    @property
    def runtime_interpreter(self) -> str:
        """The interpreter the runtime role makes layerline importable in (the keys role lays out the keys
        with it): layerline_runtime_python, else the host's."""
        return self.runtime_python or self.host_python

    @property
    def worker_interpreter(self) -> str:
        """The interpreter the worker runs under: layerline_worker_python, else the runtime role's."""
        return self.worker_python or self.runtime_interpreter

    @property
    def worker_keys_dir(self) -> str:
        return self.keys_dir or os.path.join(self.home_state_dir, "keys")

    @property
    def worker_compile_cache(self) -> str:
        return self.compile_cache or os.path.join(self.home_state_dir, "inductor")

    @property
    def serve_port_resolved(self) -> int:
        if self.serve_port is not None:
            return self.serve_port
        return self.port_base + SERVE_PORT_FROM_BASE if self.port_base is not None else DEFAULT_SERVE_PORT

    @property
    def layer_pin(self) -> tuple[int, int] | None:
        return parse_layers(self.layers, self.host)

    @property
    def max_ram_bytes(self) -> int | None:
        return None if self.max_ram_gb is None else int(self.max_ram_gb * 2**30)

    def facts(self) -> dict[str, Any]:
        """The variables (short names, defaults filled in) and what is derived from them, for the plays."""
        out = {f.name: getattr(self, f.name) for f in variables()}
        out.update(address=self.address, endpoint=self.endpoint, state_dir=self.state_dir_in(),
                   state_dirs=[self.state_dir_in(k) for k in SLOTS], other_state_dir=self.state_dir_in(1 - self.slot),
                   slots=list(SLOTS), other_slot=1 - self.slot,
                   home_state_dir=self.home_state_dir, caps_file=self.caps_file, stage_root=self.stage_root,
                   keys_dir=self.worker_keys_dir, probe_checkpoint=self.probe_checkpoint,
                   probe_device=self.probe_device, serve_port=self.serve_port_resolved,
                   demo_checkpoint_stamp=self.demo_checkpoint_stamp, host_python=self.host_python,
                   probe_throttle=self.probe_throttle,
                   runtime_python=self.runtime_interpreter, worker_python=self.worker_interpreter,
                   drain=list(self.drain), rejoin=list(self.rejoin))
        return out

    def cost_options(self) -> CostOptions:
        return CostOptions.from_vars(self.objective, self.reserve_ram_gb)

    def ready_timeout(self, compiling: bool) -> float:
        """Seconds to wait for the worker's ready file: at least the compile wait when it compiles."""
        t = self.worker_ready_timeout
        return max(t, COMPILE_READY_TIMEOUT_S) if compiling else t

    def node(self, caps) -> Node:
        """The planner's Node for this host with its probed caps (NodeCaps or its JSON)."""
        if caps is None:
            raise SettingsError(f"{self.host}: no layerline_caps facts; run the probe play (playbooks/probe.yml) first")
        device = "cuda:0" if self.device == "cuda+cpu" else self.device  # spill: planned as the GPU's budget
        return Node(host=self.host, caps=caps, device=device, role=self.role, layers=self.layer_pin,
                    precision=self.precision or None, standby_for=self.standby_for or None,
                    max_ram_bytes=self.max_ram_bytes, endpoint=self.endpoint, threads=self.threads,
                    compile=self.compile)


def variables():
    """The fields that are layerline_* variables, in declaration order."""
    return [f for f in fields(HostSettings) if "check" in f.metadata]


def variable_names() -> list[str]:
    return [PREFIX + f.name for f in variables()]


def stage_name(layers: "tuple[int, int] | list[int]", num_layers: int) -> str:
    """A staged checkpoint's dir name under a host's stage root: what it holds, layers [start, end) of a
    num_layers model (so whether it has the embedding and the head), not the slot or the precision (a stage
    holds the file's own bytes whatever precision its worker loads it at). A drain that keeps a host's layers
    opens the stage it runs already, one that moves them stages beside it, never over it."""
    start, end = (int(x) for x in layers)
    if not 0 <= start < end <= int(num_layers):
        raise SettingsError(f"stage layers {start}:{end} are not within the model's {num_layers} layers; re-plan")
    return f"layers-{start}-{end}-of-{int(num_layers)}"


SERVER_GROUP = "layerline_server"


def server_host(groups: dict) -> str:
    """Where the server runs: the first host of group layerline_server, else the controller."""
    hosts = list((groups or {}).get(SERVER_GROUP) or [])
    return str(hosts[0]) if hosts else "localhost"
