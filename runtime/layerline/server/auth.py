"""API keys: Bearer tokens from a 0600 file, one key per line, compared in constant time; a file made
once with a new random key (ensure_key_file: the server role's admin and API keys, never logged).

A running server holds its key files as KeyFile objects: every check stats the file and reads it again
when its inode, size or mtime changed (and on SIGHUP: KeyFile.reload), so a key added to or removed from
the file counts from the next request on, without a restart. A file that cannot be read meanwhile (half
written, loose mode, empty) leaves the keys read last in force, with one line in the server's log.
The admin routes (/admin/...) answer only over TLS or from this machine (admin_reachable)."""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import secrets
import stat
import string

from ..endpoints import is_loopback  # noqa: F401 - the one definition (server/cli imports it from here)
from ..errors import LayerlineError
from ..files import atomic_write, ensure_private_dir

log = logging.getLogger("layerline.server")

KEY_ALPHABET = string.ascii_letters + string.digits
KEY_LENGTH = 48


def new_key() -> str:
    """A random Bearer key (48 letters and digits: about 285 bits)."""
    return "".join(secrets.choice(KEY_ALPHABET) for _ in range(KEY_LENGTH))


def ensure_key_file(path: str) -> bool:
    """A key file at path: kept when it holds a key (its mode made 0600), else written atomically (0600) with
    a new key, its dir made (or kept) 0700. True when anything changed. The key is never returned."""
    changed = ensure_private_dir(os.path.dirname(os.path.abspath(path)))
    try:
        st = os.stat(path)
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.chmod(path, 0o600)
            changed = True
        load_keys(path)
        return changed
    except FileNotFoundError:
        pass
    except LayerlineError:   # empty, or no key in it: a new one
        pass
    atomic_write(path, new_key() + "\n", 0o600)
    return True


def load_keys(path: str, flag: str = "--api-keys") -> list[bytes]:
    """The keys in path (blank lines and # comments skipped). Refuses a file others may read."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise LayerlineError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise LayerlineError(f"{flag} {path}: mode {stat.S_IMODE(st.st_mode):04o} lets group or others read "
                             f"it; run chmod 600 {path}")
    try:
        with open(path, encoding="utf-8") as f:
            keys = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    except (OSError, UnicodeDecodeError) as e:
        raise LayerlineError(f"{flag} {path}: cannot read it ({e})") from None
    if not keys:
        raise LayerlineError(f"{flag} {path}: holds no key (one key per line)")
    return [k.encode() for k in keys]


class KeyFile:
    """The keys of a file as they are now: read at start (a bad file fails the start, load_keys' line), then
    again whenever the file changed (stat per check: inode, size, mtime) or reload() is called (SIGHUP)."""

    def __init__(self, path: str, flag: str = "--api-keys"):
        self.path, self.flag = path, flag
        self._stamp = self._stat()
        self._keys = load_keys(path, flag)

    def _stat(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_mode

    def reload(self, force: bool = True) -> bool:
        """Read the file again (when it changed, unless force); True when the keys in force changed. A file
        that cannot be read keeps the keys read last (one warning naming the file and the fix)."""
        stamp = self._stat()
        if not force and stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            keys = load_keys(self.path, self.flag)
        except LayerlineError as e:
            log.warning("%s (the %d key(s) read before stay in force)", e, len(self._keys))
            return False
        changed = keys != self._keys
        if changed:
            log.warning("%s %s: read again, %d key(s) in force", self.flag, self.path, len(keys))
        self._keys = keys
        return changed

    def current(self) -> list[bytes]:
        self.reload(force=False)
        return self._keys

    def __bool__(self) -> bool:
        return True


def check(keys: "list[bytes] | KeyFile", authorization: str | None) -> bool:
    """Whether an Authorization header carries one of the keys (every key compared: no early exit); a
    KeyFile is read again first when its file changed."""
    if isinstance(keys, KeyFile):
        keys = keys.current()
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    got = token.strip().encode()
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(got, k)
    return ok


def admin_reachable(client: str | None, local: str | None, tls: bool) -> str | None:
    """Whether a request may reach the admin routes: over TLS (the key still checked), or from this machine
    (a loopback client, or one whose address is the one it connected to). None when it may, else why not."""
    if tls:
        return None
    if client and (is_loopback(client) or client == local):
        return None
    try:
        ipaddress.ip_address(client or "")
    except ValueError:
        return None   # a unix socket or a test client: no network peer to keep out
    return ("the admin routes answer only from the server's own machine or over TLS: call them there "
            "(the playbooks do), or give the server a certificate (layerline_serve_tls_cert, _key)")
