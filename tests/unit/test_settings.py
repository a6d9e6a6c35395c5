"""layerline.settings.HostSettings is the one home of every layerline_* variable: the roles' argument
specs and defaults, the README's variable table and the embedded inventory are held to it here; and the
facts decided once beside it (ports, loopback, the controller's paths, the server's launch and curl line)."""
from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from layerline.endpoints import control_endpoint, control_port, is_loopback, slot_port, worker_ports
from layerline.errors import LayerlineError
from layerline.home import ControllerHome
from layerline.settings import PREFIX, ROLE_INPUTS, HostSettings, server_host, variable_names, variables
from layerline.spec import curl_line, server_spec

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())  # any tests/ tier
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if (p / "meta" / "argument_specs.yml").is_file())
# Variables the README's table does not list yet (its rewrite owns the file): each must get a row, and
# then leave this set. The test fails for any other variable the table lacks.
README_PENDING: set[str] = set()   # variables still waiting for a README row (none)
# argument_specs type for each Python annotation a role's variable may have
SPEC_TYPES = {"bool": {"bool"}, "int": {"int"}, "float": {"float", "int"}, "str | None": {"str", "path"},
              "str": {"str", "path"}, "float | None": {"float"}, "int | None": {"int"}}


def _fields_by_var() -> dict[str, dataclasses.Field]:
    return {PREFIX + f.name: f for f in variables()}


def readme_variables() -> set[str]:
    """Every variable named in the first column of the README's variable tables (header `| variable |`)."""
    return set().union(*readme_rows())


def readme_rows() -> dict[tuple[str, ...], str]:
    """{(variables of a row): its meaning} from the README's variable tables."""
    rows: dict[tuple[str, ...], str] = {}
    in_table = False
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        if not cells:
            in_table = False
            continue
        if cells[0].lower() in ("variable", "variables", "name"):
            in_table = True
            continue
        if in_table and not cells[0].startswith("group "):   # `group layerline_server` names a group
            rows[tuple(re.findall(r"`(layerline_\w+)`", cells[0]))] = " | ".join(cells[1:])
    return rows


def role_specs(role: str) -> dict[str, dict]:
    """{option: spec} over every entry point of the role's meta/argument_specs.yml."""
    doc = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())
    out: dict[str, dict] = {}
    for entry in doc["argument_specs"].values():
        out.update(entry.get("options") or {})
    return out


def role_defaults(role: str) -> dict:
    path = ROOT / "roles" / role / "defaults" / "main.yml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def test_every_variable_is_in_the_readme_table_and_the_table_names_only_variables():
    documented = readme_variables()
    assert documented, "README.md has no variable table (| variable | meaning |)"
    fields = set(variable_names())
    users = {PREFIX + f.name for f in variables() if not f.metadata["set_by"]}
    missing = users - documented - README_PENDING
    assert not missing, f"README's variable table lacks {sorted(missing)}: add a row for each"
    unknown = documented - fields
    assert not unknown, f"README's variable table names {sorted(unknown)}, which HostSettings lacks"
    assert README_PENDING <= fields, "README_PENDING names a variable HostSettings lacks"


def test_readme_defaults_agree_with_the_dataclass():
    """A row of one variable whose meaning ends in "(DEFAULT)" states the dataclass's default."""
    by_var = _fields_by_var()
    for names, meaning in readme_rows().items():
        m = re.search(r"\(([^()]*)\)\s*$", meaning)
        if len(names) != 1 or not m or by_var[names[0]].default is None:
            continue
        stated, default = m.group(1).strip(), by_var[names[0]].default
        try:
            value = yaml.safe_load(stated)
        except yaml.YAMLError:
            continue
        if isinstance(value, (bool, int, float)) and isinstance(default, (bool, int, float)):
            assert value == default, f"README says {names[0]} defaults to {stated}, HostSettings to {default!r}"


