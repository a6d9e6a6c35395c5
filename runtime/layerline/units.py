"""systemd units for the processes a deployment runs, where a host's PID 1 is systemd.

A unit runs the very argv the supervisor would (layerline.spec's WorkerSpec / ServerSpec), so
what a process is told is decided once; systemd takes the supervisor's jobs: restart on failure,
the plan's memory budget as MemoryMax (the kernel enforces it, as the test hosts' cgroups do),
the journal for logs, and start at boot when the inventory asks (`layerline_start_at_boot`).
The text is written here, in Python, with systemd's quoting rules (systemd.service(5),
"Command lines"; systemd.unit(5), specifiers); `systemd-analyze verify` checks it in the tests.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import LayerlineError
from .planner import Plan
from .spec import SettingsLike, server_spec, worker_spec

SERVICE_MANAGERS = ("auto", "systemd", "supervisor")
UNIT_PREFIX = "layerline-"
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
        raise LayerlineError(f"layerline_service_manager: {setting!r} is not one of {', '.join(SERVICE_MANAGERS)}")
    if setting != "auto":
        return setting
    return "systemd" if (pid1_comm or "").strip() == "systemd" else "supervisor"


def quote_arg(arg: str) -> str:
    """One argument of an Exec line: specifiers (%) and variable expansion ($) escaped, quoted when it
    holds whitespace, quotes or backslashes (systemd's C-style escapes inside double quotes)."""
    if "\n" in arg or "\0" in arg:
        raise LayerlineError(f"argument {arg!r}: a unit's command line cannot hold a newline or NUL")
    a = arg.replace("%", "%%").replace("$", "$$")
    if a == "" or re.search(r"[\s\"'\\;]", a):
        a = '"' + a.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return a


def unit_name(kind: str, host: str) -> str:
    """layerline-KIND-HOST.service; HOST as the inventory names it (checked, not escaped)."""
    name = f"{UNIT_PREFIX}{kind}-{host}.service"
    if not _NAME_OK.match(name) or len(name) > 255:
        raise LayerlineError(f"host {host!r}: not usable in a systemd unit name (letters, digits, ':', '_', '.', "
                             "'-' only); rename the inventory host")
    return name


def service_unit(kind: str, host: str, argv: list[str] | tuple[str, ...], *, description: str,
                 working_dir: str, memory_max: int | None = None, user: str | None = None,
                 environment: dict[str, str] | None = None, start_at_boot: bool = False) -> Unit:
    """A Type=simple service for one long-running process: restarted on failure (a few times a minute at
    most, as the supervisor does), its output to the journal, MemoryMax from the plan (bytes)."""
    if not argv:
        raise LayerlineError(f"{host}: an empty command line for the {kind} unit")
    if not argv[0].startswith("/"):
        raise LayerlineError(f"{host}: the {kind}'s interpreter {argv[0]!r} must be an absolute path in a unit "
                             "(set layerline_python to one)")
    lines = ["[Unit]", f"Description={description}", "After=network-online.target", "Wants=network-online.target",
             "StartLimitIntervalSec=60", "StartLimitBurst=5", "",
             "[Service]", "Type=simple", "ExecStart=" + " ".join(quote_arg(a) for a in argv),
             f"WorkingDirectory={quote_arg(working_dir)}", "Restart=on-failure", "RestartSec=2",
             "KillSignal=SIGTERM", "TimeoutStopSec=30", "StandardOutput=journal", "StandardError=journal",
             f"SyslogIdentifier={UNIT_PREFIX}{kind}-{host}"]
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
    if start_at_boot:
        lines += ["", "[Install]", "WantedBy=multi-user.target"]
    return Unit(unit_name(kind, host), "\n".join(lines) + "\n")


def worker_unit(plan: Plan, host: str, hvars: SettingsLike, python: str | None = None,
                start_at_boot: bool = False) -> Unit:
    """The host's worker as a unit: its WorkerSpec argv (which lowers its own priority by --nice), the
    plan's memory budget for the host as MemoryMax."""
    spec = worker_spec(plan, host, hvars, python)
    st = plan.stage(host)
    a, b = st.layers
    return service_unit("worker", host, spec.argv, working_dir=spec.state_dir,
                        description=f"layerline worker {host}: layers {a}:{b} of {plan.num_layers}",
                        memory_max=st.mem_budget_bytes or None, start_at_boot=start_at_boot)


def server_unit(hvars: SettingsLike, python: str, host: str = "controller", start_at_boot: bool = False) -> Unit:
    """The OpenAI-compatible server as a unit: its ServerSpec argv."""
    spec = server_spec(hvars, python, host)
    return service_unit("server", host, spec.argv, working_dir=spec.state_dir,
                        description=f"layerline server on {spec.bind}:{spec.port}", start_at_boot=start_at_boot)
