"""layerline_save, layerline_drive and layerline_server_admin on the controller run in ansible's own
process (their action plugins call layerline.homesave.keep, layerline.operations.run_drive and
layerline.server.admin.ask: no module run, no interpreter started), and do exactly what the modules do
where they run as modules (another connection, become)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from helpers import BIN, ROOT, ansible_env

LIBRARY = ROOT / "modules" / "library"
ROUTE = {"slot": 1, "drained": ["w2"], "not_a_route_key": True}


def task(module: str, args: dict, *flags: str) -> subprocess.CompletedProcess:
    """An ad-hoc task on the controller (localhost: the local connection), -vvv."""
    return subprocess.run([str(BIN / "ansible"), "localhost", "-m", f"layerline.layerline.{module}",
                           "-a", json.dumps(args), "-vvv", *flags], cwd=ROOT, env=ansible_env(),
                          capture_output=True, text=True, timeout=120)


def module_run(module: str, args: dict, where: Path) -> dict:
    """The module itself, run as Ansible runs it on a host (its arguments in a file)."""
    argfile = where / f"{module}-args.json"
    argfile.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    r = subprocess.run([sys.executable, str(LIBRARY / f"{module}.py"), str(argfile)], capture_output=True,
                       text=True, timeout=120)
    return json.loads(r.stdout)


def _save_args(home: Path, file: str, content=None) -> dict:
    return {"home": str(home), "file": file, **({"content": content} if content is not None else {})}


def save(home: Path, file: str, content=None, *flags: str) -> subprocess.CompletedProcess:
    return task("layerline_save", _save_args(home, file, content), *flags)


def as_module(home: Path, file: str, content=None) -> dict:
    return module_run("layerline_save", _save_args(home, file, content), home.parent)


def test_on_the_controller_it_saves_in_process_as_the_module_does(tmp_path):
    home, other = tmp_path / "home", tmp_path / "other"
    r = save(home, "route", ROUTE)
    assert r.returncode == 0 and "CHANGED" in r.stdout, r.stdout + r.stderr
    # -vvv shows every command a module run sends its host; here there is none
    assert "EXEC" not in r.stdout + r.stderr, r.stdout[-2000:]
    got = home / "route.json"
    assert stat.S_IMODE(got.stat().st_mode) == 0o600
    assert as_module(other, "route", ROUTE)["changed"] is True
    assert got.read_bytes() == (other / "route.json").read_bytes(), "the action and the module keep the same bytes"
    assert "not_a_route_key" not in json.loads(got.read_text()), "route.json keeps only the route state's keys"
    again = save(home, "route", ROUTE)
    assert again.returncode == 0 and "CHANGED" not in again.stdout and "SUCCESS" in again.stdout, again.stdout
    assert as_module(other, "route", ROUTE)["changed"] is False


def test_check_mode_shows_the_diff_and_writes_nothing(tmp_path):
    home = tmp_path / "home"
    assert save(home, "drive", {"tokens": [1, 2]}).returncode == 0
    before = (home / "drive.json").read_bytes()
    r = save(home, "drive", {"tokens": [1, 3]}, "--check", "--diff")
    assert r.returncode == 0 and "CHANGED" in r.stdout, r.stdout
    assert '-  2' in r.stdout and '+  3' in r.stdout, r.stdout[-2000:]
    assert (home / "drive.json").read_bytes() == before


def test_bad_arguments_fail_in_one_line_and_write_nothing(tmp_path):
    home = tmp_path / "home"
    for file, content, says in (("drive", None, "layerline_save drive: content is required"),
                                ("nope", {"a": 1}, "value of file must be one of"),
                                ("plan", {"no": "stages"}, "refusing to keep a plan without stages"),
                                ("admin_key", "k", "takes no content")):
        r = save(home, file, content)
        assert r.returncode != 0 and says in " ".join(r.stdout.split()), r.stdout[-2000:]
        assert "Traceback" not in r.stdout + r.stderr
        assert says in as_module(home, file, content)["msg"], "the module says the same"
    assert not home.exists() or not any(p.suffix == ".json" for p in home.iterdir())


def test_a_key_file_is_made_once_and_never_shown(tmp_path):
    home = tmp_path / "home"
    r = save(home, "admin_key")
    assert r.returncode == 0 and "CHANGED" in r.stdout, r.stdout
    key = home / "keys" / "admin_key"
    secret = key.read_text().strip()
    assert len(secret) >= 32 and secret not in r.stdout + r.stderr
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    again = save(home, "admin_key")
    assert "CHANGED" not in again.stdout and key.read_text().strip() == secret
    os.chmod(key, 0o644)
    assert save(home, "admin_key").returncode == 0 and stat.S_IMODE(key.stat().st_mode) == 0o600


def test_the_drive_runs_from_the_controllers_process_with_the_modules_verdict(tmp_path):
    def printing(result: dict) -> list[str]:
        return [sys.executable, "-c", f"import json; print('a log line'); print(json.dumps({result!r}))"]
    cases = (
        (printing({"ok": True, "max_abs_diff": 0.01, "tolerance": 0.1}), 0, "the new route matches the one-process forward"),
        (printing({"ok": False, "max_abs_diff": 3.0, "precision": "bf16", "tolerance": 1.0}), 2,
         "the new route's logits differ from the one-process forward by 3.0, over the bf16 tolerance 1.0"),
        ([sys.executable, "-c", "import sys; sys.exit('layerline drive: stage w2 did not answer')"], 2,
         "the drive through the new route failed (exit status 1): layerline drive: stage w2 did not answer"),
        ([str(tmp_path / "no-such-drive")], 2, "the drive through the new route failed (exit status 127)"),
    )
    for argv, rc, says in cases:
        r = task("layerline_drive", {"argv": argv, "what": "the new route"})
        assert r.returncode == rc and says in " ".join(r.stdout.split()), r.stdout[-2000:]
        assert "EXEC" not in r.stdout + r.stderr and "Traceback" not in r.stdout + r.stderr, r.stdout[-2000:]
        m = module_run("layerline_drive", {"argv": argv, "what": "the new route"}, tmp_path)
        assert says in m["msg"] and m.get("failed", False) == (rc != 0), m
    r = task("layerline_drive", {"argv": [str(tmp_path / "no-such-drive")]}, "--check")
    assert r.returncode == 0 and "check mode: the pipeline not driven" in r.stdout, r.stdout[-2000:]


def test_the_server_admin_task_says_in_one_line_what_did_not_answer(tmp_path):
    """layerline_server_admin's ops where nothing listens (the answers of a live server:
    tests/processes/test_route_switch.py; the drains of tests/multihost and test_collection switch through it)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    cases = (({"op": "wait", "timeout": 2}, f"the server at {url} did not answer /health with 200 in 2 s"),
             ({"op": "gate"}, f"nothing answers at {url} (deploy.yml starts the server)"),
             ({"op": "route", "admin_key_file": str(tmp_path / "none"), "plan": {"stages": []}},
              "the server's admin key cannot be read (No such file or directory); run deploy.yml"))
    for args, says in cases:
        r = task("layerline_server_admin", {"url": url, **args})
        assert r.returncode == 2 and says in " ".join(r.stdout.split()), r.stdout[-2000:]
        assert "EXEC" not in r.stdout + r.stderr and "Traceback" not in r.stdout + r.stderr, r.stdout[-2000:]
        m = module_run("layerline_server_admin", {"url": url, **args}, tmp_path)
        assert m["failed"] and says in m["msg"], m
    r = task("layerline_server_admin", {"url": url, "op": "route", "admin_key_file": "x", "plan": {}}, "--check")
    assert r.returncode == 0 and "check mode: the route was not switched" in r.stdout, r.stdout[-2000:]