@pytest.mark.parametrize("role", ROLES)
def test_role_argument_specs_and_defaults_agree_with_the_dataclass(role):
    by_var = _fields_by_var()
    specs, defaults = role_specs(role), role_defaults(role)
    inputs = set(ROLE_INPUTS.get(role, ()))
    for name in specs:
        assert name in by_var or name in inputs, (
            f"roles/{role}: argument spec {name} is neither a HostSettings variable nor one of the role's inputs "
            f"(layerline.settings.ROLE_INPUTS)")
    assert set(defaults) <= set(specs), f"roles/{role}: defaults without an argument spec: {set(defaults) - set(specs)}"
    tasks = "\n".join(p.read_text() for p in sorted((ROOT / "roles" / role / "tasks").glob("*.yml")))
    for name, f in by_var.items():
        if role not in f.metadata["roles"]:
            assert name not in specs, f"roles/{role} takes {name}: add the role to its field's roles in HostSettings"
            continue
        assert name in specs, f"roles/{role}: argument spec lacks {name} (HostSettings says the role takes it)"
        assert specs[name]["type"] in SPEC_TYPES[str(f.type)], f"roles/{role}: {name} type {specs[name]['type']}"
        # its default and check are HostSettings': the role reads it through the layerline_settings filter
        assert name not in defaults, f"roles/{role}: defaults/main.yml sets {name}; its default is HostSettings'"
        used = rf"\{{\{{[^}}]*\b{name}\b|^\s*(\w+_)?(when|that|until):[^#\n]*\b{name}\b|^\s*-\s+\(?{name}\b"
        assert not re.search(used, tasks, re.M), (
            f"roles/{role}: tasks read {name} as it was given; read it through layerline_settings (defaults filled in)")


def test_the_embedded_inventory_restates_no_default():
    """The demo's group vars set only what differs from HostSettings' defaults (one home for each default)."""
    doc = yaml.safe_load((ROOT / "inventory" / "group_vars" / "all.yml").read_text())
    by_var = _fields_by_var()
    same = [k for k, v in doc.items() if k in by_var and "{{" not in str(v)
            and HostSettings.from_vars("w1", {k: v}).to_vars()[k] == HostSettings.from_vars("w1", {}).to_vars()[k]]
    assert not same, f"inventory/group_vars/all.yml restates HostSettings' defaults of {same}: leave them out"
    assert "layerline_state_dir" not in doc, "the state dirs' default is HostSettings.default_state_dir"


def test_the_embedded_inventory_sets_only_known_variables():
    known = set(variable_names()) | {"layerline_demo_checkpoint"}
    inv = ROOT / "inventory"
    text = (inv / "group_vars" / "all.yml").read_text() + (inv / "hosts.yml").read_text()
    used = {m for m in re.findall(r"^\s*(layerline_\w+):", text, re.M)} - {"layerline"}
    assert used and used <= known, f"the inventory sets {sorted(used - known)}, which HostSettings lacks"


def test_defaults_and_derived_values():
    s = HostSettings.from_vars("w1", {})
    assert (s.seq, s.rng_seed, s.port, s.policy, s.curve, s.role, s.slot) == (16, 0, 9100, "auto", "auto", "active", 0)
    assert s.address == "w1" and s.state_dir_in() == "/tmp/layerline-w1" and s.serve_port_resolved == 8000
    local = HostSettings.from_vars("w2", {"ansible_connection": "local", "layerline_port": "29110",
                                          "layerline_port_base": 29100, "layerline_slot": "1",
                                          "layerline_state_dir": "/s/w2", "layerline_checkpoint_shared": "false"})
    assert local.address == "127.0.0.1" and local.endpoint == "tcp://127.0.0.1:29160"
    assert local.ports() == (29160, 29161) and local.ports(0) == (29110, 29111)
    assert local.state_dir_in() == "/s/w2.1" and local.home_state_dir == "/s/w2"
    assert local.worker_keys_dir == "/s/w2/keys" and local.caps_file == "/s/w2/caps.json"
    assert local.serve_port_resolved == 29190 and local.checkpoint_shared is False
    assert local.facts()["other_state_dir"] == "/s/w2"
    assert (s.facts()["probe_throttle"], HostSettings.from_vars("w1", {"layerline_probe_serial": "yes"}).probe_throttle) \
        == (0, 1), "probe.yml's throttle"


