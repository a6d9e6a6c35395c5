"""API keys: Bearer tokens from a 0600 file, one key per line, compared in constant time; a file made
once with a new random key (ensure_key_file: the server role's admin and API keys, never logged)."""
from __future__ import annotations

import hmac
import os
import secrets
import stat
import string

from ..endpoints import is_loopback  # noqa: F401 - the one definition (server/cli imports it from here)
from ..errors import LayerlineError
from ..files import atomic_write

KEY_ALPHABET = string.ascii_letters + string.digits
KEY_LENGTH = 48


def new_key() -> str:
    """A random Bearer key (48 letters and digits: about 285 bits)."""
    return "".join(secrets.choice(KEY_ALPHABET) for _ in range(KEY_LENGTH))


def ensure_key_file(path: str) -> bool:
    """A key file at path: kept when it holds a key (its mode made 0600), else written atomically (0600) with
    a new key, its dir made 0700. True when anything changed. The key is never returned."""
    changed = False
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        os.makedirs(d, mode=0o700, exist_ok=True)
        changed = True
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


def check(keys: list[bytes], authorization: str | None) -> bool:
    """Whether an Authorization header carries one of the keys (every key compared: no early exit)."""
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
