#!/usr/bin/env python3
"""The Ansible collection layerline.layerline, built from this checkout.

    scripts/collection.py build [--out DIR]      # prints the tarball's path (make collection)
    scripts/collection.py check TARBALL          # install it into an empty dir; ansible-doc shows every
                                                 # module and filter; ansible-lint's production profile passes

The checkout is the collection already, for development: collections/ansible_collections/layerline/layerline
links modules/library (plugins/modules), modules/action_plugins (plugins/action), modules/plugin_utils
(plugins/plugin_utils, the actions' shared code), modules/filter_plugins (plugins/filter), roles and playbooks into a
collection's layout, and ansible.cfg's collections_path finds it. `build` copies that tree with its links
followed, adds what only the tarball carries -- galaxy.yml with the version from the package metadata
(layerline.version: pyproject.toml), LICENSE, and each filter's documentation (a YAML file beside the
filters, from the function's docstring and signature, which ansible-doc reads) -- and runs
`ansible-galaxy collection build`.

The collection holds the Ansible side only: its modules and filters import the Python package `layerline`,
which the controller needs installed (pip install layerline; the runtime role puts it on the hosts).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "runtime"))
from layerline.version import package_version  # noqa: E402  (the checkout's runtime, on the path above)

NAMESPACE, NAME = "layerline", "layerline"
FQ = f"{NAMESPACE}.{NAME}"
DEV = ROOT / "collections" / "ansible_collections" / NAMESPACE / NAME
BIN = Path(sys.executable).parent


def galaxy(version: str) -> dict:
    """galaxy.yml: the version is the package's; the rest describes the collection."""
    return {
        "namespace": NAMESPACE, "name": NAME, "version": version, "readme": "README.md",
        "authors": ["layerline"],
        "description": "Run one transformer split layer-wise across machines: discover, probe, plan, launch, "
                       "serve, drive, drain (needs the Python package layerline on the controller)",
        "license": ["Apache-2.0"], "license_file": None,
        "tags": ["ai", "inference", "llm", "pipeline", "cluster"],
        "dependencies": {},
        "repository": "https://github.com/layerline/layerline",
        "build_ignore": ["*.pyc", "__pycache__", ".cache"],
    }


def _yaml(value) -> str:
    """Block YAML with lines folded under ansible-lint's limit."""
    import yaml

    class Indented(yaml.SafeDumper):  # list items indented under their key, as yamllint expects
        def increase_indent(self, flow=False, indentless=False):
            return super().increase_indent(flow, False)
    return yaml.dump(value, Dumper=Indented, width=100, sort_keys=False, default_flow_style=False)