@pytest.mark.parametrize("hvars,says", [
    ({"layerline_port": 0}, "w1: layerline_port 0 must be an integer 1-65534"),
    ({"layerline_nice": 20}, "w1: layerline_nice 20 must be an integer 0-19"),
    ({"layerline_curve": "off"}, "w1: layerline_curve 'off' is not one of auto, on"),
    ({"layerline_checkpoint_shared": "maybe"}, "layerline_checkpoint_shared: 'maybe' must be true or false"),
    ({"layerline_serve_health_deadline": 0}, "layerline_serve_health_deadline: 0 must be a positive number"),
    ({"layerline_slot": 2}, "w1: layerline_slot 2 must be 0 or 1"),
    ({"layerline_layers": "4:2"}, "w1: layerline_layers '4:2' must have 0 <= A < B"),
    ({"layerline_objective": [1]}, "layerline_objective: [1] must be a mapping"),
])
def test_a_bad_variable_names_host_variable_and_fix_in_one_line(hvars, says):
    with pytest.raises(LayerlineError) as e:
        HostSettings.from_vars("w1", hvars)
    msg = str(e.value)
    assert says in msg and "\n" not in msg


def test_ports_and_loopback_are_decided_once():
    assert control_port(9100) == 9101 and worker_ports(9100) == (9100, 9101)
    assert control_endpoint("tcp://10.0.0.1:9100") == "tcp://10.0.0.1:9101" and slot_port(9100, 1) == 9150
    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "::ffff:127.0.0.1"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "*", "10.0.0.1", "example.org"):
        assert not is_loopback(host), host
    from layerline import keys, worker
    from layerline.server import auth
    assert keys.is_loopback is auth.is_loopback is is_loopback and worker.control_endpoint is control_endpoint


def test_the_server_host_is_found_once():
    assert server_host({"layerline": ["w1"]}) == "localhost"
    assert server_host({"layerline_server": ["h9", "h8"]}) == "h9"


def test_the_controllers_home_keeps_its_files_atomically(tmp_path):
    home = ControllerHome.of(tmp_path / "home")
    assert home.plan == str(tmp_path / "home" / "plan.json") and home.keys_controller.endswith("keys/controller")
    assert home.save("route", {"slot": 1, "drained": ["w2"], "changed": True, "moves": True, "before": {}})
    assert json.loads(Path(home.route).read_text()) == {"slot": 1, "drained": ["w2"]}, "only the route's own keys"
    assert not home.save("route", {"slot": 1, "drained": ["w2"]}), "the same bytes: unchanged"
    assert Path(home.route).stat().st_mode & 0o777 == 0o600
    with pytest.raises(LayerlineError, match="without stages"):
        home.save("plan", {})
    assert home.load_plan(required=False) == {}
    with pytest.raises(LayerlineError, match="no plan was kept here"):
        home.load_plan()


def _server(tmp_path, **hvars):
    from layerline.cli import packaged_smollm2  # a chat model: its example request is a chat
    return server_spec({"layerline_home": str(tmp_path), "layerline_checkpoint": packaged_smollm2(), **hvars},
                       python="/venv/bin/python")


def test_the_servers_launch_is_built_in_python(tmp_path):
    s = _server(tmp_path, layerline_port_base=29100, layerline_serve_restart_wait=10)
    assert s.argv[:4] == ("/venv/bin/python", "-m", "layerline.cli", "serve") and not s.keyed
    flags = dict(zip(s.argv[4::2], s.argv[5::2]))
    assert flags["--plan"] == str(tmp_path / "plan.json") and flags["--port"] == "29190"
    assert flags["--keys"] == str(tmp_path / "keys" / "controller") and flags["--restart-wait"] == "10"
    assert flags["--health-deadline"] == "2" and "--api-keys" not in flags and s.url == "http://127.0.0.1:29190"
    assert flags["--prefix-cache"] == "on"
    # the controller's code: a server started under other code restarts with the workers after an upgrade
    from layerline import version
    assert flags["--layerline-version"] == version.full()
    assert dict(zip(*[iter(_server(tmp_path, layerline_serve_prefix_cache=False).argv[4:])] * 2))["--prefix-cache"] == "off"
    open_ = _server(tmp_path, layerline_serve_bind="0.0.0.0")
    assert open_.keyed and "--api-keys" in open_.argv and open_.url == "http://127.0.0.1:8000"


