"""`layerline serve` / `python -m layerline.server`: flags, checks, and the uvicorn run.

add_arguments(parser) and run(args) -> exit status are what the main CLI hooks in. Importing
this module loads argparse only; fastapi, uvicorn and torch load inside run(). Every user
mistake ends in one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from ..endpoints import LOOPBACK
from ..errors import LayerlineError
from ..prefill import BUSY_CHUNK, CHUNK

PROG = "layerline serve"


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    src = p.add_argument_group("pipeline (one of)")
    src.add_argument("--plan", help="the plan JSON (layerline plan --json / playbooks/plan.yml): stages, KV context")
    src.add_argument("--first", help="stage 0's data endpoint tcp://HOST:PORT (stages found by following each "
                                     "worker's next hop)")
    p.add_argument("--checkpoint", help="the model dir: tokenizer.json, tokenizer_config.json (chat template), "
                                        "config.json / generation_config.json (stop tokens, context)")
    p.add_argument("--host", default=LOOPBACK, help="address to listen on (non-loopback needs --api-keys)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-keys", default=None, help="file of API keys, one per line, mode 0600 (Bearer auth)")
    p.add_argument("--admin-keys", default=None,
                   help="file of admin keys, mode 0600: Bearer auth for POST /admin/route (drain, rejoin); "
                        "without it the admin routes answer 403")
    p.add_argument("--tls-cert", default=None,
                   help="certificate (PEM, the chain after it) to serve HTTPS with; needs --tls-key")
    p.add_argument("--tls-key", default=None, help="the certificate's private key (PEM, mode 0600)")
    p.add_argument("--keys", default=None,
                   help="the controller's CURVE keys dir (required: workers' control sockets run CURVE always)")
    p.add_argument("--first-key", default=None, help="with --first: stage 0's host name in KEYS/peers/")
    p.add_argument("--curve", default="auto", choices=["auto", "on"],
                   help="auto: CURVE on each socket whose address is not loopback; on: on every socket")
    p.add_argument("--reply-host", default=None, help="an address of this machine the last stage can reach")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the checkpoint's dir or file name without .gguf; the "
                        "file name and the GGUF's general.name are accepted too)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a KV slot before 429")
    p.add_argument("--max-running", type=int, default=48, help="sequences generated at once (at most 64)")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV tokens each stage holds across sequences (default: from the plan, else --context)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens a sequence may reach (default: the plan's KV context, else the model's, else 4096)")
    p.add_argument("--chunk", type=int, default=CHUNK, help="prompt tokens per prefill message")
    p.add_argument("--busy-chunk", type=int, default=BUSY_CHUNK,
                   help="prompt tokens per prefill message while other sequences decode")
    p.add_argument("--prefix-cache", default="on", choices=["on", "off"],
                   help="on: a prompt that starts with tokens an earlier request computed reuses their KV at every "
                        "stage (kept within the stages' KV budget, least recently used out first)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="decode micro-batches kept in flight (default: the plan's core groups: one per machine, "
                        "one per GPU; with --first, one per stage)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="chat requests that give no max_tokens")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a step may take before it fails")
    p.add_argument("--health-interval", type=float, default=0.5,
                   help="seconds between two health checks of every stage (actives and standbys)")
    p.add_argument("--health-deadline", type=float, default=2.0,
                   help="seconds a stage has to answer one health check (a miss)")
    p.add_argument("--health-misses", type=int, default=2,
                   help="misses in a row that make a stage down (and failed over); a stage whose port refuses "
                        "connections (its process is gone) is down at once")
    p.add_argument("--restart-wait", type=float, default=30.0,
                   help="with no standby for a stage that is down: seconds to wait for its supervisor's restart "
                        "before the requests it holds fail with 503")
    p.add_argument("--on-stage-lost", default=None, metavar="CMD",
                   help="run CMD ({host}: the stage's host) when an active stage stays down past --restart-wait, "
                        "e.g. 'ansible-playbook drain.yml -e layerline_drain={host}': it re-plans over the "
                        "survivors and switches this server to them (its output goes beside --log-file)")
    p.add_argument("--log-file", default=None, help="append one line per request here (default: stderr)")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="json: one JSON object per log line (a request's fields as keys), for log shippers")
    p.add_argument("--ready-file", default=None,
                   help="written (JSON: pid, url, model, stages) once the server listens; removed when it stops")
    p.add_argument("--layerline-version", default=None, metavar="V",
                   help="the controller's layerline version (layerline.version.full()): a server on other code "
                        "refuses to start; in the argv, so the server restarts when the controller's code changes "
                        "(it checks the workers' versions against its own)")
    return p


def _on_lost(cmd: str | None, log_file: str | None):
    """The --on-stage-lost hook: CMD with {host} filled in, started detached (it may switch this
    very server's route, so the server never waits for it); its output goes to
    on-stage-lost-HOST.log beside the request log. None without CMD."""
    if not cmd:
        return None
    import shlex
    import subprocess

    def run(host: str) -> None:
        argv = [w.replace("{host}", host) for w in shlex.split(cmd)]
        out = os.path.join(os.path.dirname(os.path.abspath(log_file)) if log_file else os.getcwd(),
                           f"on-stage-lost-{host}.log")
        with open(out, "ab") as f:
            subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        logging.getLogger("layerline.server").warning("failover: re-planning around %s: %s (output: %s)",
                                                      host, " ".join(argv), out)
    return run


def _fail(msg: str) -> int:
    print(f"{PROG}: {msg}", file=sys.stderr)
    return 2


def _check(a) -> None:
    from .. import version
    from .auth import is_loopback
    version.refuse_other(a.layerline_version)
    if bool(a.plan) == bool(a.first):
        raise LayerlineError("give the pipeline as --plan PLAN.json or as --first tcp://HOST:PORT (one of them)")
    if not 0 <= a.port <= 65535:
        raise LayerlineError(f"--port {a.port}: must be 0..65535")
    for flag in ("max_queue", "max_running", "chunk", "busy_chunk", "default_max_tokens", "max_body_bytes"):
        if getattr(a, flag) < 1:
            raise LayerlineError(f"--{flag.replace('_', '-')} {getattr(a, flag)}: must be at least 1")
    for flag in ("kv_tokens", "context", "microbatches", "health_misses"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            raise LayerlineError(f"--{flag.replace('_', '-')} {getattr(a, flag)}: must be at least 1")
    for flag in ("health_interval", "health_deadline", "restart_wait"):
        if not getattr(a, flag) > 0:
            raise LayerlineError(f"--{flag.replace('_', '-')} {getattr(a, flag)}: must be a positive number of seconds")
    if a.on_stage_lost:
        import shlex
        import shutil
        try:
            prog = shlex.split(a.on_stage_lost)[0]
        except (ValueError, IndexError) as e:
            raise LayerlineError(f"--on-stage-lost {a.on_stage_lost!r}: not a command line ({e or 'empty'})") from None
        if not shutil.which(prog):
            raise LayerlineError(f"--on-stage-lost: {prog} is not an executable on PATH; give its full path")
    if bool(a.tls_cert) != bool(a.tls_key):
        raise LayerlineError("--tls-cert and --tls-key go together (layerline_serve_tls_cert, layerline_serve_tls_key): "
                             "give both, or neither for plain HTTP")
    for flag, path in (("--tls-cert", a.tls_cert), ("--tls-key", a.tls_key)):
        if path and not os.access(path, os.R_OK):
            raise LayerlineError(f"{flag} {path}: cannot read it; give a PEM file this user may read")
    if a.tls_key:
        import stat
        if os.stat(a.tls_key).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise LayerlineError(f"--tls-key {a.tls_key}: group or others may read it; run chmod 600 {a.tls_key}")
    if not a.api_keys and not is_loopback(a.host):
        raise LayerlineError(f"--host {a.host}: refusing to listen off loopback without --api-keys FILE "
                             "(keys, one per line, mode 0600)")


def _check_port(host: str, port: int) -> None:
    """Fail in one line, before anything starts, when the address cannot be listened on."""
    import socket
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise LayerlineError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise LayerlineError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); another "
                                 "server on that port? pick another --port (layerline_serve_port)") from None


def _logger(path: str | None, fmt: str = "text") -> None:
    from .app import JsonFormatter
    log = logging.getLogger("layerline.server")
    log.setLevel(logging.INFO)
    log.propagate = False
    h = logging.FileHandler(path) if path else logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(message)s"))
    log.handlers[:] = [h]


def model_names(checkpoint: str | None, given: str | None) -> tuple[str, tuple[str, ...]]:
    """The model id the server answers to, and the other names a request may use: a GGUF file's
    name without .gguf (its name with the suffix, and its general.name, are aliases); a dir's name."""
    if not checkpoint:
        return given or "layerline", ()
    base = os.path.basename(os.path.normpath(checkpoint))
    names = [base]
    if base.lower().endswith(".gguf"):
        names.insert(0, base[:-len(".gguf")])
        try:
            from ..checkpoint import open_checkpoint
            gname = (open_checkpoint(checkpoint).config.get("gguf") or {}).get("name")
        except Exception:  # noqa: BLE001 - a name is a convenience; the checkpoint's errors come elsewhere
            gname = None
        if isinstance(gname, str) and gname.strip():
            names.append(gname.strip())
    name = given or names[0]
    return name, tuple(dict.fromkeys(n for n in names if n != name))


def run(a: argparse.Namespace) -> int:
    try:
        _check(a)
        _check_port(a.host, a.port)
        from .auth import KeyFile
        # read again whenever the files change (and on SIGHUP): keys rotate without a restart
        keys = KeyFile(a.api_keys) if a.api_keys else None
        admin_keys = KeyFile(a.admin_keys, "--admin-keys") if a.admin_keys else None
        if not a.keys:  # health, set_next: workers' control sockets let in only the controller's key
            raise LayerlineError("--keys is not set: the workers' control sockets run CURVE always and let in only "
                                 "the controller's key; pass the controller's keys dir (layerline_home's keys/controller, "
                                 "made by playbooks/keys.yml)")
        plan = None
        if a.plan:
            try:
                with open(a.plan) as f:
                    plan = json.load(f)
            except (OSError, ValueError) as e:
                raise LayerlineError(f"--plan {a.plan}: cannot read JSON ({e})") from None
        if plan is not None:
            from .route import check_plan
            plan = check_plan(plan, f"--plan {a.plan}")
        return _serve(a, plan, keys, admin_keys)
    except LayerlineError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return 130


def _on_sighup(*key_files) -> None:
    """SIGHUP reads the key files again (they are also read again on change, per request)."""
    import signal

    def reread(_signum, _frame) -> None:
        for f in key_files:
            if f is not None:
                f.reload()
    signal.signal(signal.SIGHUP, reread)


def _serve(a, plan: dict | None, keys=None, admin_keys=None) -> int:
    import torch
    import uvicorn

    from .app import build_app
    from .async_engine import AsyncEngine
    from .chat import TextSide
    from .failover import Failover
    from .metrics import Metrics
    from .serving import ServerConfig
    from .stages import (Pipes, StageClient, StageOps, actives_from_plan, kv_tokens, stages_from_first,
                         standbys_from_plan)

    # The server's only tensor work is sampling a few logits rows, too small to share out; with
    # OpenMP's threads it left one spinning after every step on the cores the stages decode on.
    torch.set_num_threads(1)
    text = TextSide.load(a.checkpoint)
    client = StageClient(a.keys, a.curve, a.health_deadline)
    stages = actives_from_plan(plan) if plan else stages_from_first(a.first, client, a.first_key)
    context = a.context or (int(plan["kv"]["context"]) if plan and (plan.get("kv") or {}).get("context") else None) \
        or text.context or 4096
    kv = a.kv_tokens or (kv_tokens(plan) if plan else None) or context
    # the plan the engine drives now (a route switch replaces it), or the pipeline from --first
    pipes = Pipes(a.keys, a.curve, a.timeout, a.reply_host, plan=plan, first=None if plan else a.first,
                  first_key=a.first_key)

    _logger(a.log_file, a.log_format)
    _on_sighup(keys, admin_keys)
    # the engine's thread and the event loop share the GIL: hand it over sooner than the
    # default 5 ms, or every token waits for the other thread's time slice
    sys.setswitchinterval(0.0005)
    name, aliases = model_names(a.checkpoint, a.model_name)
    metrics = Metrics(name)
    # with a plan, the pipe's depth (pipeline_for_plan); with --first, one micro-batch per stage
    engine = AsyncEngine(pipes.open, stages=a.microbatches or (None if plan else len(stages)), kv_tokens=kv,
                         max_running=a.max_running, max_queue=a.max_queue, chunk=a.chunk, busy_chunk=a.busy_chunk,
                         metrics=metrics, prefix=a.prefix_cache == "on")
    engine.start()
    failover = Failover(stages + (standbys_from_plan(plan) if plan else []), health=client.health,
                        channel=client.channel, set_next=client.set_next, engine=engine.call,
                        open_pipe=pipes.into, metrics=metrics,
                        interval=a.health_interval, deadline=a.health_deadline, restart_wait=a.restart_wait,
                        on_lost=_on_lost(a.on_stage_lost, a.log_file), misses=a.health_misses)
    failover.start()
    try:
        cfg = ServerConfig(name, context, kv, keys, a.max_body_bytes, a.default_max_tokens, admin_keys=admin_keys,
                           aliases=aliases)
        app = build_app(engine, text, cfg, StageOps(failover, client, pipes, metrics, switch_timeout_s=a.timeout))
        scheme = "https" if a.tls_cert else "http"
        print(f"{PROG}: {name} over {len(stages)} stage(s), context {context}, KV {kv} tokens; "
              f"listening on {scheme}://{a.host}:{a.port}{' (API keys)' if keys else ''}", file=sys.stderr, flush=True)
        config = uvicorn.Config(app, host=a.host, port=a.port, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5, ssl_certfile=a.tls_cert,
                                ssl_keyfile=a.tls_key)

        class Server(uvicorn.Server):
            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.started and a.ready_file:
                    from ..files import atomic_write_json
                    port = a.port
                    for srv in getattr(self, "servers", []):
                        for sock in srv.sockets or []:
                            port = sock.getsockname()[1]
                    atomic_write_json(a.ready_file, {
                        "pid": os.getpid(), "url": f"{scheme}://{a.host}:{port}", "host": a.host, "port": port,
                        "model": name, "stages": [s.endpoint for s in stages], "context": context,
                        "kv_tokens": kv, "api_keys": bool(keys), "time": time.time()}, mode=0o644)
        server = Server(config)
        try:
            server.run()
        finally:
            if a.ready_file:
                try:
                    os.unlink(a.ready_file)
                except FileNotFoundError:
                    pass
        return 0 if server.started else _fail(f"cannot listen on {a.host}:{a.port} (in use, or not an address "
                                              "of this machine)")
    finally:
        failover.stop()
        engine.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerline.server",
                                description="OpenAI-compatible HTTP server over a running layerline pipeline")
    add_arguments(p)
    return run(p.parse_args(argv))
