"""The version a host runs, decided here: the package version and a hash of its code.

The package version comes from one place, pyproject.toml's [project] version: a source checkout
(this file under SOURCE/runtime/layerline/, an editable install or runtime/ on PYTHONPATH) reads
SOURCE/pyproject.toml, so a version bumped there counts before the next install; an installed
wheel answers from its metadata (importlib.metadata). `layerline --version`, the collection's
galaxy.yml and `full()` read it.

A host runs the controller's code only when `full()` matches: the package version plus a content
hash of the package's .py and .cpp files, so a host that kept old code after the controller's was
updated differs even when nobody bumped the version. The runtime role compares a host's `full()`
with the controller's (`needs_install`) and reinstalls exactly the hosts that differ; a worker's
argv and the server's name the controller's version (`--layerline-version`), so exactly those
workers, and the server, restart when it changes, and one started on other code refuses to run.

Every ZeroMQ socket carries this side's version and wire protocol in its handshake (`stamp`: ZMTP
metadata, exchanged once per connection inside CURVE's handshake), and every receiver checks the
sender's on what it reads (`mismatch`): a message from a peer on other code gets one line naming
both sides' versions, never a half-understood answer.
"""
from __future__ import annotations

import functools
import hashlib
import os

DISTRIBUTION = "layerline"
# build_wheel.py's SOURCE for "no checkout: repack the distribution this interpreter has installed"
INSTALLED = "installed"


def source_root() -> str | None:
    """The source checkout this package lies in (SOURCE/runtime/layerline/, SOURCE/pyproject.toml naming
    this distribution), or None for an installed wheel."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return root if pyproject_project(os.path.join(root, "pyproject.toml")).get("name") == DISTRIBUTION else None


def pyproject_project(path: str) -> dict:
    """The [project] table of a pyproject.toml ({} where there is none)."""
    import tomllib   # here, not at the top: most imports of layerline never ask the version
    try:
        with open(path, "rb") as f:
            return dict(tomllib.load(f).get("project", {}))
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def package_version() -> str:
    """The source checkout's pyproject.toml version, else the installed distribution's metadata."""
    from importlib import metadata
    root = source_root()
    if root is not None:
        return str(pyproject_project(os.path.join(root, "pyproject.toml"))["version"])
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # copied files without metadata: say so rather than guess
        return "0+unknown"


PROTOCOL = 1                       # the wire protocol (layerline.wire's header "v")
HASH_SUFFIXES = (".py", ".cpp", ".c", ".h")
PROP_VERSION = "X-Layerline-Version"     # ZMTP metadata names (X- is required of application properties)
PROP_PROTOCOL = "X-Layerline-Protocol"
HASH_CHARS = 12


def package_dir() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def content_hash(root: str | None = None) -> str:
    """sha256 over the installed package's code files (relative path and bytes, in sorted order;
    root: the package dir, default this one); the first HASH_CHARS hex digits. Only what a wheel
    carries counts: packages (dirs with __init__.py) and the kernels' csrc/ dirs, so an editable
    install on the controller and the wheel installed on a host hash alike. This process's own
    (no root) is computed once."""
    return _own_hash() if root is None else _hash(root)


@functools.lru_cache(maxsize=1)
def _own_hash() -> str:
    return _hash(package_dir())


def _hash(root: str) -> str:
    h = hashlib.sha256()
    names = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x == "csrc" or os.path.exists(os.path.join(d, x, "__init__.py")))
        names += [os.path.join(d, f) for f in files if f.endswith(HASH_SUFFIXES)]
    for path in sorted(names):
        h.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()[:HASH_CHARS]


@functools.lru_cache(maxsize=1)
def full() -> str:
    """The version this process runs: PACKAGE_VERSION+HASH (e.g. 0.1.0+3f9a0c1b2d4e)."""
    from . import __version__
    return f"{__version__}+{content_hash()}"


def refuse_other(controller: str | None) -> None:
    """--layerline-version's check in a worker or the server: stop, in one line, when this process runs
    other code than the controller that launched it (None: not asked)."""
    if controller and controller != full():
        import sys

        from .errors import LayerlineError
        raise LayerlineError(f"--layerline-version: the controller runs layerline {controller}, this host's "
                             f"{sys.executable} has {full()}; re-run deploy.yml so the runtime role installs the "
                             "controller's version here")


def describe(version: str | None, protocol: str | int | None) -> str:
    return f"layerline {version or 'unknown (older than version checks)'} (wire protocol {protocol or '?'})"


def needs_install(found_rc: int, found: str, controller: str) -> bool:
    """The runtime role's decision for one host: reinstall unless its interpreter printed exactly the
    controller's full() version (a host without layerline, or one too old to print it, fails the
    command: rc != 0)."""
    return int(found_rc) != 0 or str(found).strip() != str(controller).strip()


def stamp(sock) -> None:
    """Put this side's version and wire protocol into a ZeroMQ socket's handshake (before bind or
    connect): every peer reads them from the messages of that connection."""
    import zmq
    sock.setsockopt(zmq.METADATA, f"{PROP_VERSION}:{full()}".encode())
    sock.setsockopt(zmq.METADATA, f"{PROP_PROTOCOL}:{PROTOCOL}".encode())


def peer_of(frame) -> tuple[str | None, str | None]:
    """(version, protocol) the sender of a received zmq.Frame stamped on its connection (None, None: none)."""
    try:
        return frame.get(PROP_VERSION), frame.get(PROP_PROTOCOL)
    except Exception:  # noqa: BLE001 - a frame without connection metadata (inproc, copied)
        return None, None


def mismatch(frame, peer: str, here: str) -> str | None:
    """One line naming both sides' versions when the sender of `frame` runs other code than this
    process (None when they match). peer / here: who each side is (a host, an endpoint)."""
    v, p = peer_of(frame)
    if v == full() and p == str(PROTOCOL):
        return None
    return (f"version mismatch: {peer} runs {describe(v, p)}, {here} runs {describe(full(), PROTOCOL)}; "
            "re-run deploy.yml so every host gets the controller's layerline (the runtime role reinstalls and "
            "restarts the hosts that differ)")
