"""CURVE keys: making them, laying them out, loading them, and securing sockets with them.

Every worker, driver and server socket runs CURVE (authentication and encryption), loopback
included: a local process without the deployment's keys gets no activations, results or answers
and changes no sequence. Servers let in only clients whose public key is in their allow-list (ZAP).

Files are pyzmq certificates (zmq.auth.create_certificates format): `NAME.key` holds a public
key (mode 0644), `NAME.key_secret` the public and secret key (mode 0600). A host's keys dir
(layerline_keys_dir; the worker's --keys; mode 0700) holds

    self.key, self.key_secret    this host's keypair
    allowed/NAME.key             public keys of everyone who may connect (every host and the controller)
    peers/NAME.key               public keys of the others, so a client knows the server it talks to

and the controller has one of its own (`layerline drive --keys DIR`), named `controller` in
everyone's allowed/ and peers/. The keys role makes every keypair once on the controller, in
a store dir, with this module's command line:

    python -m layerline.keys make --store STORE [--controller-dir DIR] NAME [NAME ...]
    python -m layerline.keys place --dest DIR --name NAME --public '{"NAME": "z85 key", ...}' [--secret-stdin]
    python -m layerline.keys install --store STORE --name NAME --dest DIR [--peer NAME ...]
    python -m layerline.keys local --dest DIR NAME [NAME ...]
    python -m layerline.keys public DIR_OR_FILE

`make` makes the keypairs that are missing (NAME... and `controller`; existing ones are kept)
and, with --controller-dir, lays out the controller's keys dir; `place` lays out the public
half of a host's keys dir and, with --secret-stdin, its keypair read from stdin (the role runs it
on each host, the secret on stdin: never in an argv, a log or a file outside the keys dir);
`install` lays out a whole keys dir from the store (for local stages that share its disk);
`local` does all of it for processes on one machine (DIR/store, DIR/NAME, DIR/controller).
A worker's control socket runs CURVE always, loopback included, and lets in only the key in
its allowed/controller.key (CONTROL_DOMAIN): only the controller may stop or redirect it.
Each prints one JSON object (`changed`, names, public keys) and never a secret.
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import re
import stat
import sys
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

from . import version
from .endpoints import CURVE_MODES, endpoint_host, is_loopback  # noqa: F401 - decided in endpoints, used via keys too
from .errors import LayerlineError
from .files import atomic_write, ensure_private_dir

CONTROLLER = "controller"         # the driver's name in every allowed/ and peers/
CONTROL_DOMAIN = "layerline-control"  # the ZAP domain of a worker's control socket: the controller's key only
SELF = "self"
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,127}$")
KEY_RE = re.compile(rb'^\s*(public|secret)-key\s*=\s*"?([^"\s]{40})"?\s*$')
MAX_ALLOWED = 4096


class KeysError(LayerlineError):
    """Keys that are missing, malformed or readable by others; the text names the file and the fix."""


# --- when CURVE is on -----------------------------------------------------------------------------

def needs_curve(endpoint: str) -> bool:
    """True for every endpoint that is not loopback (a wildcard bind such as tcp://0.0.0.0 or * included):
    where the traffic can be read off the wire. Since loopback runs CURVE too (any local user can
    connect to a loopback port), this no longer decides whether a socket runs CURVE: curve_on does."""
    return not is_loopback(endpoint_host(endpoint))


def curve_on(mode: str, endpoint: str) -> bool:
    """Whether a socket at `endpoint` runs CURVE: always, whatever the mode. `auto` (the default) and
    `on` both mean CURVE on every socket, loopback included: on loopback any local user could
    otherwise use the model without an API key, release or rewind another client's sequence, or
    send results into the server's result socket. `auto` stays a valid value so existing
    inventories and command lines keep working; there is no value that turns CURVE off."""
    if mode not in CURVE_MODES:
        raise KeysError(f"curve: {mode!r} is not one of {', '.join(CURVE_MODES)} "
                        "(CURVE runs on every socket, loopback included; it cannot be turned off)")
    return True


# --- key files ------------------------------------------------------------------------------------

def _z85_ok(key: bytes) -> bool:
    try:
        return len(key) == 40 and len(z85.decode(key)) == 32
    except Exception:  # noqa: BLE001 - any decoding failure means "not a key"
        return False


def public_file(directory: str, name: str) -> str:
    """NAME.key in a store or keys dir: the public key (0644)."""
    return os.path.join(directory, f"{name}.key")


def secret_file(directory: str, name: str = SELF) -> str:
    """NAME.key_secret in a store or keys dir (SELF in a host's keys dir): the keypair (0600)."""
    return os.path.join(directory, f"{name}.key_secret")


def check_name(name: str, field: str = "name") -> str:
    if not isinstance(name, str) or not NAME_RE.match(name) or name == SELF:
        raise KeysError(f"{field}: {str(name)[:60]!r} is not a usable key name (letters, digits, _ . : -; "
                        f"not {SELF!r})")
    return name


def read_key_file(path: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) of one certificate file, both z85."""
    try:
        with open(path, "rb") as f:
            text = f.read(64 * 1024)
    except FileNotFoundError:
        raise KeysError(f"{path}: no such key file; run playbooks/keys.yml to make the keys") from None
    except OSError as e:
        raise KeysError(f"{path}: cannot read ({e.strerror})") from None
    return parse_key_text(text, path)


def parse_key_text(text: bytes, where: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) of a certificate's text, both z85; `where` names it in errors."""
    found: dict[bytes, bytes] = {}
    for line in text.splitlines():
        m = KEY_RE.match(line)
        if m:
            found.setdefault(m.group(1), m.group(2))
    public, secret = found.get(b"public"), found.get(b"secret")
    if public is None or not _z85_ok(public):
        raise KeysError(f"{where}: no valid public-key line (40 z85 characters); re-make it with playbooks/keys.yml")
    if secret is not None and not _z85_ok(secret):
        raise KeysError(f"{where}: the secret-key line is not 40 z85 characters; re-make it with playbooks/keys.yml")
    return public, secret


def _public_text(public: bytes) -> bytes:
    return (b"#   ****  Generated by layerline (pyzmq certificate format)  ****\n"
            b"#   ZeroMQ CURVE Public Certificate\n\nmetadata\ncurve\n"
            b'    public-key = "' + public + b'"\n')


def _secret_text(public: bytes, secret: bytes) -> bytes:
    return (b"#   ****  Generated by layerline (pyzmq certificate format)  ****\n"
            b"#   ZeroMQ CURVE **Secret** Certificate\n"
            b"#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n\nmetadata\ncurve\n"
            b'    public-key = "' + public + b'"\n'
            b'    secret-key = "' + secret + b'"\n')


def _write(path: str, data: bytes, mode: int) -> bool:
    """Write atomically with exactly `mode` (never wider, even for a moment); False when already so."""
    return atomic_write(path, data, mode, if_changed=True)


def ensure_dir(path: str) -> bool:
    """A keys dir of mode 0700 (files.ensure_private_dir: its parents made private too, a shared dir
    refused); True when it changed."""
    if os.path.islink(path):
        raise KeysError(f"{path}: is a symlink; a keys dir must be a real directory")
    return ensure_private_dir(path)


def make_keypair(directory: str, name: str) -> tuple[bytes, bool]:
    """NAME.key (0644) and NAME.key_secret (0600) in `directory` (0700): (public key, made now?).

    An existing keypair is kept (a missing public file is re-derived from the secret), so
    running it again changes nothing.
    """
    check_name(name)
    ensure_dir(directory)
    pub_path, sec_path = public_file(directory, name), secret_file(directory, name)
    made = False
    if os.path.exists(sec_path):
        check_secret_mode(sec_path, fix="then run this again")
        public, secret = read_key_file(sec_path)
        if secret is None:
            raise KeysError(f"{sec_path}: holds no secret-key line; remove it to make a new keypair")
        if zmq.curve_public(secret) != public:
            raise KeysError(f"{sec_path}: its public and secret keys do not belong together; remove it to make "
                            "a new keypair")
    else:
        public, secret = zmq.curve_keypair()
        _write(sec_path, _secret_text(public, secret), 0o600)
        made = True
    made |= _write(pub_path, _public_text(public), 0o644)
    return public, made


def check_secret_mode(path: str, fix: str = "or re-run playbooks/keys.yml") -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise KeysError(f"{path}: no such file; run playbooks/keys.yml to make this host's keys "
                        "(they go to layerline_keys_dir)") from None
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise KeysError(f"{path}: mode {mode:04o} lets other users read this secret key; it must be 0600 "
                        f"(chmod 600 {path}{', ' + fix if fix else ''})")


def check_dir_mode(path: str, field: str = "--keys") -> None:
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise KeysError(f"{field} {path}: mode {mode:04o} lets other users in; it must be 0700 "
                        f"(chmod 700 {path}, or re-run playbooks/keys.yml)")


def load_public_dir(path: str) -> dict[str, bytes]:
    """NAME -> public key for every NAME.key in a dir."""
    out = {}
    for f in sorted(glob.glob(os.path.join(glob.escape(path), "*.key")))[:MAX_ALLOWED]:
        out[os.path.basename(f)[:-4]] = read_key_file(f)[0]
    return out


@dataclass(frozen=True)
class HostKeys:
    """One keys dir, loaded and checked: this host's keypair and the public keys it knows."""
    dir: str
    public: bytes
    secret: bytes = field(repr=False)
    allowed: frozenset = frozenset()          # z85 public keys let in by this host's servers
    peers: dict = field(default_factory=dict)  # name -> z85 public key
    controller: bytes | None = None           # allowed/controller.key: the one key a control socket lets in

    def server_key(self, spec: str | None, field: str = "--next-key", names_only: bool = False) -> bytes:
        """The public key of a server this host connects to: a peer name (peers/NAME.key), or
        (unless names_only) a path to a .key file or the z85 key itself."""
        if not spec:
            raise KeysError(f"{field}: CURVE is on, so name the server's host (its public key is "
                            f"{os.path.join(self.dir, 'peers', 'HOST.key')})")
        if isinstance(spec, str) and NAME_RE.match(spec) and spec in self.peers:
            return self.peers[spec]
        if not names_only and isinstance(spec, str):
            if os.path.isfile(spec):
                return read_key_file(spec)[0]
            if _z85_ok(spec.encode("ascii", "replace")):
                return spec.encode()
        raise KeysError(f"{field}: no public key for {str(spec)[:60]!r} in {os.path.join(self.dir, 'peers')}; "
                        "re-run playbooks/keys.yml so every host has its peers' keys")


HINT = "run playbooks/keys.yml (keys go to layerline_keys_dir) and pass --keys DIR"
LOCAL_HINT = ("run playbooks/keys.yml (keys go to layerline_keys_dir) and pass --keys DIR; for a worker of your own, "
              "`python -m layerline.keys local --dest DIR NAME` makes DIR/NAME (its --keys) and DIR/controller")


PIPELINE_HINT = ("run playbooks/keys.yml and pass the controller's keys dir as --keys (LAYERLINE_HOME/keys/controller; "
                 "the hosts' own keys go to layerline_keys_dir); for local_stages(), local.controller_keys(tmp)")


def load_host_keys(directory: str | None, field: str = "--keys", why: str = "CURVE is on",
                   hint: str = HINT) -> HostKeys:
    """This host's keys dir, refusing anything another user could read or change."""
    if not directory:
        raise KeysError(f"{why}, so it needs this host's keys, but {field} is not set; {hint}")
    if not os.path.isdir(directory):
        raise KeysError(f"{why}, so it needs this host's keys, but {field} {directory} is not a directory; {hint}")
    check_dir_mode(directory, field)
    sec_path = secret_file(directory)
    check_secret_mode(sec_path)
    public, secret = read_key_file(sec_path)
    if secret is None:
        raise KeysError(f"{sec_path}: holds no secret-key line; re-run playbooks/keys.yml")
    if zmq.curve_public(secret) != public:
        raise KeysError(f"{sec_path}: its public and secret keys do not belong together; re-run playbooks/keys.yml")
    subs = {}
    for sub in ("allowed", "peers"):
        p = os.path.join(directory, sub)
        if not os.path.isdir(p):
            raise KeysError(f"{field} {directory}: has no {sub}/ dir; re-run playbooks/keys.yml")
        subs[sub] = load_public_dir(p)
    return HostKeys(dir=directory, public=public, secret=secret, allowed=frozenset(subs["allowed"].values()),
                    peers=subs["peers"], controller=subs["allowed"].get(CONTROLLER))


# --- the store and keys dirs (what the keys role runs) --------------------------------------------

def make_store(store: str, names: list[str]) -> tuple[dict[str, bytes], list[str]]:
    """Keypairs for every name and the controller: (name -> public key, names made now)."""
    if CONTROLLER in names:
        raise KeysError(f"hosts: {CONTROLLER!r} is the controller's key name; rename that inventory host")
    names = list(dict.fromkeys([*names, CONTROLLER]))
    for n in names:
        check_name(n, "hosts")
    ensure_dir(store)
    check_dir_mode(store, "--store")
    public, made = {}, []
    for n in names:
        public[n], m = make_keypair(store, n)
        if m:
            made.append(n)
    return public, made


def place(dest: str, name: str, public: dict[str, bytes | str], secret_text: bytes | None = None) -> bool:
    """The public half of a keys dir: self.key (public[name]), and every key of `public` in
    allowed/ and peers/ (keys not in it removed: they may connect no more); with secret_text (NAME's
    keypair file), self.key_secret too. True when it changed."""
    check_name(name)
    keys = {}
    for n, k in public.items():
        check_name(n, "peer")
        k = k.encode() if isinstance(k, str) else k
        if not _z85_ok(k):
            raise KeysError(f"public[{n!r}]: not a 40-character z85 public key")
        keys[n] = k
    if name not in keys:
        raise KeysError(f"public: has no key for {name!r}, this keys dir's own name")
    secret = None
    if secret_text is not None:
        own, secret = parse_key_text(secret_text, f"{name}'s keypair")
        if secret is None or zmq.curve_public(secret) != own or own != keys[name]:
            raise KeysError(f"{name}'s keypair: its secret key is not the one of public[{name!r}]; re-run "
                            "playbooks/keys.yml (the store's keypair and the public keys it handed out disagree)")
    changed = ensure_dir(dest)
    changed |= _write(os.path.join(dest, f"{SELF}.key"), _public_text(keys[name]), 0o644)
    for sub in ("allowed", "peers"):
        d = os.path.join(dest, sub)
        changed |= ensure_dir(d)
        for n, k in keys.items():
            changed |= _write(os.path.join(d, f"{n}.key"), _public_text(k), 0o644)
        for f in glob.glob(os.path.join(glob.escape(d), "*.key")):
            if os.path.basename(f)[:-4] not in keys:
                os.unlink(f)
                changed = True
    if secret is not None:
        changed |= _write(secret_file(dest), _secret_text(keys[name], secret), 0o600)
    return changed


def install(store: str, name: str, dest: str, peers: list[str]) -> bool:
    """Lay out one whole keys dir from the store: place() of the peers' keys and NAME's keypair."""
    check_name(name)
    pub, sec = read_key_file(secret_file(store, name))
    if sec is None:
        raise KeysError(f"{store}/{name}.key_secret: holds no secret-key line; remove it and run make again")
    public = {p: read_key_file(os.path.join(store, f"{check_name(p, 'peer')}.key"))[0] for p in [name, *peers]}
    return place(dest, name, public, _secret_text(pub, sec))


def local_keys(root: str, names: list[str]) -> dict[str, str]:
    """Keys for processes on this machine that share its disk: a store under root (made once,
    extended by new names) and one whole keys dir per name and for the controller, each listing
    every key in the store. Returns name -> keys dir (`controller` included). Dirs 0700, secrets 0600."""
    store = os.path.join(root, "store")
    make_store(store, [n for n in names if n != CONTROLLER])
    everyone = sorted(load_public_dir(store))
    out = {}
    for name in everyone:
        out[name] = os.path.join(root, name)
        install(store, name, out[name], everyone)
    return out


# --- sockets --------------------------------------------------------------------------------------

def serve_curve(sock: zmq.Socket, keys: HostKeys) -> None:
    """Make a socket a CURVE server (before bind); who may connect is the Allowlist's call. Its
    handshake carries this side's version (layerline.version.stamp)."""
    version.stamp(sock)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)


def serve_control(sock: zmq.Socket, keys: HostKeys) -> None:
    """Make a socket a worker's control socket (before bind): CURVE, and only the controller's key
    gets in (the Allowlist's `control` key, ZAP domain CONTROL_DOMAIN)."""
    serve_curve(sock, keys)
    sock.setsockopt(zmq.ZAP_DOMAIN, CONTROL_DOMAIN.encode())


def connect_curve(sock: zmq.Socket, keys: HostKeys, server_public: bytes) -> None:
    """Make a socket a CURVE client of the server holding `server_public` (before connect). Its
    handshake carries this side's version (layerline.version.stamp)."""
    version.stamp(sock)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)


