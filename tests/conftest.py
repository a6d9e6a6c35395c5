"""Shared fixtures for the layerline tests."""
from __future__ import annotations

from pathlib import Path

import os
import sys

import pytest

# Ports for local pipelines and test workers (layerline.local.free_ports): below the kernel's ephemeral
# range (so no outgoing connection takes one between the pick and the worker's bind), a range of its
# own for each pytest-xdist process (`make test` runs four, gw0-gw3), and clear of the fixed ports 29100-29999
# that the deploy tests use.
_xdist = os.environ.get("PYTEST_XDIST_WORKER", "")
_slot = int(_xdist[2:]) % 4 if _xdist.startswith("gw") and _xdist[2:].isdigit() else 0
if _xdist or "LAYERLINE_PORT_RANGE" not in os.environ:   # a worker inherits the controller's: replace it
    os.environ["LAYERLINE_PORT_RANGE"] = f"{20000 + 2000 * _slot}-{21998 + 2000 * _slot}"
# inductor compiles in this process (and in the workers the tests start), not in a pool of compile
# workers: on two cores the pool ran nothing in parallel that mattered and each of its processes
# imports torch. test_compile with a cold inductor cache, machine-wide CPU: 109 s with the pool,
# 78 s without (docs/testing.md). Read when torch._inductor.config is imported, so set before torch.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# torch._dynamo registers a polyfill for sys.intern when it is first imported, and Ansible's
# module_utils (loaded in-process by some module tests) replaces sys.intern with a patch class
# that dynamo then refuses. Load dynamo first, while sys.intern is still the builtin.
import torch  # noqa: E402
import torch._dynamo  # noqa: F401,E402

# --- test tiers: one directory each -----------------------------------------------------------------
#   unit/       in-process checks: no worker or server processes, no Ansible runs (`make test-unit`,
#               under a minute)
#   processes/  real worker, server and supervisor processes on this machine, no playbooks
#   deploy/     ansible-playbook, ansible-runner, the Ansible modules and CLI tools against local hosts
#   multihost/  over ssh to network-namespace hosts made by scripts/testhosts.py (needs root)
# Every test gets its directory's marker, so `pytest -m unit tests` still selects the fast tier.
# `make test` runs every tier; `make lint` runs ansible-lint and ansible-doc beside it in .ci/run.
TIERS = ("unit", "processes", "deploy", "multihost")
TESTS = Path(__file__).resolve().parent
# helpers.py and stage_procs.py live here, beside this file: every tier imports them by name
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


def _tier(item) -> str:
    try:
        tier = item.path.resolve().relative_to(TESTS).parts[0]
    except ValueError:
        tier = ""
    if tier not in TIERS:
        raise pytest.UsageError(f"{item.path}: a test belongs in one of tests/{{{','.join(TIERS)}}}/ "
                                "(the tier that says what it starts); move it there")
    return tier


# The slowest files first, slowest first (seconds each beside a CPU hog on the 2-core machine, runs 70-72
# of docs/testing.md: deployment ~580, compile ~180, collection ~105, gemma3_gguf ~100, bad_deploys ~90,
# gguf_bytes ~80, cluster ~70, then 60 down to 28; one_host ~130 when its tests were test_deployment's):
# `make test` runs four files at a time (pytest-xdist --dist loadfile), and a long file started last
# would run alone. test_deployment is one shared deployment whose tests go on from each other's state:
# it cannot be split across workers.
SLOW_FIRST = ("test_deployment", "test_compile", "test_one_host", "test_collection", "test_gemma3_gguf",
              "test_bad_deploys", "test_gguf_bytes", "test_cluster", "test_worker_module", "test_check_mode",
              "test_gguf_own_bits", "test_worker", "test_gguf", "test_probe", "test_failover",
              "test_controller_actions", "test_int4", "test_curve", "test_families")