@pytest.mark.parametrize("bind", ["127.0.0.1", "0.0.0.0"])
def test_the_printed_curl_line_is_one_shell_line_that_posts_the_request(tmp_path, bind):
    s = _server(tmp_path, layerline_serve_bind=bind)
    assert "\n" not in s.curl and s.banner.splitlines()[1] == s.curl, "printed on a line of its own"
    assert s.banner.splitlines()[0] == f"serving at {s.url}/v1 ; try:"
    words = shlex.split(s.curl)
    assert words[:3] == ["curl", "-s", f"{s.url}/v1/chat/completions"]
    assert words[words.index("-X") + 1] == "POST"
    headers = [words[i + 1] for i, w in enumerate(words) if w == "-H"]
    assert "Content-Type: application/json" in headers
    if s.keyed:
        assert f"Authorization: Bearer $(head -1 {tmp_path}/keys/api_keys)" in headers
    else:
        assert not any(h.startswith("Authorization") for h in headers)
    assert json.loads(words[words.index("-d") + 1]) == s.request
    assert s.request["messages"][0]["role"] == "user" and s.request["max_tokens"] > 0
    assert s.request["temperature"] == 0, "greedy: a small model's first answer reads as words"


def test_a_curl_body_with_quotes_stays_one_word():
    body = {"prompt": "it's \"quoted\" $HOME", "max_tokens": 1}
    words = shlex.split(curl_line("http://127.0.0.1:1/v1/completions", body))
    assert json.loads(words[-1]) == body


def test_discovery_skips_what_the_inventory_knows_and_checks_its_spec():
    from layerline.inventory import known_addresses
    assert known_addresses({"w1": {"ansible_connection": "local"}, "h2": {"ansible_host": "10.0.0.2"}}) == [
        "w1", "127.0.0.1", "h2", "10.0.0.2"]
    assert HostSettings.from_vars("w1", {"layerline_discover": {"subnet": "10.77.0.0/24"}}).discover["subnet"]
    for bad in ({"subnets": "x"}, {"ssh_hosts": "h1"}, ["h1"]):
        with pytest.raises(LayerlineError, match="layerline_discover: .* must be a mapping with keys among ssh_hosts"):
            HostSettings.from_vars("w1", {"layerline_discover": bad})


# What the playbooks and roles must not decide again: each is decided once in Python (the module named).
DECIDED_IN_PYTHON = {
    r"127\.0\.0\.1|'::1'|\blocalhost'\s*,": "loopback (layerline.endpoints)",
    r"[/'\"](plan|route|drive|request)\.json|/keys/|/state/server": "the controller's paths (layerline.home)",
    r"to_nice_json": "files kept through the layerline_save module (layerline.home)",
    r"groups\['layerline_server'\]": "the server host (layerline_server_host filter)",
    r"'layerline\.cli',\s*'serve'|layerline\.cli, serve": "the server's argv (layerline.spec.server_spec)",
    r"layerline_(seq|rng_seed|curve|checkpoint_shared|device|port)\s*\|\s*default\(": "a variable's default (HostSettings)",
    r"/usr/bin/python|\{\{[^}]*ansible_python_interpreter": "a host's interpreter (HostSettings.host_python)",
    r"-m,\s*['\"]?layerline\.|'-m',\s*'layerline\.|^\s*-\s+layerline\.\w+\s*$": "a layerline command line (layerline.spec)",
    r"key_secret": "the keys' file names (layerline.keys, layerline.spec.keys_spec)",
    r"'/\.cache'|\}\}/wheels|/wheels\b": "the wheel dir (layerline.home.wheel_dir)",
    r"\{\{\s*layerline_(state_dir|keys_dir|stage_dir|compile_cache)\b": "a host's dirs (HostSettings, the layerline_settings filter)",
    r"lookup\('ansible\.builtin\.password'": "a secret (the layerline_save module: layerline.server.auth)",
    r"^\s*argv:\s*$|\bargv:\s*\[": "a command line typed in YAML (layerline.spec builds each)",
}


