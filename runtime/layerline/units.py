"""systemd units for the processes a deployment runs, where a host's PID 1 is systemd.

A unit runs the very argv the supervisor would (layerline.spec's WorkerSpec / ServerSpec), so
what a process is told is decided once; systemd takes the supervisor's jobs: restart on failure,
the plan's memory budget as MemoryMax (the kernel enforces it, as the test hosts' cgroups do),
the journal for logs, and start at boot when the inventory asks (`layerline_start_at_boot`).
The text is written here, in Python, with systemd's quoting rules (systemd.service(5),
"Command lines"; systemd.unit(5), specifiers); `systemd-analyze verify` checks it in the tests.

Which one runs a host's processes (`layerline_service_manager`: auto, systemd, supervisor) is decided
here too, from what the host itself reports (HOST_CODE, run by its own interpreter: PID 1, whether
systemd booted it, systemctl, root, which layerline units it holds, the digest of what the process
reads at start). The roles write the unit with ansible.builtin.copy and start it with
ansible.builtin.systemd_service; they decide nothing (worker_launch, server_launch).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from .errors import LayerlineError
from .planner import Plan
from .settings import SERVICE_MANAGERS, HostSettings
from .spec import SettingsLike, planned_worker, server_spec, worker_spec

UNIT_PREFIX = "layerline-"
UNIT_DIR = "/etc/systemd/system"    # the administrator's units (systemd.unit(5), "Unit File Load Path")
TARGET = "multi-user.target"        # what an enabled unit is wanted by (layerline_start_at_boot)
# the ExecStartPre / ExecStopPost that remove the ready file, so a ready file never names a process that is gone
# (what the supervisor does before every (re)start and at stop)
UNLINK_CODE = "import pathlib, sys; pathlib.Path(sys.argv[1]).unlink(missing_ok=True)"
_NAME_OK = re.compile(r"^[A-Za-z0-9:_.\\-]+$")


@dataclass(frozen=True)
class Unit:
    name: str    # e.g. layerline-worker-w1.service
    text: str


def service_manager(setting: str, pid1_comm: str | None) -> str:
    """What runs a host's processes: `setting` (layerline_service_manager) unless auto, then systemd
    where PID 1 is systemd (pid1_comm: /proc/1/comm as the host reads it) and the supervisor elsewhere
    (containers, the namespace test hosts)."""
    if setting not in SERVICE_MANAGERS:
        raise LayerlineError(f"layerline_service_manager: {setting!r} is not one of {', '.join(SERVICE_MANAGERS)}; "
                             "fix it in the inventory")
    if setting != "auto":
        return setting
    return "systemd" if (pid1_comm or "").strip() == "systemd" else "supervisor"


def service_state(unit_changed: bool, shipped_bytes: int = 0) -> str:
    """What a start asks of a worker or server, supervised or a unit: a process reads its unit (argv, the
    keys' digest) and maps the weights it loaded at start, so a changed unit or newly staged weights need a
    new process ("restarted"); else "started" (a running one is left alone)."""
    return "restarted" if unit_changed or int(shipped_bytes or 0) > 0 else "started"


def quote_arg(arg: str) -> str:
    """One argument of an Exec line: specifiers (%) and variable expansion ($) escaped, quoted when it
    holds whitespace, quotes or backslashes (systemd's C-style escapes inside double quotes)."""
    if "\n" in arg or "\0" in arg:
        raise LayerlineError(f"argument {arg!r}: a unit's command line cannot hold a newline or NUL")
    a = arg.replace("%", "%%").replace("$", "$$")
    if a == "" or re.search(r"[\s\"'\\;]", a):
        a = '"' + a.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return a


def unit_name(kind: str, host: str, slot: int = 0) -> str:
    """layerline-KIND-HOST.service (slot 1, the other slot a drain starts beside: layerline-KIND-HOST.1.service,
    as its state dir is STATE_DIR.1); HOST as the inventory names it (checked, not escaped)."""
    name = f"{UNIT_PREFIX}{kind}-{host}{f'.{slot}' if slot else ''}.service"
    if not _NAME_OK.match(name) or len(name) > 255:
        raise LayerlineError(f"host {host!r}: not usable in a systemd unit name (letters, digits, ':', '_', '.', "
                             "'-' only); rename the inventory host")
    return name


def exec_line(argv: list[str] | tuple[str, ...]) -> str:
    return " ".join(quote_arg(a) for a in argv)


def service_unit(kind: str, host: str, argv: list[str] | tuple[str, ...], *, description: str,
                 working_dir: str, memory_max: int | None = None, user: str | None = None,
                 environment: dict[str, str] | None = None, start_at_boot: bool = False, slot: int = 0,
                 ready_file: str | None = None, inputs: str = "", install: bool = False,
                 python_var: str = "layerline_worker_python") -> Unit:
    """A Type=simple service for one long-running process: restarted on failure (a few times a minute at
    most, as the supervisor does), its output to the journal, MemoryMax from the plan (bytes).
    ready_file: removed before every start and after every stop. inputs: the digest of what the process reads
    at start (HOST_CODE's), kept in a comment, so new keys change the unit's text and so restart it.
    install: an [Install] section (WantedBy), so that `systemctl enable/disable` (ansible.builtin.systemd_service
    `enabled`, from layerline_start_at_boot) decides start at boot; start_at_boot alone also writes it."""
    if not argv:
        raise LayerlineError(f"{host}: an empty command line for the {kind} unit")
    if not argv[0].startswith("/"):
        raise LayerlineError(f"{host}: the {kind}'s interpreter {argv[0]!r} must be an absolute path in a unit "
                             f"(set {python_var} to one)")
    name = unit_name(kind, host, slot)
    lines = ["[Unit]", f"Description={description}", "After=network-online.target", "Wants=network-online.target",
             "StartLimitIntervalSec=60", "StartLimitBurst=5", "",
             "[Service]", "Type=simple"]
    if ready_file:
        unlink = exec_line([argv[0], "-c", UNLINK_CODE, ready_file])
        lines += [f"ExecStartPre={unlink}", f"ExecStopPost={unlink}"]
    lines += ["ExecStart=" + exec_line(argv),
              f"WorkingDirectory={quote_arg(working_dir)}", "Restart=on-failure", "RestartSec=2",
              "KillSignal=SIGTERM", "TimeoutStopSec=30", "StandardOutput=journal", "StandardError=journal",
              f"SyslogIdentifier={name.removesuffix('.service')}"]
    if memory_max:
        lines.append(f"MemoryMax={int(memory_max)}")
    if user:
        lines.append(f"User={user}")
    for k, v in sorted((environment or {}).items()):
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
            raise LayerlineError(f"environment name {k!r}: letters, digits and '_' only")
        if "\n" in v:
            raise LayerlineError(f"environment {k}: a unit's value cannot hold a newline")
        # Environment= resolves specifiers but expands no variables: % is doubled, $ kept
        lines.append('Environment="' + f"{k}={v}".replace("%", "%%").replace("\\", "\\\\").replace('"', '\\"') + '"')
    if install or start_at_boot:
        lines += ["", "[Install]", f"WantedBy={TARGET}"]
    if inputs:
        lines += ["", f"# layerline: what it reads at start (keys) has digest {inputs}; a change restarts it"]
    return Unit(name, "\n".join(lines) + "\n")


def worker_unit(plan: Plan, host: str, hvars: SettingsLike, python: str | None = None,
                start_at_boot: bool = False, inputs: str = "", install: bool = False) -> Unit:
    """The host's worker as a unit: its WorkerSpec argv (which lowers its own priority by --nice), the
    plan's memory budget for the host as MemoryMax, in the slot the route runs it in."""
    hs = HostSettings.of(host, hvars)
    spec = worker_spec(plan, host, hs, python)
    st = plan.stage(host)
    a, b = st.layers
    return service_unit("worker", host, spec.argv, working_dir=spec.state_dir, slot=hs.slot,
                        description=f"layerline worker {host}: layers {a}:{b} of {plan.num_layers}",
                        memory_max=st.mem_budget_bytes or None, start_at_boot=start_at_boot,
                        ready_file=spec.ready_file, inputs=inputs, install=install,
                        environment={"PYTHONUNBUFFERED": "1"})


def server_unit(hvars: SettingsLike, python: str, host: str = "controller", start_at_boot: bool = False,
                inputs: str = "", install: bool = False) -> Unit:
    """The OpenAI-compatible server as a unit: its ServerSpec argv."""
    spec = server_spec(hvars, python, host)
    return service_unit("server", host, spec.argv, working_dir=spec.state_dir,
                        description=f"layerline server on {spec.bind}:{spec.port}", start_at_boot=start_at_boot,
                        ready_file=server_ready_file(spec.argv), inputs=inputs, install=install,
                        environment={"PYTHONUNBUFFERED": "1"}, python_var="layerline_server_python")


def server_ready_file(argv) -> str | None:
    argv = list(argv)
    return argv[argv.index("--ready-file") + 1] if "--ready-file" in argv else None


# -- which manager runs a host's processes --------------------------------------------------------

# Run by the host's own interpreter with one JSON argument {"dir", "units", "inputs"}: plain Python (it runs
# before layerline is there in check mode); prints one JSON object, HostFacts. The inputs digest is the
# layerline_worker module's (its inputs_digest with no environment), so both managers restart on the same change.
HOST_CODE = r"""
import hashlib, json, os, shutil, sys
ask = json.loads(sys.argv[1])
try:
    with open("/proc/1/comm") as f:
        pid1 = f.read().strip()
except OSError:
    pid1 = None
h = hashlib.sha256(json.dumps([]).encode())
for top in sorted(ask["inputs"]):
    files = [top]
    if os.path.isdir(top):
        files = sorted(os.path.join(d, f) for d, _dirs, names in os.walk(top) for f in names)
    for path in files:
        h.update(path.encode() + b"\0")
        try:
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        except OSError:
            h.update(b"missing")
def same_ns():
    try:
        return all(os.readlink("/proc/1/ns/" + n) == os.readlink("/proc/self/ns/" + n) for n in ("net", "mnt"))
    except OSError:
        return False
units = [{"name": u, "path": os.path.join(ask["dir"], u)} for u in ask["units"]]
print(json.dumps({"pid1": pid1, "booted": os.path.isdir("/run/systemd/system"), "pid1_ns": same_ns(),
                  "systemctl": shutil.which("systemctl") is not None, "root": os.geteuid() == 0,
                  "units": [u for u in units if os.path.exists(u["path"])], "inputs": h.hexdigest()}))
""".strip()


@dataclass(frozen=True)
class HostFacts:
    """What HOST_CODE reports of a host: PID 1's name, whether systemd booted it (/run/systemd/system, as
    sd_booted(3) asks), whether the play runs in PID 1's network and mount namespaces (a unit runs in those: a
    namespace test host on a systemd machine is not what PID 1 manages), whether systemctl is there, whether the
    play runs as root, which of the asked layerline units it holds ({"name", "path"}), the digest of the inputs."""
    pid1: str | None = None
    booted: bool = False
    pid1_ns: bool = False
    systemctl: bool = False
    root: bool = False
    units: tuple = ()
    inputs: str = ""

    @classmethod
    def parse(cls, text: str, host: str) -> "HostFacts":
        try:
            d = json.loads(str(text).strip().splitlines()[-1])
            return cls(pid1=d.get("pid1"), booted=bool(d.get("booted")), pid1_ns=bool(d.get("pid1_ns")),
                       systemctl=bool(d.get("systemctl")),
                       root=bool(d.get("root")), units=tuple(d.get("units") or ()), inputs=str(d.get("inputs") or ""))
        except (ValueError, IndexError, AttributeError, TypeError):
            raise LayerlineError(f"{host}: the host's service facts are not what layerline.units.HOST_CODE prints "
                                 f"({str(text)[-200:]!r}); check its interpreter (ansible_python_interpreter)") from None

    def why_not_systemd(self) -> str | None:
        """Why systemd cannot run this host's processes for the play, or None when it can."""
        if (self.pid1 or "") != "systemd":
            return f"its PID 1 is {self.pid1 or 'unknown'!r}, not systemd (a container or a namespace host)"
        if not self.booted or not self.systemctl:
            return "systemd did not boot it or systemctl is missing"
        if not self.pid1_ns:
            return ("the play runs in other network or mount namespaces than PID 1 (a namespace host), where "
                    "systemd's units would not run")
        if not self.root:
            return f"the play does not run as root (become: true), so it cannot write units to {UNIT_DIR}"
        return None


def resolve(setting: str, facts: HostFacts, host: str) -> str:
    """systemd or supervisor for this host: layerline_service_manager, where auto means systemd exactly when the
    host's PID 1 is systemd and systemctl is usable (systemd booted it, the play runs in PID 1's namespaces and as
    root)."""
    why = facts.why_not_systemd()
    chosen = service_manager(setting, facts.pid1 if why is None else None)
    if chosen == "systemd" and why is not None:
        raise LayerlineError(f"{host}: layerline_service_manager is systemd, but {why}; set it to auto or "
                             "supervisor in the inventory")
    return chosen


def host_probe_argv(python: str, units: list[str], inputs: list[str]) -> list[str]:
    """The host's command that prints its HostFacts (python: an interpreter on the host; plain Python)."""
    return [python, "-c", HOST_CODE, json.dumps({"dir": UNIT_DIR, "units": list(units), "inputs": list(inputs)})]


def worker_probe_argv(host: str, hvars: SettingsLike, slots: list[int] | None = None) -> list[str]:
    """What the worker role asks the host: its facts, the worker units of `slots` (default: the route's slot)
    and the digest of the worker's keys dir (what it reads at start)."""
    hs = HostSettings.of(host, hvars)
    slots = [hs.slot] if slots is None else [int(s) for s in slots]
    return host_probe_argv(hs.host_python, [unit_name("worker", host, s) for s in slots], [hs.worker_keys_dir])


def worker_unit_files(host: str, slots: list[int]) -> list[str]:
    """The paths the worker units of `slots` would have on the host (what the stop asks the host it holds)."""
    return [os.path.join(UNIT_DIR, unit_name("worker", host, int(s))) for s in slots]


JOURNAL_LINES = 30   # what a role shows of a unit's journal when it did not become ready


def _unit_dict(unit: Unit, enabled: bool, facts: HostFacts) -> dict:
    """What a role needs of a unit: where it is written, its text, whether it is enabled, whether the host holds it
    already (check mode asks systemd about it only then), how to read its journal."""
    return {"name": unit.name, "path": os.path.join(UNIT_DIR, unit.name), "text": unit.text, "enabled": enabled,
            "exists": any(u.get("name") == unit.name for u in facts.units if isinstance(u, dict)),
            "journal_argv": ["journalctl", "--no-pager", "-n", str(JOURNAL_LINES), "-u", unit.name]}


def worker_launch(plan: Plan, host: str, hvars: SettingsLike, facts_text: str) -> dict:
    """What the worker role does on this host: the launch spec (layerline.spec.planned_worker) and
    manager (supervisor or systemd); with systemd, `unit` {name, path, text, enabled}; `stop_units`: this slot's
    units the host holds that must stop (the plan no longer holds the host, or the supervisor runs it now)."""
    hs = HostSettings.of(host, hvars)
    out = planned_worker(plan, host, hs)
    facts = HostFacts.parse(facts_text, host)
    manager = resolve(hs.service_manager, facts, host)
    systemd = manager == "systemd" and out["planned"]
    out |= {"manager": manager, "unit": None, "stop_units": [] if systemd else list(facts.units)}
    if systemd:
        out["unit"] = _unit_dict(worker_unit(plan, host, hs, python=out["python"], inputs=facts.inputs, install=True),
                                 hs.start_at_boot, facts)
    return out


def server_probe_argv(hvars: SettingsLike, python: str, server_host: str, stop: bool = False) -> list[str]:
    """What the server role asks the serving host: its facts, the server's unit, the digest of its keys (to stop
    it: the unit only, so no checkpoint is opened)."""
    if stop:
        hs = HostSettings.of(server_host, hvars)
        return host_probe_argv(hs.server_python or python, [unit_name("server", server_host)], [])
    spec = server_spec(hvars, python, server_host)
    return host_probe_argv(spec.python, [unit_name("server", server_host)], spec.inputs)


def server_launch(hvars: SettingsLike, python: str, server_host: str, facts_text: str) -> dict:
    """The server's launch (layerline.spec.ServerSpec as a dict) and manager, as worker_launch."""
    hs = HostSettings.of(server_host, hvars)
    spec = server_spec(hs, python, server_host)
    facts = HostFacts.parse(facts_text, server_host)
    manager = resolve(hs.service_manager, facts, server_host)
    out = spec.to_dict() | {"manager": manager, "unit": None, "ready_file": server_ready_file(spec.argv),
                            "stop_units": [] if manager == "systemd" else list(facts.units)}
    if manager == "systemd":
        out["unit"] = _unit_dict(server_unit(hs, python, server_host, inputs=facts.inputs, install=True),
                                 hs.start_at_boot, facts)
    return out
