"""Launch specs: how each process of a deployment is started, built from the plan and HostSettings.

The worker's argv, state dir, ready file, keys dir and ready wait (WorkerSpec), the server's
(ServerSpec: argv, state dir, URL, key files, the curl line it prints) and the controller's drive
and stage commands are decided here and nowhere else: the Ansible filters
(`layerline_worker_spec`, `layerline_server_spec`, `layerline_drive_argv`, `layerline_stage_argv`),
the local pipelines of `layerline generate --local-stages` and the Python API all build them here.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
from dataclasses import asdict, dataclass, field

from . import version
from .endpoints import LOOPBACK, endpoint_host, is_loopback, is_wildcard
from .errors import LayerlineError
from .keys import secret_file
from .planner import Plan, StagePlan
from .version import INSTALLED, source_root
from .settings import COMPILE_READY_TIMEOUT_S, READY_TIMEOUT_S, HostSettings, stage_name  # noqa: F401 - re-exported

SettingsLike = HostSettings | dict


@dataclass(frozen=True)
class WorkerSpec:
    host: str
    argv: tuple[str, ...]
    python: str               # the interpreter (argv[0]) and the supervisor's
    state_dir: str
    ready_file: str
    keys_dir: str
    ready_timeout: float
    endpoint: str
    # what the launch keeps of the step the worker times at warm-up (the layerline_probe module's
    # record_step, less measured_s): the next plan's factor for this device, precision and compile
    step: dict = field(default_factory=dict)

    @property
    def inputs(self) -> list[str]:
        """What the worker reads when it starts besides its argv: its keys dir (its allow-list). The
        layerline_worker module restarts a worker whose inputs changed since it started (the supervisor's
        --watch digest): a change of keys, a host gone from the inventory, reaches exactly those workers."""
        return [self.keys_dir]

    def to_dict(self) -> dict:
        return asdict(self) | {"argv": list(self.argv), "inputs": self.inputs}


def planned_worker(plan: Plan, host: str, hvars: SettingsLike, python: str | None = None) -> dict:
    """What the worker role reads: {"planned": False} for a host the plan holds no stage on (its worker
    is stopped), else the host's WorkerSpec as a dict with "planned": True."""
    if plan.stage(host) is None:
        return {"planned": False}
    return worker_spec(plan, host, hvars, python).to_dict() | {"planned": True}


def ships_stage(plan: Plan, host: str, hvars: SettingsLike) -> bool:
    """Whether staging ships this host its own tensors: it runs a stage of the plan and does not share
    the controller's checkpoint path (its worker then opens stage_dir's staged checkpoint)."""
    return not HostSettings.of(host, hvars).checkpoint_shared and plan.stage(host) is not None


def stage_dir(plan: Plan, host: str, hvars: SettingsLike) -> str:
    """The dir on the host that holds its stage of the plan (HostSettings.stage_dir_for: one per layer range
    under its stage root), where playbooks/tasks/stage.yml ships it and its worker opens it."""
    s = plan.stage(host)
    if s is None:
        raise LayerlineError(f"{host}: not in the plan; nothing to stage")
    return HostSettings.of(host, hvars).stage_dir_for(s.layers, plan.num_layers)


def stages_kept(plan: Plan | None, host: str, hvars: SettingsLike) -> dict:
    """What the host's stage root keeps once `plan` is the one that runs (a deploy's served plan, a drain's
    committed one): {"root", "keep": the stage dir names its workers open, "sweep": whether to remove the
    rest}. Only an unshared checkpoint stages, so only then is the root swept; until a change commits, the
    stages of the plan that runs stay where they are (a drain stages the new layers beside them)."""
    hs = HostSettings.of(host, hvars)
    s = plan.stage(host) if plan is not None else None
    keep = [stage_name(s.layers, plan.num_layers)] if s is not None else []
    return {"root": hs.stage_root, "keep": keep, "sweep": not hs.checkpoint_shared}