def test_playbooks_and_roles_decide_nothing_python_decides():
    books = [ROOT / "deploy.yml", ROOT / "drain.yml", ROOT / "teardown.yml", *sorted((ROOT / "playbooks").rglob("*.yml")),
             *sorted((ROOT / "roles").glob("*/tasks/*.yml")), *sorted((ROOT / "roles").glob("*/defaults/*.yml"))]
    found = []
    for path in books:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
            for pattern, home in DECIDED_IN_PYTHON.items():
                if re.search(pattern, code):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {home}: {line.strip()}")
    assert not found, "\n".join(found)


def _tasks(doc):
    """Every task in a playbook or task file, blocks and plays opened."""
    for item in doc or []:
        if not isinstance(item, dict):
            continue
        for key in ("tasks", "pre_tasks", "post_tasks", "handlers", "block", "rescue", "always"):
            yield from _tasks(item.get(key))
        yield item


def test_secrets_are_written_by_a_module_not_by_copy_content():
    """A key written with copy: content: is logged unless each task remembers no_log, and not atomic: the
    server's keys come from the layerline_save module (made once, 0600), and every task that touches a
    secret is no_log."""
    books = [*sorted((ROOT / "playbooks").rglob("*.yml")), *sorted((ROOT / "roles").glob("*/tasks/*.yml"))]
    for path in books:
        for task in _tasks(yaml.safe_load(path.read_text())):
            copy = task.get("ansible.builtin.copy") or task.get("copy")
            assert not (isinstance(copy, dict) and "content" in copy), f"{path.relative_to(ROOT)}: {task.get('name')}"
            save = task.get("layerline.layerline.layerline_save")
            if (isinstance(save, dict) and save.get("file") in ("admin_key", "api_keys")) or \
                    (isinstance(copy, dict) and "secret" in str(copy)):
                assert task.get("no_log") is True, f"{path.relative_to(ROOT)}: {task.get('name')} must be no_log"
    server = yaml.safe_load((ROOT / "roles" / "layerline_server" / "tasks" / "main.yml").read_text())
    save = "layerline.layerline.layerline_save"
    made = [t[save]["file"] for t in server if save in t and "content" not in t[save]]
    assert made == ["admin_key", "api_keys"], "the admin key and the API keys"


# -- facts the review found decided twice, each now decided once in Python ---------------------------

def test_the_interpreters_are_decided_once():
    from layerline.settings import DEFAULT_PYTHON
    from layerline.spec import host_report, keys_place_argv
    bare = HostSettings.from_vars("w1", {})
    assert (bare.host_python, bare.runtime_interpreter, bare.worker_interpreter) == (DEFAULT_PYTHON,) * 3
    assert HostSettings.from_vars("w1", {"ansible_python_interpreter": "auto_silent"}).host_python == DEFAULT_PYTHON
    given = HostSettings.from_vars("w1", {"ansible_python_interpreter": "/v/bin/python"})
    assert given.runtime_interpreter == given.worker_interpreter == "/v/bin/python"
    runtime = {"ansible_python_interpreter": "/v/bin/python", "layerline_runtime_python": "/r/python"}
    assert HostSettings.from_vars("w1", runtime).worker_interpreter == "/r/python", "the worker runs where layerline is"
    both = HostSettings.from_vars("w1", {**runtime, "layerline_worker_python": "/w/python"})
    assert (both.runtime_interpreter, both.worker_interpreter) == ("/r/python", "/w/python")
    assert both.facts()["runtime_python"] == "/r/python" and both.facts()["worker_python"] == "/w/python"
    home = {"layerline_home": "/h", **runtime}
    assert keys_place_argv("w1", home, {"w1": "k"})[0] == "/r/python", "the keys are laid out where layerline is"
    assert host_report(None, "w1", home)["worker_python"] == "/r/python"


