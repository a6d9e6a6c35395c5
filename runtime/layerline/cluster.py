"""layerline.Cluster: the Python API over the project's playbooks, run with ansible-runner.

    from layerline import Cluster
    c = Cluster.from_path("inventory")
    c.autoplan()                 # discover (when the inventory has layerline_discover), probe, plan
    print(c.plan_table())
    c.launch()                   # one worker per planned host
    print(c.drive(generate=8))   # per-stage times, logits
    c.teardown()

The only runtime module that imports Ansible (ansible_runner). Every step runs the repo's own
playbooks (playbooks/*.yml, the same ones deploy.yml imports) through a small wrapper playbook
in this Cluster's private data dir, so the inventory, ansible.cfg, roles, modules and filters
behave exactly as for `ansible-playbook deploy.yml`. Facts pass between plays only within one
ansible-playbook run, so each step runs the plays it needs together, and the Cluster keeps
what they reported (caps, plan, each host's worker argv) between steps.

Stages are looked up by host name, never by position in the inventory.
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from .errors import LayerlineError

# DESIGN's NodeCaps as the probe play reports it: one JSON object per host (layerline.caps.NodeCaps.to_dict())
CapsJSON = dict[str, Any]

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the repo root for a source checkout
_PROBE_PLAYS = ("checkpoint", "runtime", "probe")  # the probe measures the checkpoint's disk
_PLAN_PLAYS = ("checkpoint", "runtime", "probe", "plan")
_LAUNCH_PLAYS = ("keys", "stage", "launch")  # keys, staged weights, then the workers (deploy.yml order)
_STATUS = {"runner_on_ok": "ok", "runner_on_failed": "failed", "runner_on_skipped": "skipped",
           "runner_on_unreachable": "unreachable"}
# Ansible wraps a module's or filter's message in the templating chain; the innermost part is ours.
_WRAPPERS = re.compile(r"^(?:Task failed: |Finalization of task args for '[^']*' failed: |"
                       r"Error while resolving value for '[^']*': |The (?:filter|lookup|test) plugin '[^']*' failed: |"
                       r"Conditional result \([^)]*\) was derived from value of type '[^']*' at '[^']*'\. )+")


class ClusterError(LayerlineError):
    """A play failed: names the host, the task and the task's own message."""

    def __init__(self, message: str, host: str | None = None, task: str | None = None,
                 msg: str | None = None, step: str | None = None):
        super().__init__(message)
        self.host, self.task, self.msg, self.step = host, task, msg, step


@dataclass
class HostFailure:
    host: str
    task: str
    msg: str
    action: str = ""
    tag: str = ""              # the playbook (or role) the task came from
    unreachable: bool = False


@dataclass
class _Run:
    """What one ansible-playbook run reported: task results by host, failures, progress lines."""
    step: str
    stream: TextIO | None
    wrapper: str = ""
    results: list[tuple[str, str, str, dict]] = field(default_factory=list)  # (host, task, action, res)
    failures: list[HostFailure] = field(default_factory=list)
    _tags: dict[str, str] = field(default_factory=dict)

    def _say(self, line: str) -> None:
        if self.stream is not None:
            print(line, file=self.stream, flush=True)

    def handler(self, ev: dict) -> bool:
        event = ev.get("event")
        ed = ev.get("event_data") or {}
        if event == "playbook_on_task_start":
            tag = _tag(ed, self.wrapper)
            self._tags[ed.get("task_uuid", "")] = tag
            self._say(f"[{tag}] {ed.get('task') or ed.get('name') or '?'}")
            return False
        if event not in _STATUS:
            return False  # keep the artifacts small: the stdout file holds the rest
        host = str(ed.get("host") or "?")
        res = ed.get("res") if isinstance(ed.get("res"), dict) else {}
        tag = self._tags.get(ed.get("task_uuid", ""), _tag(ed, self.wrapper))
        task, action = str(ed.get("task") or "?"), str(ed.get("task_action") or "")
        status = _STATUS[event]
        if status == "ok" and res.get("changed"):
            status = "changed"
        if event == "runner_on_failed" and ed.get("ignore_errors"):
            status = "failed (ignored)"
        elif event in ("runner_on_failed", "runner_on_unreachable"):
            self.failures.append(HostFailure(host, task, _failure_msg(res), action, tag,
                                             event == "runner_on_unreachable"))
        if event == "runner_on_ok":
            self.results.append((host, task, action, res))
        self._say(f"[{tag}] {host} {status}")
        return event in ("runner_on_failed", "runner_on_unreachable")  # kept in artifacts for a post-mortem

    def facts(self, name: str) -> dict[str, Any]:
        """{host: value} of a fact the run set (set_fact or a module's ansible_facts), last one wins."""
        out = {}
        for host, _task, _action, res in self.results:
            f = res.get("ansible_facts")
            if isinstance(f, dict) and name in f:
                out[host] = f[name]
        return out

    def by_action(self, action: str) -> list[tuple[str, dict]]:
        return [(h, r) for h, _t, a, r in self.results if a == action or a.endswith("." + action)]


