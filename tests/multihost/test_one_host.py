"""One namespace host over ssh, for what a single host proves (test_deployment's four hosts are for what
needs several): the runtime role installing and upgrading layerline where the host's interpreter lacks
it, then a bf16 deploy of that host, whose worker runs this machine's decode kernels, and a drive whose
check fails. A file of its own, so its playbooks run beside test_deployment's rather than after them
(`make test` runs four files at a time). Each test also runs on its own. Needs root (a namespace, a
bridge); installs openssh-server with apt-get when sshd is missing."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from layerline import version

from helpers import playbook, recap, remove_testhosts
from helpers import nshost_running, nshost_state_dir
from helpers import run_testhosts as hostctl

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                                reason="test hosts need root and iproute2 (network namespaces, a bridge)")

PREFIX = "llone"
SUBNET = "10.77.10.0/24"
HOST = "h1"
PORT = 9100                      # the host's layerline_port (it has its own network stack)
SERVE_PORT = 29860               # the server, on the controller's loopback
INFO: dict = {}
# set once teardown.yml stopped what the deploy started: the fixture need not run it again
TORN_DOWN = {"deploy": False}


@pytest.fixture(scope="module")
def host():
    """(home, extra args): the host up, an fp32 checkpoint on the controller, the deploy's variables."""
    from layerline.checkpoint import write_demo_checkpoint
    # Not under /tmp: the host has its own /tmp
    work = Path(tempfile.mkdtemp(prefix="layerline-one-host-", dir="/var/tmp"))
    out = work / "hosts"
    extra = None
    try:
        r = hostctl("up", "1", "--prefix", PREFIX, "--subnet", SUBNET, "--out", str(out), "--json",
                    "--port", str(PORT))
        assert r.returncode == 0, f"testhosts up failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        INFO.update(json.loads(r.stdout))
        home = work / "home"
        home.mkdir()
        ckpt = write_demo_checkpoint(home / "ckpt", layers=6, hidden=128, vocab=500, dtype="float32", seed=7)
        ev = {"layerline_home": str(home), "layerline_checkpoint": str(ckpt), "layerline_demo_checkpoint": False,
              "layerline_policy": "uniform", "layerline_precision": "bf16", "layerline_serve_port": SERVE_PORT,
              "layerline_checkpoint_shared": False,
              "layerline_prompt": "",  # random ids: no tokenizer
              "layerline_seq": 8, "layerline_generate": 4, "layerline_sequences": 2,
              "layerline_nice": 3}
        extra = ["-i", INFO["inventory"], "-e", json.dumps(ev)]
        yield home, extra
    finally:
        remove_testhosts(INFO.get("inventory"), None if extra is None or TORN_DOWN["deploy"] else extra[3], PREFIX,
                         out, work)


def _venv_without_layerline(work: Path, name: str, with_deps: bool) -> Path:
    """A venv (no pip of its own); with_deps: sees the controller venv's packages except layerline."""
    venv = work / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    if with_deps:
        import sysconfig
        shared = work / f"{name}-site"
        shared.mkdir()
        for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
            if not entry.name.startswith(("layerline", "__editable__")):
                (shared / entry.name).symlink_to(entry)
        site = next(venv.glob("lib/python3*/site-packages"))
        (site / "controller-packages.pth").write_text(f"{shared}\n")
    return venv / "bin" / "python"


