#!/usr/bin/env python3
"""Build layerline's wheel on the controller, offline, from a clean copy of the source.

    build_wheel.py SOURCE OUTDIR       # prints {"wheel": PATH, "version": V} as JSON

SOURCE is the repo (pyproject.toml, README.md, runtime/). The copy leaves out build/,
*.egg-info and __pycache__, so a wheel never carries files that a stale build dir kept.
No index and no build isolation: the controller's own setuptools builds it.
SOURCE "installed" (no checkout: a controller that pip-installed layerline): the distribution
this interpreter has installed is packed back into a wheel from its own RECORD.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata


def repack_installed(outdir: str) -> int:
    """The installed layerline distribution as a wheel: the files its RECORD lists (installer-only files left out)."""
    dist = metadata.distribution("layerline")
    version = dist.version
    files = [f for f in dist.files or [] if not f.name.endswith((".pyc",)) and "__pycache__" not in f.parts
             and f.name not in ("INSTALLER", "REQUESTED", "direct_url.json") and not str(f).startswith("..")]
    if not any(str(f).startswith("layerline/") for f in files):
        print("build_wheel: the installed layerline is not a plain install (an editable one?); "
              "give layerline_runtime_source the checkout it comes from", file=sys.stderr)
        return 1
    dest = os.path.join(outdir, f"layerline-{version}-py3-none-any.whl")
    with zipfile.ZipFile(dest + ".tmp", "w", zipfile.ZIP_DEFLATED) as z:
        for f in files:
            z.write(str(f.locate()), str(f))
    os.chmod(dest + ".tmp", 0o644)
    os.replace(dest + ".tmp", dest)
    print(json.dumps({"wheel": dest, "version": version}))
    return 0


def main(source: str, outdir: str) -> int:
    os.makedirs(outdir, mode=0o755, exist_ok=True)
    if source == "installed":
        return repack_installed(outdir)
    with tempfile.TemporaryDirectory(prefix="layerline-wheel-") as tmp:
        src = os.path.join(tmp, "src")
        os.makedirs(src)
        for name in ("pyproject.toml", "README.md", "setup.cfg", "setup.py"):
            if os.path.exists(os.path.join(source, name)):
                shutil.copy2(os.path.join(source, name), src)
        shutil.copytree(os.path.join(source, "runtime"), os.path.join(src, "runtime"),
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"))
        built = os.path.join(tmp, "out")
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", "-w", built, src], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"build_wheel: pip wheel {source} failed: {(r.stderr or r.stdout).strip()[-2000:]}", file=sys.stderr)
            return 1
        wheels = [w for w in os.listdir(built) if w.startswith("layerline-") and w.endswith(".whl")]
        if len(wheels) != 1:
            print(f"build_wheel: expected one layerline wheel, got {wheels}", file=sys.stderr)
            return 1
        dest = os.path.join(outdir, wheels[0])
        shutil.copyfile(os.path.join(built, wheels[0]), dest + ".tmp")
        os.chmod(dest + ".tmp", 0o644)
        os.replace(dest + ".tmp", dest)
    print(json.dumps({"wheel": dest, "version": wheels[0].split("-")[1]}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: build_wheel.py SOURCE OUTDIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
