"""The playbooks and roles are the collection layerline.layerline's: they name its modules, filters and roles
by fully qualified names (a user's project resolves nothing else), the checkout's links give a collection's
layout, and deploy.yml's steps carry the tags users select them by."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
FQ = "layerline.layerline."
MODULES = sorted(p.stem for p in (ROOT / "modules" / "library").glob("layerline_*.py"))
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if p.is_dir())
BOOKS = [*sorted((ROOT / "playbooks").rglob("*.yml")), *sorted((ROOT / "roles").rglob("*.yml")),
         *sorted((ROOT / "molecule").rglob("*.yml")), *sorted(ROOT.glob("*.yml"))]


def test_short_names_are_not_used():
    short_module = re.compile(rf"^\s+(?:- )?({'|'.join(MODULES)}):\s*$", re.M)
    short_filter = re.compile(r"\|\s*layerline_[a-z_]+")
    short_role = re.compile(rf"(?:role|name):\s+({'|'.join(ROLES)})\s*$", re.M)
    found = []
    for path in BOOKS:
        text = path.read_text()
        for pattern, what in ((short_module, "module"), (short_filter, "filter"), (short_role, "role")):
            found += [f"{path.relative_to(ROOT)}: {what} {m.group(0).strip()} (write {FQ}NAME)"
                      for m in pattern.finditer(text)]
    assert found == []


def test_the_checkout_is_laid_out_as_the_collection():
    dev = ROOT / "collections" / "ansible_collections" / "layerline" / "layerline"
    assert (dev / "plugins" / "modules").resolve() == (ROOT / "modules" / "library").resolve()
    assert (dev / "plugins" / "filter").resolve() == (ROOT / "modules" / "filter_plugins").resolve()
    assert (dev / "plugins" / "action").resolve() == (ROOT / "modules" / "action_plugins").resolve()
    assert (dev / "plugins" / "plugin_utils").resolve() == (ROOT / "modules" / "plugin_utils").resolve()
    assert (dev / "roles").resolve() == (ROOT / "roles").resolve()
    assert (dev / "playbooks").resolve() == (ROOT / "playbooks").resolve()
    assert "collections_path = collections" in (ROOT / "ansible.cfg").read_text()
    for name in ("deploy", "drain", "teardown"):
        assert (ROOT / "playbooks" / f"{name}.yml").is_file()
        root = yaml.safe_load((ROOT / f"{name}.yml").read_text())
        assert [p["ansible.builtin.import_playbook"] for p in root] == [f"{FQ}{name}"]


def test_deploy_steps_carry_their_tags():
    plays = yaml.safe_load((ROOT / "playbooks" / "deploy.yml").read_text())
    tags = {t for p in plays for t in p.get("tags", [])}
    assert {"discover", "probe", "plan", "stage", "launch", "serve", "drive"} <= tags
    by_play = {p["ansible.builtin.import_playbook"]: set(p["tags"]) for p in plays}
    assert "always" in by_play["discover.yml"]     # hosts it adds are needed by every step
    assert by_play["launch.yml"] == {"launch"} and by_play["drive.yml"] == {"drive"}