def test_the_state_dir_default_is_decided_once(tmp_path):
    home = str(tmp_path / "home")
    local = {"ansible_connection": "local", "layerline_home": home}
    assert HostSettings.from_vars("w1", local).state_dir_in() == ControllerHome.of(home).host_state("w1")
    assert HostSettings.from_vars("w1", {**local, "layerline_slot": 1}).state_dir_in() == f"{home}/state/w1.1"
    assert HostSettings.from_vars("w1", {"layerline_home": home}).state_dir_in() == "/tmp/layerline-w1", (
        "a remote host does not see the controller's dirs")
    assert HostSettings.from_vars("w1", {**local, "layerline_state_dir": "/s"}).state_dir_in() == "/s"
    with pytest.raises(LayerlineError, match="server: its default state dir would be the server's .*layerline_state_dir"):
        HostSettings.from_vars("server", local).state_dir_in()


def test_the_controllers_commands_are_built_in_python(tmp_path):
    from layerline.spec import demo_checkpoint_argv, index_argv, keys_spec
    hv = {"layerline_home": str(tmp_path), "layerline_checkpoint": "/m/model.gguf"}
    assert demo_checkpoint_argv(hv, "/py") == ["/py", "-m", "layerline.cli", "demo-checkpoint", "/m/model.gguf"]
    assert index_argv(hv, "/py") == ["/py", "-m", "layerline.cli", "index", "/m/model.gguf", "--json"]
    with pytest.raises(LayerlineError, match="^layerline_checkpoint is not set; point it at"):
        index_argv({"layerline_home": str(tmp_path)}, "/py")
    k = keys_spec("w2", {**hv, "layerline_state_dir": "/s/w2"}, ["w1", "w2"], "/py")
    home = ControllerHome.of(tmp_path)
    assert k.make_argv == ("/py", "-m", "layerline.keys", "make", "--store", home.keys_store, "--controller-dir",
                           home.keys_controller, "--", "w1", "w2")
    assert k.keys_dir == "/s/w2/keys"
    assert k.secret_src == f"{home.keys_store}/w2.key_secret"


def test_the_keys_spec_names_the_files_the_keys_module_makes(tmp_path):
    """keys_spec's secret_src is the file `layerline.keys make` writes; place, run as the role runs it (that
    file on its stdin), lays out the whole keys dir a worker loads: the secret 0600, and a re-run changes
    nothing. Another host's keypair on its stdin is refused in one line, and nothing is written."""
    import subprocess
    import sys
    from layerline import keys
    from layerline.spec import keys_place_argv, keys_spec
    k = keys_spec("w1", {"layerline_home": str(tmp_path), "layerline_state_dir": str(tmp_path / "s")}, ["w1", "w2"])
    public, _ = keys.make_store(ControllerHome.of(tmp_path).keys_store, ["w1", "w2"])
    assert keys.read_key_file(k.secret_src)[1], "the store holds w1's secret where the spec says"
    pub = {n: p.decode() for n, p in public.items()}

    def place(host: str, secret_of: str) -> subprocess.CompletedProcess:
        argv = keys_place_argv(host, {"layerline_state_dir": str(tmp_path / host)}, pub)
        with open(keys_spec(secret_of, {"layerline_home": str(tmp_path)}, []).secret_src, "rb") as f:
            return subprocess.run([sys.executable, *argv[1:]], stdin=f, capture_output=True, text=True, timeout=60)

    first, again = place("w1", "w1"), place("w1", "w1")
    assert first.returncode == 0 and json.loads(first.stdout)["changed"], first.stderr
    assert again.returncode == 0 and not json.loads(again.stdout)["changed"], again.stderr
    d = tmp_path / "w1" / "keys"
    assert (d / "allowed" / "controller.key").is_file() and oct((d / "self.key_secret").stat().st_mode & 0o777) == "0o600"
    hk = keys.load_host_keys(str(d))
    assert hk.public == public["w1"] and keys.read_key_file(str(d / "self.key_secret")) == keys.read_key_file(k.secret_src)
    wrong = place("w2", "w1")
    assert wrong.returncode == 2 and "w2's keypair: its secret key is not the one of public['w2']" in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1 and not (tmp_path / "w2" / "keys").exists()
    with pytest.raises(LayerlineError, match="no public key for it"):
        keys_place_argv("w9", {}, {"w1": "k"})