def test_runtime_role_installs_layerline_where_missing(host):
    """An interpreter without layerline gets the controller's wheel; one without its dependencies
    stops with one line naming them; a re-run changes nothing."""
    home, extra = host
    work = Path(INFO["out"]).parent
    bare = _venv_without_layerline(work, "venv-bare", with_deps=False)
    r = playbook("playbooks/runtime.yml", *extra, "-l", HOST, "-e", f"layerline_runtime_python={bare}",
                 check=False)
    out = " ".join(r.stdout.split())
    m = re.search(r"lacks layerline's dependencies ([\w, -]+);", out)
    assert r.returncode != 0 and m, r.stdout[-3000:]
    assert set(m.group(1).split(", ")) >= {"torch", "pyzmq", "safetensors", "numpy", "psutil", "orjson"}, m.group(1)

    py = _venv_without_layerline(work, "venv-deps", with_deps=True)
    # that venv's own view: a checkout run with PYTHONPATH=runtime would lend it the controller's layerline
    own = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assert subprocess.run([str(py), "-c", "import layerline"], capture_output=True, env=own).returncode != 0
    r = playbook("playbooks/runtime.yml", *extra, "-l", HOST, "-e", f"layerline_runtime_python={py}")
    assert recap(r.stdout)[HOST]["changed"] > 0
    where = subprocess.run([str(py), "-c", "import layerline; print(layerline.__file__)"], capture_output=True,
                           text=True, check=True, env=own).stdout.strip()
    assert where.startswith(str(py.parent.parent)), f"layerline imported from {where}, not the venv's own"
    r = playbook("playbooks/runtime.yml", *extra, "-l", HOST, "-e", f"layerline_runtime_python={py}")
    assert recap(r.stdout)[HOST]["changed"] == 0, r.stdout[-3000:]

    # an upgrade reaches the host: its copy now differs from the controller's code (as after the controller's
    # checkout moved on), so its version (package version + content hash) differs and the role reinstalls
    installed = Path(where).parent / "errors.py"
    original = installed.read_text()
    installed.write_text(original + "# code the controller no longer runs\n")
    full = [str(py), "-c", "from layerline import version; print(version.full())"]
    assert subprocess.run(full, capture_output=True, text=True, check=True, env=own).stdout.strip() != version.full()
    r = playbook("playbooks/runtime.yml", *extra, "-l", HOST, "-e", f"layerline_runtime_python={py}")
    assert recap(r.stdout)[HOST]["changed"] > 0, r.stdout[-3000:]
    assert installed.read_text() == original, "the reinstall did not replace the host's old code"
    assert subprocess.run(full, capture_output=True, text=True, check=True, env=own).stdout.strip() == version.full()


def test_a_bf16_worker_runs_this_machines_kernels_and_a_drive_check_can_fail(host):
    """The host alone at bf16: deploy.yml's drive matches within the bf16 tolerance, the deployed worker
    says which decode kernels it runs (those of this machine: a bf16 stage loads them); then a drive
    against other weights than the worker serves fails: the check can fail; teardown.yml stops it all."""
    home, extra = host
    again = playbook("deploy.yml", *extra)
    out = " ".join(again.stdout.split())
    assert "matches" in out and "DOES NOT MATCH" not in out
    plan = json.loads((home / "plan.json").read_text())
    assert [(s["host"], s["layers"], s["precision"]) for s in plan["stages"]] == [(HOST, [0, 6], "bf16")]
    import torch  # noqa: F401
    from layerline.model import cpu_kernels
    from layerline.model.loader import load_stage
    load_stage(str(home / "ckpt"), 0, 6, True, True, precision="bf16")
    ready = json.loads((nshost_state_dir(INFO, home, HOST) / "ready.json").read_text())
    assert ready["layers"] == [0, 6] and ready["precision"] == "bf16"
    assert ready["kernels"] == cpu_kernels.status()

    # the drive's check can fail: drive.yml on its own reads the saved plan, and its reference now
    # reads other weights than the worker serves
    from layerline.checkpoint import write_demo_checkpoint
    other = write_demo_checkpoint(home / "other", layers=6, hidden=128, vocab=500, dtype="float32", seed=4)
    r = playbook("playbooks/drive.yml", *extra, "-e", f"layerline_checkpoint={other}", check=False)
    assert r.returncode != 0
    out = " ".join(r.stdout.split())  # the yaml callback folds long lines
    assert "DOES NOT MATCH" in out and "over the bf16 tolerance" in out

    # teardown.yml over the inventory it was deployed with stops the worker and the server
    pids = nshost_running(INFO, home, [HOST])
    assert set(pids) == {f"{HOST}/state", "server"}, pids
    playbook("teardown.yml", *extra)
    TORN_DOWN["deploy"] = True
    assert not nshost_running(INFO, home, [HOST])
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