def worker_spec(plan: Plan, host: str, hvars: SettingsLike, python: str | None = None) -> WorkerSpec:
    """This host's worker launch, from its stage of the plan (looked up by host name). python: the
    interpreter, where the caller knows better than the host's settings (local stages: this one)."""
    hs = HostSettings.of(host, hvars)
    python = python or hs.worker_interpreter
    s = plan.stage(host)
    if s is None:
        raise LayerlineError(f"{host}: not in the plan (role {hs.role}); only planned hosts start workers")
    # a staged checkpoint holds only this stage's tensors (playbooks/tasks/stage.yml), in a dir of its layers
    ckpt = hs.worker_checkpoint(s.layers, plan.num_layers)
    if not s.endpoint:
        raise LayerlineError(f"{host}: the plan has no endpoint for this stage; re-plan")
    state = hs.state_dir_in()
    port = int(s.endpoint.rsplit(":", 1)[1])
    ready = os.path.join(state, "ready.json")
    keys = hs.worker_keys_dir
    argv = [python, "-m", "layerline.worker",
            "--checkpoint", ckpt,
            "--layers", f"{s.layers[0]}:{s.layers[1]}",
            "--device", s.device,
            "--precision", s.precision,
            "--kv-context", str(plan.kv.context),
            "--kv-dtype", str(s.kv_dtype or plan.kv.dtype),
            "--rng-seed", str(hs.rng_seed),
            "--bind", f"tcp://{hs.bind_host}:{port}",
            "--name", host,
            "--ready-file", ready,
            "--keys", keys,
            # the controller's code (package version + content hash): a worker restarts when it changes
            # (its argv does) and refuses to run on a host that kept other code (layerline.version)
            "--layerline-version", version.full()]
    if s.kv_bytes:  # what the plan reserved for this stage's KV caches
        argv += ["--kv-bytes", str(int(s.kv_bytes))]
    if s.experts_paged:
        argv += ["--expert-cache-bytes", str(int(s.expert_cache_bytes))]
    nxt = plan.next_of(s)
    if nxt is not None:
        # whose public key the next hop must hold under CURVE: its host name in KEYS/peers/
        argv += ["--next", str(nxt.endpoint), "--next-key", nxt.host]
    if hs.curve == "on":
        argv += ["--curve", "on"]
    if s.layers[0] == 0:
        argv.append("--first")
    if s.layers[1] == plan.num_layers:
        argv.append("--last")
    if s.threads:
        argv += ["--threads", str(int(s.threads))]
    if s.spin is not None:
        argv += ["--spin", str(int(s.spin))]
    if s.shares_cores_with:
        argv += shared_cores_argv(plan, s)
    if hs.nice:
        argv += ["--nice", str(hs.nice)]
    if s.compile != "off":
        argv += ["--compile", s.compile, "--compile-cache", hs.worker_compile_cache]
    return WorkerSpec(host=host, argv=tuple(argv), python=python, state_dir=state, ready_file=ready, keys_dir=keys,
                      ready_timeout=hs.ready_timeout(s.compile != "off"), endpoint=str(s.endpoint),
                      step={"device": s.device.split("+")[0], "precision": s.precision, "compile": s.compile,
                            "predicted_s": s.predicted_s, "factor": s.step_factor})


def shared_cores_argv(plan: Plan, s: StagePlan) -> list[str]:
    """The worker flags of a stage that shares its machine's cores with other stages of `plan`."""
    # no idle-priority spinners (layerline.awake) where another stage needs these cores: each
    # worker is its own scheduling group (its own session), and across groups idle priority is
    # not idle: the spinners would take turns with the busy stage. And each times its step alone,
    # not while another loads, compiles or times (timing_lock)
    argv = ["--awake-ms", "0", "--time-alone", timing_lock_name(plan)]
    if s.cores:   # each message on its share of the cores (planner.message_threads)
        argv += ["--cores", str(int(s.cores)), "--sharing", str(int(s.shares_cores_with) + 1)]
    return argv


