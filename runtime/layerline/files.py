"""Files other processes read while we write them: one atomic write for all of layerline.

A reader (the Ansible module, a worker's supervisor, a later run) sees either the old file or
the whole new one, never half of it: the data goes to a private temporary file beside the
target, is flushed to disk, and is renamed over it.
"""
from __future__ import annotations

import errno
import json
import os
import stat


def atomic_write(path: str | os.PathLike, data: bytes | str, mode: int = 0o600, *, if_changed: bool = False) -> bool:
    """Write data to path atomically with this mode; True when the file was written.

    if_changed: leave a file that already holds these bytes with this mode alone (idempotent
    writers such as the keys role report "changed" from this).
    """
    path = os.fspath(path)
    if isinstance(data, str):
        data = data.encode()
    if if_changed:
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == mode:
                with open(path, "rb") as f:
                    if f.read() == data:
                        return False
        except FileNotFoundError:
            pass
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode & 0o600)
    try:
        try:
            os.write(fd, data)
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return True


def atomic_write_json(path: str | os.PathLike, value, mode: int = 0o600, **kw) -> bool:
    return atomic_write(path, json.dumps(value, indent=2, sort_keys=True) + "\n", mode, **kw)


def ensure_private_dir(path: str | os.PathLike) -> bool:
    """A dir of mode 0700: made when missing (the parents it makes are private too), made private again
    when wider (a state or keys dir another run or umask left); True when it changed. A shared dir
    (sticky, as /tmp) is refused, never narrowed."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            ensure_private_dir(parent)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # made meanwhile by a neighbour (local hosts share parents), or not a dir
            if not os.path.isdir(path):
                raise NotADirectoryError(errno.ENOTDIR, f"{path} is not a directory", path) from None
            return ensure_private_dir(path)
        os.chmod(path, 0o700)  # whatever the umask
        return True
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & stat.S_ISVTX:   # /tmp and its like are everyone's: never narrow them
        raise OSError(errno.EPERM, f"{path} is a shared dir (mode {mode:04o}); give a dir of its own")
    if mode != 0o700:
        os.chmod(path, 0o700)
        return True
    return False


def user_cache_dir(env: str, name: str) -> os.PathLike:
    """Where a build of this host's own is cached: $`env` when set, else
    $XDG_CACHE_HOME (or ~/.cache)/layerline/`name`."""
    from pathlib import Path
    d = os.environ.get(env)
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "layerline" / name