class Allowlist:
    """The ZAP handler of one zmq context: CURVE clients get in only with a public key from
    allowed/, and on a control socket (serve_control: ZAP domain CONTROL_DOMAIN) only with the
    `control` key (the controller's). Start it before binding any CURVE server socket; stop it
    before ctx.term(). on_deny(key, domain) hears each refused key once."""

    MAX_LOGGED = 64

    def __init__(self, ctx: zmq.Context, allowed, on_deny=None, control: bytes | None = None):
        from zmq.auth.thread import ThreadAuthenticator
        self.allowed = frozenset(allowed)
        self.control = frozenset([control]) if control else frozenset()
        self.on_deny = on_deny
        self.denied: set[tuple] = set()
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("layerline.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(domain="*", credentials_provider=self)
        # a control socket's own domain: without a provider for it, ZAP refuses every client there
        self.auth.configure_curve_callback(domain=CONTROL_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in (self.control if domain == CONTROL_DOMAIN else self.allowed)
        seen = (key, domain)
        if not ok and self.on_deny is not None and seen not in self.denied and len(self.denied) < self.MAX_LOGGED:
            self.denied.add(seen)
            try:
                self.on_deny(key.decode("ascii", "replace"), domain)
            except Exception:  # noqa: BLE001 - logging never breaks authentication
                pass
        return ok

    def stop(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None


# --- command line ---------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerline.keys", description="make and lay out layerline's CURVE keys")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="make missing keypairs in the store (NAMEs and the controller)")
    m.add_argument("--store", required=True, help="the controller's dir of every keypair (0700)")
    m.add_argument("--controller-dir", default=None, help="also lay out the controller's keys dir here")
    m.add_argument("names", nargs="*", metavar="NAME", help="inventory host names")
    i = sub.add_parser("install", help="lay out one keys dir from the store")
    i.add_argument("--store", required=True)
    i.add_argument("--name", required=True, help="whose keypair becomes self.key(_secret)")
    i.add_argument("--dest", required=True, help="the keys dir to lay out (0700)")
    i.add_argument("--peer", action="append", default=None,
                   help="a name whose public key goes to allowed/ and peers/ (default: every key in the store)")
    pl = sub.add_parser("place", help="lay out the public half of a keys dir (self.key, allowed/, peers/)")
    pl.add_argument("--dest", required=True, help="the keys dir (0700)")
    pl.add_argument("--name", required=True, help="this keys dir's own name (its key becomes self.key)")
    pl.add_argument("--public", required=True, help='JSON {"NAME": "z85 public key", ...}: who may connect')
    pl.add_argument("--secret-stdin", action="store_true",
                    help="also write self.key_secret (0600) from NAME's keypair file read on stdin")
    lo = sub.add_parser("local", help="keys for processes on this machine: DEST/NAME per name and DEST/controller")
    lo.add_argument("--dest", required=True, help="the root of the local keys (0700): DEST/store, DEST/NAME")
    lo.add_argument("names", nargs="+", metavar="NAME", help="worker names (their --keys is DEST/NAME)")
    s = sub.add_parser("public", help="the z85 public key of a keys dir or .key file")
    s.add_argument("path")
    a = p.parse_args(argv)
    try:
        if a.cmd == "make":
            public, made = make_store(a.store, a.names)
            changed = bool(made)
            if a.controller_dir:
                changed |= install(a.store, CONTROLLER, a.controller_dir, list(public))
            print(json.dumps({"changed": changed, "made": made,
                              "public": {k: v.decode() for k, v in public.items()}}))
        elif a.cmd == "install":
            peers = a.peer or sorted(load_public_dir(a.store))
            changed = install(a.store, a.name, a.dest, peers)
            print(json.dumps({"changed": changed, "name": a.name, "dest": a.dest, "peers": peers}))
        elif a.cmd == "local":
            dirs = local_keys(a.dest, a.names)
            print(json.dumps({"dest": a.dest, "dirs": dirs}))
        elif a.cmd == "place":
            try:
                public = json.loads(a.public)
                assert isinstance(public, dict)
            except (ValueError, AssertionError):
                raise KeysError('--public: must be a JSON object {"NAME": "z85 public key"}') from None
            secret = sys.stdin.buffer.read(64 * 1024) if a.secret_stdin else None
            changed = place(a.dest, a.name, public, secret)
            print(json.dumps({"changed": changed, "name": a.name, "dest": a.dest, "peers": sorted(public)}))
        else:
            path = os.path.join(a.path, f"{SELF}.key") if os.path.isdir(a.path) else a.path
            print(read_key_file(path)[0].decode())
        return 0
    except (LayerlineError, OSError) as e:
        text = str(e) if isinstance(e, LayerlineError) else f"{getattr(e, 'filename', '') or ''}: {e.strerror}"
        print(f"layerline keys {a.cmd}: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