def timing_lock_name(plan: Plan) -> str:
    """The lock (a file in each machine's timing_lock.LOCK_DIR) the plan's co-located stages time
    their steps under: one per deployment, named by its stages' endpoints, so the workers of two
    deployments (or two tests) on one machine never wait on each other's."""
    key = ",".join(sorted(str(s.endpoint) for s in plan.stages))
    return f"layerline-timing-{hashlib.sha256(key.encode()).hexdigest()[:16]}.lock"


def stage_checkpoint_argv(plan: Plan, host: str, hvars: SettingsLike, python: str = "python3") -> list[str]:
    """The controller's command that cuts this host's tensors out of the checkpoint."""
    hs = HostSettings.of(host, hvars)
    s = plan.stage(host)
    if s is None:
        raise LayerlineError(f"{host}: not in the plan; nothing to stage")
    argv = [python, "-m", "layerline.cli", "stage-checkpoint", hs.checkpoint_path,
            "--layers", f"{s.layers[0]}:{s.layers[1]}", "--out", hs.controller_home.stages(host),
            "--json"]
    argv += ["--first"] if s.layers[0] == 0 else []
    argv += ["--last"] if s.layers[1] == plan.num_layers else []
    return argv


def demo_checkpoint_argv(hvars: SettingsLike, python: str = "python3", host: str = "controller") -> list[str]:
    """The controller's command that writes the demo checkpoint at layerline_checkpoint (a .gguf: the
    packaged SmolLM2; a dir: the random-init demo model); it is whole once demo_checkpoint_stamp exists."""
    return [python, "-m", "layerline.cli", "demo-checkpoint", HostSettings.of(host, hvars).checkpoint_path]


def index_argv(hvars: SettingsLike, python: str = "python3", host: str = "controller") -> list[str]:
    """The controller's command that prints the checkpoint's tensor index and ModelCost as JSON (headers only);
    with layerline_demo_checkpoint, a checkpoint not written yet (check mode) indexes the demo it would be."""
    hs = HostSettings.of(host, hvars)
    return [python, "-m", "layerline.cli", "index", hs.checkpoint_path, "--json",
            *(["--demo-if-missing"] if hs.demo_checkpoint else [])]


@dataclass(frozen=True)
class KeysSpec:
    """The keys role's commands and files for one host (layerline.keys: make on the controller, place on the
    host with its keypair from the controller's store on stdin)."""
    make_argv: tuple[str, ...]   # on the controller: every missing keypair and the controller's keys dir
    keys_dir: str                # the host's keys dir (the worker's --keys)
    secret_src: str              # on the controller: the host's keypair in the store (0600), place's stdin

    def to_dict(self) -> dict:
        return asdict(self) | {"make_argv": list(self.make_argv)}


def keys_spec(host: str, hvars: SettingsLike, hosts: list[str], python: str = "python3") -> KeysSpec:
    """The keys role's spec for `host`: keypairs for `hosts` (names checked by `layerline.keys make`) made by
    the controller's `python`."""
    hs = HostSettings.of(host, hvars)
    home = hs.controller_home
    return KeysSpec(make_argv=(python, "-m", "layerline.keys", "make", "--store", home.keys_store,
                               "--controller-dir", home.keys_controller, "--", *[str(h) for h in hosts]),
                    keys_dir=hs.worker_keys_dir, secret_src=secret_file(home.keys_store, host))


def keys_place_argv(host: str, hvars: SettingsLike, public: dict) -> list[str]:
    """The host's command (under its runtime interpreter) that lays out its keys dir: the public keys in its
    argv, its own keypair (KeysSpec.secret_src's text) on its stdin."""
    hs = HostSettings.of(host, hvars)
    if not isinstance(public, dict) or host not in public:
        raise LayerlineError(f"{host}: the keys made on the controller hold no public key for it (is it in "
                             "layerline_keys_hosts?); re-run playbooks/keys.yml")
    return [hs.runtime_interpreter, "-m", "layerline.keys", "place", "--dest", hs.worker_keys_dir, "--name", host,
            "--public", json.dumps(public, sort_keys=True), "--secret-stdin"]