def _tag(ed: dict, wrapper: str = "") -> str:
    """Which playbook or role a task came from, for progress lines: probe, plan, layerline_worker, ..."""
    if ed.get("role"):  # the role's own name, without its collection (layerline.layerline.)
        return str(ed["role"]).rsplit(".", 1)[-1]
    path = str(ed.get("task_path") or "").rsplit(":", 1)[0]
    if wrapper and path == wrapper:
        return "cluster"
    return Path(path).stem if path else "ansible"


def _failure_msg(res: dict) -> str:
    """The task's own message in one line (the innermost, for Ansible's wrapped template errors)."""
    if isinstance(res.get("results"), list):  # a loop: the first failed item
        for item in res["results"]:
            if isinstance(item, dict) and (item.get("failed") or item.get("unreachable")):
                return _failure_msg(item)
    msg = " ".join(str(res.get("msg") or "").split())
    msg = _WRAPPERS.sub("", msg).strip()
    stderr = _last_line(res.get("stderr") or "")
    if stderr and (not msg or msg == "non-zero return code"):
        msg = f"{msg}: {stderr}" if msg else stderr
    if not msg and res.get("exception"):
        msg = _last_line(res["exception"])
    return msg or "failed (no message)"


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _find_project_dir(hint: str | os.PathLike | None, inventory: str | None) -> Path:
    """The repo root: the dir holding deploy.yml, playbooks/ and ansible.cfg."""
    def ok(p: Path) -> bool:
        return (p / "deploy.yml").is_file() and (p / "playbooks").is_dir() and (p / "ansible.cfg").is_file()

    if hint is not None:
        p = Path(hint).expanduser().resolve()
        if not ok(p):
            raise LayerlineError(f"project_dir {p}: no deploy.yml, playbooks/ and ansible.cfg there; point it at "
                                 "the layerline checkout")
        return p
    candidates = []
    if os.environ.get("LAYERLINE_PROJECT_DIR"):
        candidates.append(Path(os.environ["LAYERLINE_PROJECT_DIR"]))
    candidates.append(_PACKAGE_ROOT)
    for start in filter(None, (inventory, os.getcwd())):
        candidates.extend(Path(start).resolve().parents)
        candidates.append(Path(start).resolve())
    for c in candidates:
        if ok(c):
            return c.resolve()
    raise LayerlineError("project_dir: cannot find the layerline checkout (deploy.yml, playbooks/, ansible.cfg); "
                         "pass project_dir= or set LAYERLINE_PROJECT_DIR")


def _walk(d: Any):
    if isinstance(d, dict):
        for k, v in d.items():
            yield k, v
            yield from _walk(v)
    elif isinstance(d, list):
        for v in d:
            yield from _walk(v)


def _has_key(d: Any, key: str) -> bool:
    return any(k == key for k, _ in _walk(d))


def _has_group(inv: dict, group: str) -> bool:
    if group in inv:
        return True
    return any(isinstance(v, dict) and isinstance(v.get("children"), dict) and _has_group(v["children"], group)
               for v in inv.values())