def test_the_servers_key_files_are_made_once_0600(tmp_path):
    from layerline.server.auth import KEY_LENGTH, ensure_key_file, load_keys
    path = str(tmp_path / "keys" / "admin_key")
    assert ensure_key_file(path)
    assert Path(path).stat().st_mode & 0o777 == 0o600 and (tmp_path / "keys").stat().st_mode & 0o777 == 0o700
    key = load_keys(path)
    assert len(key) == 1 and len(key[0]) == KEY_LENGTH
    assert not ensure_key_file(path) and load_keys(path) == key, "kept: the server and drain.yml read it"
    Path(path).chmod(0o644)
    assert ensure_key_file(path) and Path(path).stat().st_mode & 0o777 == 0o600 and load_keys(path) == key
    Path(path).write_text("\n")
    assert ensure_key_file(path) and load_keys(path) != key, "an empty file gets a key"
    (tmp_path / "keys").chmod(0o755)   # the dir is kept private too (the role has no task of its own for it)
    assert ensure_key_file(path) and (tmp_path / "keys").stat().st_mode & 0o777 == 0o700


def test_the_wheel_dir_is_decided_once(tmp_path):
    from layerline.home import wheel_dir
    assert wheel_dir(str(tmp_path), "/src") == ControllerHome.of(tmp_path).wheels == str(tmp_path / "wheels")
    assert wheel_dir(None, "/src") == wheel_dir("", "/src") == "/src/.cache/wheels"


def test_the_drives_reply_address_asks_the_one_loopback_check():
    from layerline import endpoints, pipeline
    assert pipeline.is_loopback is endpoints.is_loopback
    for ep in ("tcp://127.0.0.1:9100", "tcp://[::1]:9100", "tcp://localhost:9100", "tcp://127.2.0.1:1"):
        assert pipeline.reply_host_for(ep) == endpoints.LOOPBACK, ep
    assert endpoints.is_wildcard("0.0.0.0") and endpoints.is_wildcard("[::]") and not endpoints.is_wildcard("::1")


def test_settings_go_back_and_forth_through_the_variables():
    hs = HostSettings.from_vars("w1", {"ansible_connection": "local", "ansible_python_interpreter": "/p",
                                       "layerline_seq": 7, "layerline_drain": "w2,w3", "layerline_slot": 1,
                                       "layerline_objective": {"context": 64}})
    assert HostSettings.from_vars("w1", json.loads(json.dumps(hs.to_vars()))) == hs


def test_the_clusters_drive_reads_the_settings_defaults(tmp_path):
    """Cluster.drive's prompt length, seed and CURVE mode are HostSettings' (no fallbacks of its own)."""
    from layerline import Cluster
    from layerline.spec import host_report
    c = Cluster.from_path(ROOT / "inventory", quiet=True, data_dir=tmp_path / "d")
    assert c._settings("w1") == HostSettings.from_vars("w1", {})
    c._report = {"w1": json.loads(json.dumps(host_report(None, "w1", {"layerline_home": str(tmp_path),
                                                                        "layerline_seq": 5})))}
    hs = c._settings("w1")
    assert (hs.seq, hs.rng_seed, hs.curve, hs.driver_addr) == (5, 0, "auto", None)
    import inspect
    src = inspect.getsource(Cluster)
    assert not re.search(r"\.get\(\"(seq|rng_seed|curve|driver_addr|checkpoint)\"\)", src), "read HostSettings instead"