# what the runtime role asks a host's interpreter, which may not have layerline yet (plain Python only)
VERSION_CODE = "from layerline import version; print(version.full())"   # fails on a layerline too old to say
MISSING_CODE = ("import importlib.util, json, sys; need = json.loads(sys.argv[1]); "
                "print(json.dumps([d for d, m in need.items() if importlib.util.find_spec(m) is None]))")


@dataclass(frozen=True)
class RuntimeSpec:
    """The runtime role's commands for one host: its interpreter (HostSettings.runtime_interpreter), what
    asks it for its layerline version and for the dependencies it lacks, and the controller's wheel build."""
    python: str
    version_argv: tuple[str, ...]    # prints the host's layerline version (fails without layerline)
    missing_argv: tuple[str, ...]    # prints the distributions of `dependencies` it lacks, as a JSON list
    build_argv: tuple[str, ...]      # on the controller: prints {"wheel": PATH, "version": V}

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def runtime_source(source: str = "") -> str:
    """What the runtime role builds the wheel from: the source given, else the checkout the controller's layerline
    runs from (layerline.version.source_root), else "installed": build_wheel.py repacks the installed
    distribution (a controller that pip-installed layerline and runs the collection's roles)."""
    return source or source_root() or INSTALLED


def runtime_spec(host: str, hvars: SettingsLike, dependencies: dict, controller_python: str, role_path: str,
                 source: str, wheel_dir: str) -> RuntimeSpec:
    """The runtime role's spec: dependencies maps distribution to import name; the wheel is built from
    source (runtime_source) into wheel_dir by the role's files/build_wheel.py under the controller's interpreter."""
    source = runtime_source(source)
    python = HostSettings.of(host, hvars).runtime_interpreter
    return RuntimeSpec(python=python, version_argv=(python, "-c", VERSION_CODE),
                       missing_argv=(python, "-c", MISSING_CODE, json.dumps(dict(dependencies), sort_keys=True)),
                       build_argv=(controller_python, os.path.join(role_path, "files", "build_wheel.py"), source,
                                   wheel_dir))


def runtime_install_argv(host: str, hvars: SettingsLike, wheel: str) -> list[str]:
    """The host's pip install of the controller's wheel: no dependencies, no index, over any other version."""
    return [HostSettings.of(host, hvars).runtime_interpreter, "-m", "pip", "install", "--no-deps", "--no-index",
            "--force-reinstall", "--disable-pip-version-check", "-q", wheel]


def drive_argv(plan: Plan, hvars: SettingsLike, python: str = "python3", host: str = "controller") -> list[str]:
    """The controller's `layerline drive` command line for a plan and the play's variables."""
    hs = HostSettings.of(host, hvars)
    if not plan.actives:
        raise LayerlineError("plan: no active stage to drive; run playbooks/plan.yml first")
    first, last = plan.actives[0], plan.actives[-1]
    reply = hs.driver_addr or LOOPBACK
    if is_loopback(reply) and not is_loopback(endpoint_host(str(last.endpoint))):
        raise LayerlineError(f"layerline_driver_addr: results go to {reply}, but the last stage ({last.host}) is "
                             "not on this machine; set it to an address of the controller that host can reach")
    argv = [python, "-m", "layerline.cli", "drive", "--first", str(first.endpoint),
            "--checkpoint", hs.checkpoint_path, "--precision", plan.precision,
            "--seq", str(hs.seq), "--seed", str(hs.rng_seed), "--generate", str(hs.generate),
            "--reply-host", reply, "--keys", hs.controller_home.keys_controller,
            "--first-key", first.host, "--curve", hs.curve, "--json"]
    # the reference runs the whole model on the controller, one stage in memory at a time
    if hs.drive_reference:  # stage by stage, each at the precision its worker runs
        argv.append("--reference")
        for st in plan.actives:
            argv += ["--stage", f"{st.layers[0]}:{st.layers[1]}:{st.precision}"]
    ids = hs.prompt_ids
    if ids:  # one prompt [1, 2, 3] or several [[1, 2], [3, 4]]
        for p in (ids if isinstance(ids[0], list) else [ids]):
            argv += ["--input-ids", ",".join(str(int(t)) for t in p)]
    texts = hs.prompt
    for t in ([texts] if isinstance(texts, str) else texts or []):  # chat turns: the template applies
        if str(t):
            argv += ["--chat", str(t)]
    if hs.sequences:
        argv += ["--sequences", str(hs.sequences)]
    sampling = hs.sampling
    for key, flag in (("temperature", "--temperature"), ("top_p", "--top-p")):
        if key in sampling:
            argv += [flag, str(float(sampling[key]))]
    if sampling.get("ignore_eos"):
        argv.append("--ignore-eos")
    return argv


