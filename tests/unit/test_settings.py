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
    for name, f in by_var.items():
        if role not in f.metadata["roles"]:
            assert name not in specs, f"roles/{role} takes {name}: add the role to its field's roles in HostSettings"
            continue
        assert name in specs, f"roles/{role}: argument spec lacks {name} (HostSettings says the role takes it)"
        assert specs[name]["type"] in SPEC_TYPES[str(f.type)], f"roles/{role}: {name} type {specs[name]['type']}"
        if name in defaults:
            d = defaults[name]
            if isinstance(d, str) and "{{" in d:   # derived from Ansible's facts (an interpreter)
                assert f.default is None, f"roles/{role}: {name} defaults to a template, HostSettings to {f.default!r}"
            else:
                assert d == f.default, f"roles/{role}: {name} defaults to {d!r}, HostSettings to {f.default!r}"


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
}


def test_playbooks_and_roles_decide_nothing_python_decides():
    books = [ROOT / "deploy.yml", ROOT / "drain.yml", ROOT / "teardown.yml", *sorted((ROOT / "playbooks").glob("*.yml")),
             *sorted((ROOT / "roles").glob("*/tasks/*.yml")), *sorted((ROOT / "roles").glob("*/defaults/*.yml"))]
    found = []
    for path in books:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
            for pattern, home in DECIDED_IN_PYTHON.items():
                if re.search(pattern, code):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {home}: {line.strip()}")
    assert not found, "\n".join(found)
