"""API keys: Bearer tokens from a 0600 file, one key per line, compared in constant time."""
from __future__ import annotations

import hmac
import os
import stat

from ..endpoints import is_loopback  # noqa: F401 - the one definition (server/cli imports it from here)
from ..errors import LayerlineError


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