def _num(x: float) -> str:
    """A number as a flag value: 30, not 30.0, so argv stays what earlier runs recorded."""
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class ServerSpec:
    """The serving process: its argv, where it keeps its files, and how the playbooks and users reach it."""
    argv: tuple[str, ...]
    python: str
    state_dir: str
    ready_timeout: float
    bind: str
    port: int
    url: str                  # where the playbooks reach it (loopback when it listens on every address)
    keyed: bool               # API keys required (off loopback, or layerline_serve_api_keys)
    ca_path: str | None       # with HTTPS: the CA file the playbooks check the server's certificate with
    api_keys_file: str
    admin_key_file: str
    request: dict             # an example request (kept in request.json; the curl line sends it)
    request_path: str
    curl: str                 # one shell line that sends it

    @property
    def endpoint(self) -> str:
        return f"{self.url}/v1"

    @property
    def banner(self) -> str:
        """What the deploy prints: the endpoint, then the curl line on a line of its own (a multi-line
        message is printed verbatim by Ansible's YAML output, so the line pastes as printed)."""
        return f"serving at {self.endpoint} ; try:\n{self.curl}"

    @property
    def inputs(self) -> list[str]:
        """What the server reads when it starts besides its argv (its CURVE keys, the admin key, the API keys
        when keyed): a change restarts it (layerline_worker inputs)."""
        keys = self.argv[self.argv.index("--keys") + 1] if "--keys" in self.argv else None
        return [p for p in (keys, self.admin_key_file, self.api_keys_file if self.keyed else None) if p]

    def to_dict(self) -> dict:
        return asdict(self) | {"argv": list(self.argv), "endpoint": self.endpoint, "banner": self.banner, "inputs": self.inputs}