def pytest_sessionstart(session):
    """A run's phase log (tests/helpers.py PHASE_LOG, printed by .ci/run) starts empty: once, in the
    process that runs the xdist workers, before they start."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        (TESTS.parent / ".cache" / "test-phases.log").unlink(missing_ok=True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, _tier(item)))
    rank = {m: i for i, m in enumerate(SLOW_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.stem, len(rank)))   # stable: file order within a rank


@pytest.fixture(scope="module", autouse=True)
def _file_timeline(request):
    """Each file's wall time and xdist worker, into the phase log: a slow run says which worker's
    files made it long (the suite's wall time is the later worker's)."""
    from helpers import Phases
    phase = Phases(f"file {_xdist or 'main'}")
    yield
    phase(str(request.node.path.relative_to(TESTS)))


@pytest.fixture(scope="module", autouse=True)
def _no_step_timing_in_process_tests(request):
    """Workers that tests/processes starts skip their warm-up step timing (LAYERLINE_STEP_TIMING=off,
    layerline.worker): hundreds of starts, and no test there reads the time unless marked
    `step_timing`. Module-scoped and autouse, so it is set before the module's pipelines start; the
    deploy tiers keep the default, so a deploy still times and records its step factors."""
    with pytest.MonkeyPatch.context() as mp:
        if _tier(request.node) == "processes":
            mp.setenv("LAYERLINE_STEP_TIMING", "off")
        else:
            mp.delenv("LAYERLINE_STEP_TIMING", raising=False)
        yield


@pytest.fixture(scope="session")
def _fork_templates(tmp_path_factory):
    """The templates warm starts fork from (stage_procs.start_templates), once per xdist worker."""
    from stage_procs import start_templates, stop_templates
    where = tmp_path_factory.mktemp("fork")
    procs = start_templates(str(where))
    yield str(where)
    stop_templates(procs)


@pytest.fixture(scope="module", autouse=True)
def _warm_starts_in_process_tests(request):
    """The processes tier's workers, servers and `layerline` runs start as forks of a template that
    has torch loaded (LAYERLINE_FORKSERVER; about 1.5 s of CPU less a start, and ~130 starts); the
    deploy tiers start them as a deployment does. A module marked `cold_starts` starts its own."""
    with pytest.MonkeyPatch.context() as mp:
        if _tier(request.node) == "processes" and request.node.get_closest_marker("cold_starts") is None:
            mp.setenv("LAYERLINE_FORKSERVER", request.getfixturevalue("_fork_templates"))
        else:
            mp.delenv("LAYERLINE_FORKSERVER", raising=False)
        yield


@pytest.fixture(autouse=True)
def _step_timing_where_marked(request):
    """A test marked `step_timing` starts workers that time their step as deployed ones do."""
    if request.node.get_closest_marker("step_timing") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("LAYERLINE_STEP_TIMING", raising=False)
        yield


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, but a worker takes its next file only when it holds the last test of its
    current one (a worker runs a test once it knows the next). xdist's own mark is two pending
    tests, so a worker starting the drain file (two tests, one of six minutes) took a second file
    at once and kept it unstarted, however soon the other worker ran out of work."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileWhenDone(LoadFileScheduling):
        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
            elif self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    return FileWhenDone(config, log)


# A small Llama-family demo model: fast to write, load and run on a busy CPU.
SMALL_CKPT = dict(layers=4, hidden=128, vocab=500, dtype="float32", seed=0)


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory) -> Path:
    """A deterministic 4-layer demo checkpoint (hidden 128, vocab 500, float32), made once per session.

    Its shape is in `SMALL_CKPT`; read config.json for anything else (heads, head_dim, ...).
    """
    from layerline.checkpoint import write_demo_checkpoint

    out = tmp_path_factory.mktemp("small_ckpt") / "ckpt"
    return Path(write_demo_checkpoint(out, **SMALL_CKPT))


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for the module's tests (small models gain nothing from more)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