def filter_docs(filter_file: Path) -> dict[str, dict]:
    """Each filter's documentation (the DOCUMENTATION/EXAMPLES/RETURN ansible-doc reads from NAME.yml beside
    the filters), from its function's docstring and signature."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"_layerline_filters_{filter_file.stem}", filter_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = {}
    for name, fn in sorted(mod.FilterModule().filters().items()):
        params = list(inspect.signature(fn).parameters.values())
        doc = inspect.getdoc(fn) or ""
        first = doc.split("\n\n")[0].replace("\n", " ").strip()
        short = (first.split(". ")[0].split(": ")[0].rstrip(".") or name)[:120]
        options = {"_input": {"description": f"What the filter reads (the value before the pipe: {params[0].name}).",
                              "type": "raw", "required": True}}
        for p in params[1:]:
            options[p.name] = {"description": f"Argument {p.name} (see the description).", "type": "raw",
                               "required": p.default is inspect.Parameter.empty}
        args = ", ".join(p.name for p in params[1:])
        out[name] = {
            "DOCUMENTATION": {
                "name": name, "author": "layerline", "short_description": short,
                "description": [" ".join(para.split()) for para in (doc or f"The {name} filter.").split("\n\n")
                                if para.strip()],
                "positional": ", ".join(p.name for p in params[1:]) or None,
                "options": options,
            },
            "EXAMPLES": f"# {{{{ {params[0].name} | {FQ}.{name}({args}) }}}}",
            "RETURN": {"_value": {"description": f"What {name} gives (see the description).", "type": "raw"}},
        }
        if out[name]["DOCUMENTATION"]["positional"] is None:
            del out[name]["DOCUMENTATION"]["positional"]
    return out


def build(out: Path) -> Path:
    version = package_version()
    with tempfile.TemporaryDirectory(prefix="layerline-collection-") as tmp:
        src = Path(tmp) / NAME
        shutil.copytree(DEV, src, symlinks=False, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (src / "galaxy.yml").write_text("---\n" + _yaml(galaxy(version)))
        shutil.copy2(ROOT / "LICENSE", src / "LICENSE")
        for f in sorted((src / "plugins" / "filter").glob("*.py")):
            for name, doc in filter_docs(f).items():
                (src / "plugins" / "filter" / f"{name}.yml").write_text("---\n" + _yaml(doc))
        out.mkdir(parents=True, exist_ok=True)
        tarball = out / f"{NAMESPACE}-{NAME}-{version}.tar.gz"
        r = subprocess.run([str(BIN / "ansible-galaxy"), "collection", "build", str(src), "--output-path", str(out),
                            "--force"], capture_output=True, text=True)
        if r.returncode != 0 or not tarball.is_file():
            raise SystemExit(f"ansible-galaxy collection build failed: {(r.stderr or r.stdout).strip()}")
    return tarball


def names(tarball: Path) -> tuple[list[str], list[str]]:
    """The tarball's modules and filters, by their short names."""
    with tarfile.open(tarball) as t:
        files = t.getnames()
    modules = sorted(Path(f).stem for f in files if f.startswith("plugins/modules/") and f.endswith(".py"))
    filters = sorted(Path(f).stem for f in files if f.startswith("plugins/filter/") and f.endswith(".yml"))
    return modules, filters


def install(tarball: Path, into: Path) -> Path:
    """ansible-galaxy collection install into an empty dir; returns the installed collection's dir."""
    r = subprocess.run([str(BIN / "ansible-galaxy"), "collection", "install", str(tarball), "-p", str(into)],
                       capture_output=True, text=True, env=_clean_env(into))
    if r.returncode != 0:
        raise SystemExit(f"ansible-galaxy collection install failed: {(r.stderr or r.stdout).strip()}")
    return into / "ansible_collections" / NAMESPACE / NAME


def _clean_env(collections: Path) -> dict[str, str]:
    """Ansible without this checkout's ansible.cfg: a user's environment, the collection where they put it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_COLLECTIONS_PATH=str(collections), ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0",
               PATH=os.pathsep.join([str(BIN), env.get("PATH", "")]))
    return env


def check(tarball: Path) -> None:
    modules, filters = names(tarball)
    with tempfile.TemporaryDirectory(prefix="layerline-collection-check-") as tmp:
        where = install(tarball, Path(tmp))
        env = _clean_env(Path(tmp))
        for kind, found in (("module", modules), ("filter", filters)):
            r = subprocess.run([str(BIN / "ansible-doc"), "-t", kind, "--json", *[f"{FQ}.{n}" for n in found]],
                               capture_output=True, text=True, env=env, cwd=tmp)
            docs = json.loads(r.stdout or "{}") if r.returncode == 0 else {}
            missing = [n for n in found if not (docs.get(f"{FQ}.{n}") or {}).get("doc")]
            if r.returncode != 0 or missing or not found:
                raise SystemExit(f"ansible-doc -t {kind}: no documentation for {missing or found} "
                                 f"({r.stderr.strip()[-500:]})")
            print(f"ansible-doc: {len(found)} {kind}s documented")
        r = subprocess.run([str(BIN / "ansible-lint"), "--profile", "production", "--nocolor", "--offline"],
                           capture_output=True, text=True, env=env, cwd=where)
        print((r.stdout + r.stderr).strip()[-3000:])
        if r.returncode != 0:
            raise SystemExit("ansible-lint --profile production failed on the installed collection")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/collection.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the collection tarball (prints its path)")
    b.add_argument("--out", type=Path, default=ROOT / ".cache" / "collection")
    c = sub.add_parser("check", help="install the tarball into an empty dir, run ansible-doc and ansible-lint there")
    c.add_argument("tarball", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "build":
        print(build(a.out))
    else:
        check(a.tarball)
    return 0


if __name__ == "__main__":
    sys.exit(main())
