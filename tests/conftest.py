"""Shared fixtures for the layerline tests."""
from __future__ import annotations

from pathlib import Path

import os

import pytest

# Ports for local pipelines and test workers (layerline.local.free_ports): below the kernel's ephemeral
# range (so no outgoing connection takes one between the pick and the worker's bind), a range of its
# own for each pytest-xdist process (`make test` runs two), and clear of the fixed ports 29100-29999
# that the deploy tests use.
_xdist = os.environ.get("PYTEST_XDIST_WORKER", "")
_slot = int(_xdist[2:]) % 4 if _xdist.startswith("gw") and _xdist[2:].isdigit() else 0
if _xdist or "LAYERLINE_PORT_RANGE" not in os.environ:   # a worker inherits the controller's: replace it
    os.environ["LAYERLINE_PORT_RANGE"] = f"{20000 + 2000 * _slot}-{21998 + 2000 * _slot}"
# torch._dynamo registers a polyfill for sys.intern when it is first imported, and Ansible's
# module_utils (loaded in-process by some module tests) replaces sys.intern with a patch class
# that dynamo then refuses. Load dynamo first, while sys.intern is still the builtin.
import torch  # noqa: E402
import torch._dynamo  # noqa: F401,E402

# --- test tiers -----------------------------------------------------------------------------------
# Every test gets exactly one tier marker: by its name, else by a fixture it uses, else by its module
# (default unit):
#   unit       in-process checks, no playbooks, no worker pipelines: `pytest -m unit` (`make test-unit`),
#              under a minute
#   e2e        end-to-end and slow: real ansible / ansible-runner / ansible-lint runs on this
#              machine, worker processes, torch.compile, full probes
#   multihost  over ssh to network-namespace hosts made by scripts/testhosts.py (needs root)
# `make test` runs every tier. A test's own tier marker (e.g. @pytest.mark.e2e) is kept as it is.
TIERS = ("unit", "e2e", "multihost")
MODULE_TIER = {
    "test_e2e_deploy": "e2e",      # deploy.yml on the default inventory, staging each host's layers
    "test_lint": "e2e",            # ansible-lint over every playbook and role (~50 s)
    "test_compile": "e2e",         # torch.compile, a compiled worker process (minutes)
    "test_generate": "e2e",        # generation across real worker processes
    "test_worker": "e2e",          # a real two-stage worker pipeline
    "test_worker_module": "e2e",   # layerline_worker through real ansible
    "test_server": "e2e",          # the server over three real worker processes
    "test_route_switch": "e2e",    # a live route switch over real workers
    "test_drain": "e2e",           # drain.yml and a rejoin under load
    "test_http_abuse": "e2e",      # 2,000 bad requests at a live server
    "test_bad_deploys": "e2e",     # deploy.yml with bad inputs
    "test_control_auth": "e2e",    # control sockets of real workers, strangers and the controller
    "test_fuzz_wire": "e2e",       # mutated messages into live workers (LAYERLINE_FUZZ=full: make fuzz)
    "test_multihost": "multihost",
}
# "module::fixture": every test of that module using the fixture (real worker processes)
FIXTURE_TIER = {
    "test_curve::stages": "e2e",
    "test_rows::pipeline": "e2e",
}
TEST_TIER = {  # "module::test name" (parametrized cases share their test's tier)
    "test_cluster::test_probe_plan_launch_drive_teardown": "e2e",        # ansible-runner, three workers
    "test_curve::test_missing_keys_dir_and_readable_secret_are_refused_by_the_worker": "e2e",  # workers
    "test_curve::test_off_loopback_without_keys_is_one_line_naming_keys": "e2e",
    "test_curve::test_driver_off_loopback_without_keys_is_one_line": "e2e",
    "test_discover::test_discover_play_adds_hosts": "e2e",               # playbooks/discover.yml
    "test_discover::test_cluster_discover_is_idempotent": "e2e",         # ansible-runner
    "test_families::test_family_through_three_worker_processes_equals_transformers": "e2e",
    "test_families::test_text_in_text_out_with_a_tokenizer": "e2e",      # worker processes
    "test_probe::test_module_returns_caps_and_uses_its_cache": "e2e",    # the probe module via ansible
    # five full probes (each ~1.5 s: the decode-bandwidth timing does not follow budget_s)
    "test_probe::test_disk_speed_is_null_not_zero_when_unmeasured": "e2e",
    "test_probe::test_a_host_without_the_checkpoint_times_the_disk_it_will_land_on": "e2e",
    "test_rows::test_the_kv_budget_evicts_the_oldest_and_rows_then_name_it": "e2e",  # a worker
    "test_supervise::test_real_worker_under_supervise": "e2e",           # a real worker process
}


def _tier(item) -> str | None:
    module = item.path.stem
    name = getattr(item, "originalname", None) or item.name
    tier = TEST_TIER.get(f"{module}::{name}")
    if tier is None:
        fixtures = getattr(item, "fixturenames", ())
        tier = next((t for k, t in FIXTURE_TIER.items() if k.split("::")[0] == module
                     and k.split("::")[1] in fixtures), None)
    if tier is None and not any(m.name in TIERS for m in item.iter_markers()):
        tier = MODULE_TIER.get(module, "unit")
    return tier


# The slowest files first (minutes each: deploys, compiles, the operations proof): `make test` runs
# two files at a time (pytest-xdist --dist loadfile), and a long file started last would run alone.
SLOW_FIRST = ("test_drain", "test_multihost", "test_e2e_deploy", "test_compile", "test_cluster", "test_gguf",
              "test_bad_deploys", "test_int4", "test_families")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = _tier(item)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
    rank = {m: i for i, m in enumerate(SLOW_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.stem, len(rank)))   # stable: file order within a rank


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