class Cluster:
    """A configured, probed, planned cluster, driven through the project's playbooks.

    Build one with Cluster.from_path(inventory) or Cluster.from_config(inventory_dict).
    """

    def __init__(self, inventory: str | os.PathLike, *, extravars: dict | None = None,
                 project_dir: str | os.PathLike | None = None, quiet: bool = False,
                 data_dir: str | os.PathLike | None = None, envvars: dict | None = None,
                 keep_artifacts: int = 3, stream: TextIO | None = None):
        inv = Path(inventory).expanduser()
        if not inv.exists():
            raise LayerlineError(f"inventory {inventory}: no such file or directory; give an inventory dir or file "
                                 "(the default is inventory/ in the checkout)")
        self.inventory = inv.resolve()
        self.project_dir = _find_project_dir(project_dir, str(self.inventory))
        self.extravars = dict(extravars or {})
        self.envvars = dict(envvars or {})
        self.quiet = quiet
        self.stream = stream
        self.keep_artifacts = max(1, int(keep_artifacts))
        if data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="layerline-cluster-"))
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.data_dir), True)
        else:
            self.data_dir = Path(data_dir).expanduser().resolve()
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._finalizer = None
        self._cancel = threading.Event()
        self._runs = 0
        self.discovered: dict[str, dict] = {}          # host -> host vars add_host gave it
        self.discover_failures: list[tuple[str, str]] = []
        self.probe_failures: dict[str, str] = {}       # host -> why it is left out
        self._caps: dict[str, CapsJSON] = {}
        self._plan: dict | None = None
        self._report: dict[str, dict] = {}             # host -> what the report play said
        self._index: dict | None = None

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_path(cls, inventory: str | os.PathLike, *, extravars: dict | None = None,
                  project_dir: str | os.PathLike | None = None, quiet: bool = False, **kw) -> "Cluster":
        """An inventory dir or file (the repo's inventory/ is the embedded default)."""
        return cls(inventory, extravars=extravars, project_dir=project_dir, quiet=quiet, **kw)

    @classmethod
    def from_config(cls, config: dict, *, extravars: dict | None = None,
                    project_dir: str | os.PathLike | None = None, quiet: bool = False,
                    data_dir: str | os.PathLike | None = None, **kw) -> "Cluster":
        """An inventory given as a dict (YAML inventory shape: {layerline: {hosts: {...}, vars: {...}}}).

        It is written into the Cluster's private data dir. When the dict does not set it,
        layerline_home defaults to DATA_DIR/home (so a host on this machine keeps its state in
        layerline_home/state/HOST: layerline.settings); layerline_checkpoint must be set unless
        layerline_demo_checkpoint is true (then it defaults to layerline_home/demo-llama).
        """
        if not isinstance(config, dict):
            raise LayerlineError(f"from_config: the inventory must be a dict, not {type(config).__name__}")
        if not _has_group(config, "layerline"):
            raise LayerlineError("from_config: the inventory has no group 'layerline'; put the workers under "
                                 "{'layerline': {'hosts': {...}}}")
        tmp = data_dir is None
        data = Path(tempfile.mkdtemp(prefix="layerline-cluster-")) if tmp else Path(data_dir).expanduser().resolve()
        inv = copy.deepcopy(config)
        all_group = inv.setdefault("all", {}) or {}
        inv["all"] = all_group
        avars = all_group.setdefault("vars", {}) or {}
        all_group["vars"] = avars
        given = {**(extravars or {})}
        if not _has_key(config, "layerline_home") and "layerline_home" not in given:
            avars["layerline_home"] = str(data / "home")
        if not _has_key(config, "layerline_checkpoint") and "layerline_checkpoint" not in given:
            demo = any(k == "layerline_demo_checkpoint" and str(v).lower() in ("true", "yes", "1")
                       for k, v in list(_walk(config)) + list(given.items()))
            if not demo:
                if tmp:
                    shutil.rmtree(data, ignore_errors=True)
                raise LayerlineError("from_config: set layerline_checkpoint (a Hugging Face model dir) in the "
                                     "inventory's vars, or layerline_demo_checkpoint: true for the demo model")
            avars["layerline_checkpoint"] = "{{ layerline_home }}/demo-llama"
        (data / "inventory").mkdir(parents=True, exist_ok=True)
        path = data / "inventory" / "hosts.yml"
        import yaml  # ansible-core's dependency
        path.write_text("# written by layerline.Cluster.from_config\n" + yaml.safe_dump(inv, sort_keys=False))
        c = cls(path, extravars=extravars, project_dir=project_dir, quiet=quiet, data_dir=data, **kw)
        if tmp:
            c._finalizer = weakref.finalize(c, shutil.rmtree, str(data), True)
        return c

    def close(self) -> None:
        """Remove the private data dir when the Cluster made it (workers keep running)."""
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        planned = f", {len(self.active_nodes())} active stages" if self._plan else ""
        return f"Cluster({str(self.inventory)!r}{planned})"

    def cancel(self) -> None:
        """Stop the playbook run in progress (from another thread); it raises ClusterError."""
        self._cancel.set()

    # -- running playbooks ----------------------------------------------------------------------

    def _inventories(self) -> list[str]:
        out = [str(self.inventory)]
        if self.discovered:
            import yaml
            path = self.data_dir / "discovered.yml"
            path.write_text("# hosts layerline.Cluster.discover() added\n" + yaml.safe_dump(
                {"layerline": {"hosts": self.discovered}}, sort_keys=False))
            out.append(str(path))
        return out

    def _env(self) -> dict[str, str]:
        p = self.project_dir
        bindir = str(Path(sys.executable).parent)
        path = os.environ.get("PATH", "")
        if not (Path(bindir) / "ansible-playbook").exists():
            bindir = ""
        if not bindir and not shutil.which("ansible-playbook", path=path):
            raise LayerlineError("ansible-playbook: not found next to this Python nor on PATH; install "
                                 "ansible-core into this environment (pip install ansible-core)")

        def join(var: str, value: str) -> str:
            return os.pathsep.join([value] + ([os.environ[var]] if os.environ.get(var) else []))

        env = {
            "ANSIBLE_CONFIG": str(p / "ansible.cfg"),
            "ANSIBLE_LIBRARY": join("ANSIBLE_LIBRARY", str(p / "modules" / "library")),
            "ANSIBLE_FILTER_PLUGINS": join("ANSIBLE_FILTER_PLUGINS", str(p / "modules" / "filter_plugins")),
            "ANSIBLE_ROLES_PATH": join("ANSIBLE_ROLES_PATH", str(p / "roles")),
            # ansible-runner turns host key checking off unless told; layerline keeps it on outside tests
            "ANSIBLE_HOST_KEY_CHECKING": os.environ.get("ANSIBLE_HOST_KEY_CHECKING", "True"),
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
            "PYTHONUNBUFFERED": "1",
            "PATH": os.pathsep.join(filter(None, [bindir, path])),
        }
        if (p / "modules" / "module_utils").is_dir():
            env["ANSIBLE_MODULE_UTILS"] = join("ANSIBLE_MODULE_UTILS", str(p / "modules" / "module_utils"))
        env.update({k: str(v) for k, v in self.envvars.items()})
        return env

    def _wrapper(self, name: str, plays: list[str | dict]) -> Path:
        """A playbook in the data dir that imports the repo's plays by absolute path."""
        import yaml
        book = []
        for p in plays:
            if isinstance(p, str):
                path = self.project_dir / "playbooks" / f"{p}.yml"
                if not path.is_file():
                    raise LayerlineError(f"{path}: missing from the checkout; is project_dir a layerline checkout?")
                book.append({"name": p.capitalize(), "ansible.builtin.import_playbook": str(path)})
            else:
                book.append(p)
        d = self.data_dir / "plays"
        d.mkdir(exist_ok=True)
        out = d / f"{name}.yml"
        out.write_text(yaml.safe_dump(book, sort_keys=False, width=1000))
        return out

    def _run(self, step: str, plays: list[str | dict], extravars: dict | None = None,
             tolerate: Callable[[HostFailure], bool] | None = None) -> _Run:
        """Run the plays as one ansible-playbook; raise ClusterError on a failure not tolerated."""
        import ansible_runner

        self._runs += 1
        ident = f"{self._runs:03d}-{step}"
        book = self._wrapper(step, plays)
        stream = None if self.quiet else (self.stream or sys.stderr)
        run = _Run(step, stream, str(book))
        self._cancel.clear()
        interrupted = []
        old = None
        if threading.current_thread() is threading.main_thread():
            def on_sigint(_sig, _frame):
                interrupted.append(True)
                self._cancel.set()
            old = signal.signal(signal.SIGINT, on_sigint)
        try:
            r = ansible_runner.run(
                private_data_dir=str(self.data_dir), project_dir=str(self.project_dir), playbook=str(book),
                inventory=self._inventories(), extravars={**self.extravars, **(extravars or {})},
                envvars=self._env(), ident=ident, rotate_artifacts=self.keep_artifacts, quiet=True,
                suppress_env_files=True, event_handler=run.handler, cancel_callback=self._cancel.is_set)
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)
        if interrupted:
            raise KeyboardInterrupt
        if r.status == "canceled":
            raise ClusterError(f"{step}: canceled", step=step)
        if r.status == "timeout":
            raise ClusterError(f"{step}: timed out", step=step)
        fatal = [f for f in run.failures if not (tolerate and tolerate(f))]
        if fatal:
            f = fatal[0]
            more = f" (and {len(fatal) - 1} more failure(s))" if len(fatal) > 1 else ""
            raise ClusterError(f"{f.host}: task '{f.task}' failed: {f.msg}{more}", host=f.host, task=f.task,
                               msg=f.msg, step=step)
        if r.rc != 0 and not run.failures:
            raise ClusterError(f"{step}: ansible-playbook exited {r.rc}: {self._stdout_error(r)}", step=step)
        return run

    @staticmethod
    def _stdout_error(r) -> str:
        """The error ansible-playbook printed when it stopped before any task (syntax, inventory)."""
        try:
            text = r.stdout.read()
        except (OSError, ValueError, AttributeError):
            return "see the artifacts in the data dir"
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        for i, ln in enumerate(lines):
            if ln.startswith(("ERROR", "[ERROR]")):
                rest = " ".join(lines[i:i + 2])
                return rest[:400]
        return lines[-1][:400] if lines else "no output"

    def _tolerate_probe(self, f: HostFailure) -> bool:
        """One host that cannot be reached or probed is left out, never fatal (a reference-design fault)."""
        return f.tag in ("probe", "runtime", "layerline_runtime")  # unreachable shows first in the runtime role

    def _note_probe_failures(self, run: _Run) -> None:
        for f in run.failures:
            if self._tolerate_probe(f):
                self.probe_failures[f.host] = f.msg
                if not self.quiet:
                    print(f"[probe] {f.host} left out: {f.msg}", file=self.stream or sys.stderr, flush=True)

    # -- the report play: what each host's variables came to, and its worker argv ---------------

    @staticmethod
    def _report_play() -> dict:
        """Each host's settings and worker argv, as layerline.spec.host_report gives them."""
        return {
            "name": "Report to layerline.Cluster",
            "hosts": "layerline",
            "gather_facts": False,
            "tasks": [{
                "name": "Report this host's settings and worker argv",
                "ansible.builtin.set_fact": {"layerline_cluster_report": (
                    "{{ hostvars[inventory_hostname] | layerline_host_report(inventory_hostname, "
                    "layerline_plan | default(none)) }}")},
            }],
        }

    @staticmethod
    def _caps_play() -> dict:
        """Plan from the caps this Cluster probed (the reference's semantics: probe, then plan)."""
        return {
            "name": "Use the caps layerline.Cluster probed",
            "hosts": "layerline",
            "gather_facts": False,
            "tasks": [
                {"name": "Stop for a host this Cluster has not probed",
                 "ansible.builtin.fail": {"msg": "{{ inventory_hostname }}: not probed by this Cluster (the inventory "
                                                 "changed?); call probe() again"},
                 "when": "inventory_hostname not in layerline_cluster_caps"},
                {"name": "Use the probed caps",
                 "ansible.builtin.set_fact": {"layerline_caps": "{{ layerline_cluster_caps[inventory_hostname] }}"}},
            ],
        }

    @staticmethod
    def _saved_plan_play() -> dict:
        path = "(layerline_home | layerline_home_paths).plan"
        return {
            "name": "Read the saved plan",
            "hosts": "layerline",
            "gather_facts": False,
            "tasks": [
                {"name": "Read plan.json",
                 "ansible.builtin.set_fact": {
                     "layerline_cluster_saved": "{{ layerline_home | layerline_saved_plan(required=false) }}"},
                 "run_once": True},
                {"name": "Stop when there is no saved plan",
                 "ansible.builtin.fail": {"msg": f"no saved plan at {{{{ {path} }}}}; call plan() (or run "
                                                 "deploy.yml) first"},
                 "when": "not layerline_cluster_saved", "run_once": True},
                {"name": "Use the saved plan",
                 "ansible.builtin.set_fact": {"layerline_plan": "{{ layerline_cluster_saved }}"},
                 "run_once": True},
            ],
        }

    def _absorb(self, run: _Run) -> None:
        caps = run.facts("layerline_caps")
        self._caps.update(caps)
        for h in caps:
            self.probe_failures.pop(h, None)
        idx = run.facts("layerline_index")
        if idx:
            self._index = next(iter(idx.values()))
        plans = run.facts("layerline_plan")
        if plans:
            self._plan = next(iter(plans.values()))
        rep = run.facts("layerline_cluster_report")
        if rep:
            self._report = rep

    # -- the API --------------------------------------------------------------------------------

    def discover(self) -> tuple[int, list[tuple[str, str]]]:
        """Find machines from layerline_discover and add them to group layerline for later steps.

        Returns (added, failures): how many hosts were added, and (address, reason) for each
        candidate that did not answer; a host that fails is reported, never fatal. Idempotent:
        hosts the inventory (or an earlier discover) already has are left alone.
        """
        run = self._run("discover", ["discover"])
        return self._absorb_discover(run)

    def _absorb_discover(self, run: _Run) -> tuple[int, list[tuple[str, str]]]:
        added = 0
        for _h, res in run.by_action("add_host"):
            for item in res.get("results") or [res]:
                spec = item.get("add_host") if isinstance(item, dict) else None
                if spec and spec.get("host_name") and spec["host_name"] not in self.discovered:
                    self.discovered[spec["host_name"]] = dict(spec.get("host_vars") or {})
                    added += 1
        failures: list[tuple[str, str]] = []
        for _h, res in run.by_action("layerline_discover"):
            failures = [(f["addr"], f["reason"]) for f in res.get("failures") or []]
        self.discover_failures = failures
        return added, failures

    def probe(self) -> dict[str, CapsJSON]:
        """Measure every host (cached in its state dir); {host: NodeCaps}. A host that fails is left out."""
        run = self._run("probe", list(_PROBE_PLAYS), tolerate=self._tolerate_probe)
        self._note_probe_failures(run)
        caps = run.facts("layerline_caps")
        if not caps:
            reasons = "; ".join(f"{h}: {m}" for h, m in self.probe_failures.items()) or "no host answered"
            raise ClusterError(f"probe: no host could be probed ({reasons})", step="probe")
        self._caps.update(caps)
        for h in caps:
            self.probe_failures.pop(h, None)
        return dict(caps)

    @property
    def caps(self) -> dict[str, CapsJSON]:
        """The last probe's NodeCaps by host."""
        return dict(self._caps)

    def plan(self, saved: bool = False, discover: bool = False) -> dict:
        """Checkpoint index + probe + plan in one run; the plan dict (also kept in layerline_home/plan.json).

        After probe() it plans from the caps that probe measured (call probe() again when the
        hardware may have changed); otherwise it probes in the same run.

        saved=True reads the plan an earlier run kept (layerline_home/plan.json) instead of planning.
        discover=True runs playbooks/discover.yml first in the same run (a no-op without
        layerline_discover); autoplan() is plan(discover=True).
        """
        if saved:
            run = self._run("plan", [self._saved_plan_play(), self._report_play()])
        elif self._caps and not self.probe_failures and not discover:
            run = self._run("plan", ["checkpoint", self._caps_play(), "plan", self._report_play()],
                            extravars={"layerline_cluster_caps": self._caps})
        else:
            plays = (["discover"] if discover else []) + [*_PLAN_PLAYS, self._report_play()]
            run = self._run("plan", plays, tolerate=self._tolerate_probe)
            self._note_probe_failures(run)
            if discover:
                self._absorb_discover(run)
        self._absorb(run)
        if not run.facts("layerline_plan"):
            raise ClusterError("plan: the run made no plan (no host left to plan for?)", step="plan")
        return copy.deepcopy(self._plan)

    def autoplan(self) -> dict:
        """Discover (when the inventory has layerline_discover) + probe + plan, in one run.

        Hosts discovery adds are kept for every later step (launch, drive, teardown).
        """
        return self.plan(discover=True)

    def _need_plan(self) -> dict:
        if self._plan is None:
            raise LayerlineError("no plan yet: call plan() (or autoplan(), or plan(saved=True) to read the "
                                 "plan a deploy kept) first")
        return self._plan

    @property
    def last_plan(self) -> dict | None:
        return copy.deepcopy(self._plan)

    def plan_table(self) -> str:
        """The plan as a table: what each machine holds, its disk speed and predicted time per token."""
        from .planner import Plan, plan_table
        return plan_table(Plan.from_dict(self._need_plan()))

    def active_nodes(self) -> list[str]:
        """Host names with role active in the plan, in pipeline order."""
        return [s["host"] for s in self._need_plan()["stages"] if s["role"] == "active"]

    def stage(self, i: int | str) -> dict:
        """A plan stage by index into the plan's stages, or by host name."""
        plan = self._need_plan()
        if isinstance(i, bool) or not isinstance(i, (int, str)):
            raise LayerlineError(f"stage {i!r}: give a stage index or a host name")
        if isinstance(i, int):
            if not -len(plan["stages"]) <= i < len(plan["stages"]):
                raise LayerlineError(f"stage {i}: the plan has {len(plan['stages'])} stages")
            return plan["stages"][i]
        s = next((s for s in plan["stages"] if s["host"] == i), None)
        if s is None:
            raise LayerlineError(f"{i}: not in the plan (planned: {', '.join(x['host'] for x in plan['stages'])})")
        return s

    def worker_argv(self, i: int | str) -> list[str]:
        """The worker command line of a plan stage (index) or host (name), as launch starts it."""
        host = self.stage(i)["host"]
        argv = (self._report.get(host) or {}).get("argv")
        if not argv:
            raise LayerlineError(f"{host}: no worker argv reported; run plan() again")
        return list(argv)

    def kv_profile(self):
        """The KV profile (layerline.cost.KvProfile) the last plan used."""
        from .cost import KvProfile
        kv = self._need_plan()["kv"]
        return KvProfile(context=int(kv["context"]), dtype=str(kv["dtype"]),
                         bytes_per_token=int(kv["bytes_per_token"]), source=str(kv.get("source", "index")))

    def launch(self) -> dict[str, str]:
        """Start one worker per planned host (restarted only when its argv changed); {host: what happened}.

        Uses the last plan when there is one (the one plan_table() shows), else plans first in the
        same run.
        """
        if self._plan is None:
            plays = ["checkpoint", "runtime", "keys", "probe", "plan", "stage", "launch", self._report_play()]
            run = self._run("launch", plays, tolerate=self._tolerate_probe)
            self._note_probe_failures(run)
        else:
            plays = ([] if self._caps else ["runtime"]) + [*_LAUNCH_PLAYS, self._report_play()]
            run = self._run("launch", plays, extravars={"layerline_plan": self._plan})
        self._absorb(run)
        return {h: str(res.get("msg", "")) for h, res in run.by_action("layerline_worker")
                if not res.get("skipped")}

    def serve(self) -> str:
        """Start (or keep) the OpenAI-compatible server in front of the launched workers, as
        deploy.yml does (playbooks/serve.yml); returns its endpoint, e.g. http://127.0.0.1:8000/v1."""
        run = self._run("serve", ["serve"], extravars={"layerline_plan": self._need_plan()})
        urls = run.facts("layerline_server_endpoint")
        if not urls:
            raise ClusterError("serve: the run reported no server endpoint", step="serve")
        self._endpoint = str(next(iter(urls.values())))
        return self._endpoint

    # -- operations under load: the server keeps answering through each of these --------------

    def drain(self, hosts) -> dict:
        """Take hosts out of the serving pipeline, one at a time (drain.yml each): the rest are
        re-planned, started beside the old workers, the server switches to them at a step boundary
        and the old ones stop. A drained host stays out of later plans until rejoin(). Returns the
        new plan. Raises ClusterError, with everything as it was, when a drain fails."""
        names = [hosts] if isinstance(hosts, str) else list(hosts)
        if not names or not all(isinstance(h, str) and h for h in names):
            raise LayerlineError(f"drain: hosts {hosts!r} must be a host name or a list of them")
        for h in names:
            self._absorb(self._run(f"drain-{h}", ["drain"], extravars={"layerline_drain": h}))
        return self._need_plan()

    def retire(self, host: str) -> dict:
        """The reference design's retire: mark the host draining and move its layers off it (a
        standby for it serves in its place) while requests keep flowing. Returns the new plan."""
        return self.drain([host])

    def rejoin(self, host: str) -> dict:
        """Bring a drained host back: re-plan with it and switch the server over (no restart, no
        failed request), as `deploy.yml -e layerline_rejoin=HOST`. Returns the new plan."""
        if not isinstance(host, str) or not host:
            raise LayerlineError(f"rejoin: host {host!r} must be a host name")
        plays = ["checkpoint", "runtime", "probe", "plan", *_LAUNCH_PLAYS, "serve"]
        self._absorb(self._run(f"rejoin-{host}", plays, extravars={"layerline_rejoin": host}))
        return self._need_plan()

    @property
    def endpoint(self) -> str | None:
        """The server's base URL for OpenAI clients (after serve()), or None."""
        return getattr(self, "_endpoint", None)

    def drive(self, inputs=None, generate: int = 0, timeout_s: float = 120.0, warm: bool = True):
        """One drive through the planned stages (straight from Python, no Ansible): the same
        `layerline.driver.drive` the drive play runs, with the same result and report.

        inputs: token ids, a [tokens] or [batch, tokens] integer tensor or a list of ints; None
        draws layerline_seq ids with layerline_rng_seed (as the drive play does). generate: also
        generate this many tokens greedily for each row (each stage keeps its KV cache).
        Returns a layerline.driver.DriveResult: .stages [{stage, layers, s}], .wall_s, .hop_s,
        .logits, .generate, .to_dict() (drive.json's shape); `drive_report(result)` prints it.
        """
        from .driver import DriveOptions, drive, pipeline_for_plan

        plan = self._need_plan()
        first = next(s for s in plan["stages"] if s["role"] == "active")
        hs = self._settings(first["host"])
        ids = self._inputs(inputs, hs)
        # as playbooks/drive.yml: CURVE (auto: off loopback) with the controller's keys from the keys role
        with pipeline_for_plan(plan, keys_dir=hs.controller_home.keys_controller,
                               reply_host=hs.driver_addr, curve=hs.curve, timeout_s=timeout_s) as pipe:
            return drive(pipe, ids.tolist(), DriveOptions(generate=int(generate), warm=warm,
                                                          precision=plan["precision"]))

    def _settings(self, host: str):
        """A host's HostSettings as the last report play read them (defaults: layerline.settings)."""
        from .settings import HostSettings
        return HostSettings.from_vars(host, (self._report.get(host) or {}).get("vars"))

    def _inputs(self, inputs, hs):
        import torch
        vocab = self._vocab(hs)
        if inputs is None:
            seq = hs.seq
            g = torch.Generator().manual_seed(hs.rng_seed)
            if not vocab:
                raise LayerlineError("drive: the model's vocab size is unknown (no config.json on this machine); "
                                     "pass inputs= token ids")
            return torch.randint(0, vocab, (1, seq), generator=g)
        if isinstance(inputs, torch.Tensor):
            ids = inputs
        else:
            try:
                ids = torch.tensor(list(inputs))
            except (TypeError, ValueError, RuntimeError):
                raise LayerlineError("drive: inputs must be token ids (a list of ints or an integer tensor)") from None
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.numel() == 0:
            raise LayerlineError(f"drive: inputs have shape {list(ids.shape)}; give [tokens] or [batch, tokens]")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise LayerlineError(f"drive: inputs are {ids.dtype}; give integer token ids")
        ids = ids.to(torch.int64)
        if vocab and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise LayerlineError(f"drive: token ids must be in 0..{vocab - 1} (the model's vocab)")
        return ids

    def _vocab(self, hs) -> int | None:
        if self._index and (self._index.get("cost") or {}).get("vocab_size"):
            return int(self._index["cost"]["vocab_size"])
        ckpt = hs.checkpoint
        try:
            from .checkpoint import open_checkpoint
            return int(open_checkpoint(ckpt).config["vocab_size"]) if ckpt else None
        except (OSError, ValueError, KeyError, TypeError, LayerlineError):
            return None

    def teardown(self) -> dict[str, str]:
        """Stop every worker of the inventory (and of discovered hosts); {host: what happened}."""
        run = self._run("teardown", ["teardown"])
        return {h: str(res.get("msg", "")) for h, res in run.by_action("layerline_worker")}