def server_spec(hvars: SettingsLike, python: str = "python3", host: str = "controller") -> ServerSpec:
    """The server's launch on the serving host (the controller unless group layerline_server names one)."""
    hs = HostSettings.of(host, hvars)
    home, checkpoint = hs.controller_home, hs.checkpoint_path
    bind, port = hs.serve_bind, hs.serve_port_resolved
    keyed = hs.serve_api_keys or not is_loopback(bind)
    reach = LOOPBACK if is_wildcard(bind) else (f"[{bind}]" if ":" in bind else bind)
    tls = bool(hs.serve_tls_cert)
    url = f"{'https' if tls else 'http'}://{reach}:{port}"
    state = home.server_state
    python = hs.server_python or python
    argv = [python, "-m", "layerline.cli", "serve", "--plan", home.plan, "--checkpoint", checkpoint,
            "--host", bind, "--port", str(port), "--keys", home.keys_controller, "--curve", hs.curve,
            "--ready-file", os.path.join(state, "ready.json"), "--log-file", os.path.join(state, "requests.log"),
            "--admin-keys", home.admin_key,
            # the controller's code: the server restarts when it changes, as the workers do (it refuses workers
            # on other code than its own)
            "--layerline-version", version.full()]
    argv += ["--api-keys", home.api_keys] if keyed else []
    argv += ["--tls-cert", hs.serve_tls_cert, "--tls-key", hs.serve_tls_key] if tls else []
    argv += ["--restart-wait", _num(hs.serve_restart_wait), "--health-deadline", _num(hs.serve_health_deadline)]
    argv += ["--prefix-cache", "on" if hs.serve_prefix_cache else "off"]
    argv += ["--on-stage-lost", hs.serve_on_stage_lost] if hs.serve_on_stage_lost else []
    model = os.path.basename(checkpoint.rstrip("/"))
    chat = _has_chat_template(checkpoint)
    # greedy (temperature 0): the API's default of 1 makes a small model's first answer read as noise
    request = ({"model": model, "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 32,
                "temperature": 0}
               if chat else {"model": model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
               if checkpoint.endswith(".gguf") else {"model": model, "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0})
    return ServerSpec(argv=tuple(argv), python=python, state_dir=state, ready_timeout=hs.server_ready_timeout,
                      bind=bind, port=port, url=url, keyed=keyed, api_keys_file=home.api_keys,
                      ca_path=(hs.serve_tls_ca or hs.serve_tls_cert) if tls else None,
                      admin_key_file=home.admin_key,
                      request=request, request_path=home.request,
                      curl=curl_line(f"{url}/v1/{'chat/completions' if chat else 'completions'}", request,
                                     home.api_keys if keyed else None,
                                     (hs.serve_tls_ca or hs.serve_tls_cert) if tls else None))


def health_gate(url: str, status: int | None, body: dict | None, may_be_down: list[str] = ()) -> dict:
    """Whether a running server may be touched (a drain's gate): its /health answered (200, or 503 with
    stages down), its engine runs, and no stage is down but those in may_be_down. {"ok", "down", "msg"}:
    down names the stages that do not answer, msg says what is wrong in one line."""
    body = body if isinstance(body, dict) else {}
    down = [str(s.get("name")) for s in body.get("stages") or [] if isinstance(s, dict) and not s.get("ok")]
    answered = status in (200, 503)
    ok = answered and bool(body.get("engine")) and not [h for h in down if h not in may_be_down]
    if ok:
        msg = "the pipeline is healthy"
    elif not answered and status in (None, -1):
        msg = f"the pipeline is not healthy, so nothing was changed: nothing answers at {url} (deploy.yml starts the server)"
    else:
        msg = (f"the pipeline is not healthy, so nothing was changed: the server at {url} answered {status}; stages "
               f"down: {', '.join(down) or 'none (the engine is not running)'}")
    return {"ok": ok, "down": down, "msg": msg}


def _has_chat_template(checkpoint: str) -> bool:
    """Whether the example request can be a chat: the checkpoint (on the controller, where the server
    runs) has a chat template. A base model's GGUF has none: its example is a text completion."""
    from .checkpoint import CheckpointError, open_checkpoint
    try:
        return open_checkpoint(checkpoint).chat_template is not None
    except (CheckpointError, OSError):
        return False


def curl_line(url: str, body: dict, api_keys_file: str | None = None, ca_file: str | None = None) -> str:
    """One shell line that POSTs body as JSON to url (the API key read from its file by the shell; over
    HTTPS, the server's certificate checked against ca_file)."""
    parts = ["curl", "-s", shlex.quote(url), "-X", "POST", "-H", shlex.quote("Content-Type: application/json")]
    if ca_file:
        parts[2:2] = ["--cacert", shlex.quote(ca_file)]
    if api_keys_file:
        # double quotes: the shell runs $(head ...) and passes the header as one word
        parts += ["-H", f'"Authorization: Bearer $(head -1 {shlex.quote(api_keys_file)})"']
    parts += ["-d", shlex.quote(json.dumps(body, separators=(", ", ": ")))]
    return " ".join(parts)


def host_report(plan: Plan | None, host: str, hvars: SettingsLike) -> dict:
    """What layerline.Cluster keeps of a host between steps: its settings (defaults filled in), its
    variables as given (`vars`: HostSettings.from_vars reads them back), the controller's keys dir, and its
    worker argv under its worker interpreter ([] when the plan holds no stage for it)."""
    hs = HostSettings.of(host, hvars)
    planned = plan is not None and plan.stage(host) is not None
    return hs.facts() | {"keys_controller_dir": hs.controller_home.keys_controller, "vars": hs.to_vars(),
                         "argv": list(worker_spec(plan, host, hs).argv) if planned else []}