def test_the_drain_gate_is_decided_in_python():
    from layerline.spec import health_gate
    url = "http://127.0.0.1:8000"
    up = {"engine": True, "stages": [{"name": "w1", "ok": True}, {"name": "w2", "ok": False}]}
    assert health_gate(url, 503, up, ["w2"]) == {"ok": True, "down": ["w2"], "msg": "the pipeline is healthy"}
    bad = health_gate(url, 503, up, [])
    assert not bad["ok"] and bad["msg"].endswith(f"the server at {url} answered 503; stages down: w2")
    assert not health_gate(url, 200, {**up, "engine": False}, ["w2"])["ok"]
    gone = health_gate(url, -1, None, [])
    assert not gone["ok"] and f"nothing answers at {url} (deploy.yml starts the server)" in gone["msg"]
    assert "stages down: none (the engine is not running)" in health_gate(url, 500, {}, [])["msg"]


def test_the_runtime_roles_commands_are_built_in_python():
    from layerline.spec import runtime_install_argv, runtime_spec
    hv = {"ansible_python_interpreter": "/h/python", "layerline_runtime_python": "/r/python"}
    r = runtime_spec("w1", hv, {"pyzmq": "zmq"}, "/c/python", "/roles/layerline_runtime", "/src", "/w")
    assert r.python == r.version_argv[0] == r.missing_argv[0] == "/r/python"
    assert r.build_argv == ("/c/python", "/roles/layerline_runtime/files/build_wheel.py", "/src", "/w")
    assert json.loads(r.missing_argv[-1]) == {"pyzmq": "zmq"}
    assert runtime_install_argv("w1", hv, "/tmp/x/layerline.whl")[:4] == ["/r/python", "-m", "pip", "install"]
    import subprocess
    import sys
    missing = subprocess.run([sys.executable, *r.missing_argv[1:3], json.dumps({"pyzmq": "zmq", "nope-x": "nope_x"})],
                             capture_output=True, text=True, check=True)
    assert json.loads(missing.stdout) == ["nope-x"]
    version = subprocess.run([sys.executable, *r.version_argv[1:]], capture_output=True, text=True, check=True)
    from layerline.version import full
    assert version.stdout.strip() == full()   # the package version and its code's hash


def test_the_discover_modules_worker_port_is_the_settings_default():
    """layerline_discover is self-contained (it imports no layerline); the worker port it gives added hosts
    must be the one HostSettings gives a host without layerline_port."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("ll_discover", ROOT / "modules" / "library" / "layerline_discover.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    documented = yaml.safe_load(mod.DOCUMENTATION)["options"]["worker_port"]["default"]
    import inspect
    assert documented == inspect.signature(mod.discover).parameters["worker_port"].default == \
        HostSettings.from_vars("h", {}).port


def test_one_private_dir_for_keys_state_and_caches(tmp_path):
    """files.ensure_private_dir, which the keys dirs, the state dirs, the probe cache's dir and the server's key
    files' dir all use: parents it makes are private, a wider dir is narrowed, a shared (sticky) dir is refused
    and left as it was, a file in the way is an error, not a loop."""
    import errno

    from layerline import keys
    from layerline.files import ensure_private_dir
    d = tmp_path / "a" / "b"
    assert ensure_private_dir(d) and not ensure_private_dir(d)
    assert {oct(p.stat().st_mode & 0o777) for p in (d, d.parent)} == {"0o700"}
    d.chmod(0o755)
    assert ensure_private_dir(d) and d.stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    for call in (ensure_private_dir, keys.ensure_dir):
        with pytest.raises(OSError, match="is a shared dir .mode 1777.; give a dir of its own"):
            call(str(shared))
    assert shared.stat().st_mode & 0o7777 == 0o1777
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError) as e:
        ensure_private_dir(tmp_path / "file")
    assert e.value.errno == errno.ENOTDIR
