"""Weight staging: a checkpoint dir holding only one stage's tensors, for hosts that do not
share the model's filesystem.

The stage holds the tensors of layers [start, end) plus the embedding on the first stage and the
final norm and head on the last, written by the source checkpoint itself (`Checkpoint.write_stage`,
streamed; layerline.checkpoint.stagefile): from a Hugging Face dir, the full config.json, the text
files and one `model.safetensors` of byte ranges of its files; from a GGUF file, one `model.gguf`
of the file's own blocks copied as byte ranges, with all its metadata and the model's config. A
manifest records where it came from and each file's SHA-1 (what the host checks after transfer,
`install_files`); a stage already made from the same source and range is reused. The controller's
memory grows by a chunk, not by the stage.

A host keeps each stage in a dir of its own under its stage root, named by the layers it holds
(layerline.settings.stage_name): a drain that gives a host new layers stages them beside the ones its
running worker opened, never over them, so a drain that fails leaves that worker's files as they were
(and one of its restarts loads what it ran), and a host whose layers stay opens the stage it has (nothing
is copied twice). Once a change commits (a deploy's server routes through its plan, a drain's switch is
kept), `sweep_stages` removes from the root every stage that plan does not run there.

Shipping (the layerline_stage action, state shipped) runs the module twice a host: before the transfer
(`prune_stage`, `files_to_send`: what the host lacks) and after it (`install_files`, `finish_stage`),
with each file it lacks sent into Ansible's temporary dir on the host in between (no module run a file).

On the host (the layerline_stage module, before the copy) `prune_stage` makes the stage dir hold
nothing but what the current stage lists: a dir that once held another stage, or another model (a
Hugging Face stage's config.json and *.safetensors, then a GGUF's model.gguf), keeps none of it,
and a manifest that no longer describes the dir goes first. `finish_stage` writes the manifest last,
once the files are whole, so a dir with one holds the whole stage it lists (`open_checkpoint` reads
the format and the files from it).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
from pathlib import Path

from .checkpoint import STAGE_MANIFEST as MANIFEST
from .errors import LayerlineError
from .files import atomic_write_json


def _sha1(path: Path) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def _reusable(dest: Path, want: dict) -> dict | None:
    """The manifest of a stage already at `dest` made from the same source and range, else None."""
    try:
        man = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    files = man.get("files") if isinstance(man, dict) else None
    if {k: man.get(k) for k in want} != want or not isinstance(files, dict) or not files:
        return None
    return man if all((dest / f).exists() for f in files) else None


def stage_checkpoint(src: str, start: int, end: int, first: bool, last: bool, out: str) -> dict:
    """Make (or reuse) the stage checkpoint; returns its manifest plus "changed"."""
    from .checkpoint import open_checkpoint   # the controller's: a host's module runs never open a checkpoint
    ck, dest = open_checkpoint(src), Path(out)
    idx = ck.index
    stamp = [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in ck.source_files()]
    # the stage's format too: a stage written in another format by an older layerline is made again
    want = {"source": str(Path(src).resolve()), "stamp": stamp, "layers": [start, end],
            "first": first, "last": last, "format": getattr(ck, "stage_format", "safetensors")}
    man = _reusable(dest, want)
    if man is not None:
        return {**man, "changed": False}
    # torch comes with the loader (seconds of CPU): a stage that is already there does without it,
    # as every deploy after the first one does on each host
    from .model.loader import stage_tensor_names
    names = stage_tensor_names(idx, start, end, first, last)
    tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        sums = ck.write_stage(names, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(p.name for p in tmp.iterdir())
    man = {**want, "tensors": len(names),
           "files": {f: {"bytes": (tmp / f).stat().st_size, "sha1": sums.get(f) or _sha1(tmp / f)} for f in files},
           "bytes": sum((tmp / f).stat().st_size for f in files), "model_bytes": idx.total_bytes,
           "stored_bytes": idx.stored_bytes}
    (tmp / MANIFEST).write_text(json.dumps(man, indent=2))
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return {**man, "changed": True}


def stage_files(manifest: dict) -> list[str]:
    """The file names a stage manifest lists (what the host's stage dir holds besides the manifest)."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        raise LayerlineError("stage manifest: no files listed; make the stage again "
                             "(`layerline stage-checkpoint`, playbooks/stage.yml)")
    bad = [f for f in files if not isinstance(f, str) or f in ("", ".", "..", MANIFEST) or "/" in f]
    if bad:
        raise LayerlineError(f"stage manifest: file name {bad[0]!r} is not a plain file name; make the stage again")
    return sorted(files)


def _stored(manifest: dict) -> dict:
    """The manifest as the stage dir keeps it: without stage_checkpoint's "changed"."""
    return {k: v for k, v in manifest.items() if k != "changed"}


def has_manifest(dest: str | os.PathLike, manifest: dict) -> bool:
    """Whether the stage dir `dest` holds this stage manifest already."""
    try:
        current = json.loads((Path(dest) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return current == _stored(manifest)


def files_to_send(dest: str | os.PathLike, manifest: dict, dry_run: bool = False) -> tuple[dict, list[str]]:
    """The files of the stage `manifest` that the stage dir `dest` lacks: missing, not a regular file,
    or of another size or SHA-1 than listed (name -> its manifest entry); the copy sends only these.
    Those it holds whole are made mode 0600, as the copy leaves a file (not with dry_run): their names
    come second. Asked here once, in the module that prunes the dir, so the copy need not ask each
    file's checksum and mode on the host (two module runs a file; docs/testing.md)."""
    root = Path(dest)
    files = manifest.get("files") or {}
    send, modes = {}, []
    for name in stage_files(manifest):
        entry = files[name] if isinstance(files[name], dict) else {}
        p = root / name
        try:
            st = p.lstat()
        except OSError:
            send[name] = entry
            continue
        if (not stat.S_ISREG(st.st_mode) or ("bytes" in entry and st.st_size != int(entry["bytes"]))
                or entry.get("sha1") != _sha1(p)):
            send[name] = entry
        elif stat.S_IMODE(st.st_mode) != 0o600:
            modes.append(name)
            if not dry_run:
                os.chmod(p, 0o600)
    return send, modes


def prune_stage(dest: str | os.PathLike, manifest: dict, dry_run: bool = False) -> list[str]:
    """Remove from the stage dir `dest` everything the stage `manifest` does not list (files, links and
    dirs: the dir is layerline's), and its manifest when that is not this one (it is shipped again
    once the files are whole). Returns the names removed (that would be, with dry_run), sorted."""
    keep = set(stage_files(manifest))
    root = Path(dest)
    if not root.is_dir():
        return []
    if has_manifest(root, manifest):
        keep.add(MANIFEST)
    return _remove_all_but(root, keep, dry_run)


def sweep_stages(root: str | os.PathLike, keep: list[str], dry_run: bool = False) -> list[str]:
    """Remove from a host's stage root `root` (layerline.settings.HostSettings.stage_root) everything but the
    stage dirs named in `keep` (layerline.settings.stage_name): the stages of layers the plan that now runs
    does not hold there (the slot a committed drain left, a drained host's), and what an older layerline kept
    in the root itself. Returns the names removed (that would be, with dry_run), sorted."""
    bad = [k for k in keep if not isinstance(k, str) or k in ("", ".", "..") or "/" in k]
    if bad:
        raise LayerlineError(f"stage root {root}: {bad[0]!r} is not a stage dir name (layerline.settings.stage_name)")
    base = Path(root)
    if not base.is_dir():
        return []
    return _remove_all_but(base, set(keep), dry_run)


def _remove_all_but(root: Path, keep: set[str], dry_run: bool) -> list[str]:
    """Remove every entry of dir `root` whose name is not in `keep` (a dir with what it holds, a link as a
    link); the names removed (that would be, with dry_run), sorted."""
    gone = sorted(e.name for e in root.iterdir() if e.name not in keep)
    if not dry_run:
        for name in gone:
            p = root / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
    return gone


def install_files(dest: str | os.PathLike, manifest: dict, sent: dict[str, str]) -> int:
    """Move the files `sent` (name -> where its transfer landed on this host) into the stage dir `dest`,
    each checked against the manifest's size and SHA-1 first and made mode 0600 (and this process's
    user's, where the transfer's login user was another); across filesystems
    through a temporary file in `dest` that a failure (a full disk) removes, so the dir never holds part
    of a file under its name. Returns the bytes installed. Raises LayerlineError for a file the manifest
    does not list or one that arrived other than listed; OSError where the dir cannot take a file."""
    root = Path(dest)
    files = manifest.get("files") or {}
    listed = set(stage_files(manifest))
    done = 0
    for name in sorted(sent):
        if name not in listed:
            raise LayerlineError(f"{name}: not a file of this stage ({', '.join(sorted(listed))}); stage again")
        src, entry = Path(sent[name]), files[name] if isinstance(files[name], dict) else {}
        size = src.stat().st_size
        if ("bytes" in entry and size != int(entry["bytes"])) or entry.get("sha1") != _sha1(src):
            raise LayerlineError(f"{root / name}: arrived as {size} bytes with another SHA-1 than the stage lists "
                                 f"({entry.get('bytes')} bytes, {entry.get('sha1')}); run again to send it again")
        os.chmod(src, 0o600)
        if src.stat().st_uid != os.geteuid():   # sent as the login user, installed by become: the runner's, as a copy's
            os.chown(src, os.geteuid(), os.getegid())
        if (root / name).is_dir() and not (root / name).is_symlink():   # a dir in a file's place (files_to_send)
            shutil.rmtree(root / name)
        try:
            os.rename(src, root / name)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            part = root / f".{name}.part-{os.getpid()}"
            try:
                shutil.copyfile(src, part)
                os.chmod(part, 0o600)
                os.replace(part, root / name)
            except BaseException:
                part.unlink(missing_ok=True)
                raise
        done += size
    return done


def finish_stage(dest: str | os.PathLike, manifest: dict) -> bool:
    """Write the stage manifest into the host's stage dir `dest` once every file it lists is there at
    its size (the copy checked their SHA-1); True when it was written (it differed)."""
    root = Path(dest)
    files = manifest.get("files") or {}
    for name in stage_files(manifest):
        want = files[name].get("bytes") if isinstance(files[name], dict) else None
        try:
            size = (root / name).stat().st_size
        except OSError:
            raise LayerlineError(f"{root / name}: missing after the copy; stage again (playbooks/stage.yml)") from None
        if want is not None and size != int(want):
            raise LayerlineError(f"{root / name}: {size} bytes, but the stage lists {want}; stage again "
                                 "(playbooks/stage.yml)")
    return atomic_write_json(root / MANIFEST, _stored(manifest), if_changed=True)


def _cause(result: dict) -> str:
    """What a failed copy said, on one line: the OS error where it names one, else its message, cut short."""
    msg = " ".join(str(result.get("msg") or result.get("module_stderr") or "copy failed").split())
    m = re.search(r"\[Errno [0-9]+\][^'\"]*", msg)
    msg = m.group(0) if m else (msg if len(msg) <= 200 else msg[:197] + "...")
    return msg.strip().rstrip(":;,") or "copy failed"


def copy_failure(host: str, stage_dir: str, stage_bytes: int, copied: object) -> str:
    """The one line naming the host that could not take its stage, why, and the fix; `copied` is what
    the shipping task (layerline_stage, state shipped) registered.

    A copy cut off (the connection, or the copy process on the host, gone mid-transfer: Ansible calls
    the host unreachable) is run again: the files already there whose SHA-1 matches are not sent
    again. Any other failure (a full disk, a dir it may not write) names the OS error and the room
    the stage needs."""
    result = copied if isinstance(copied, dict) else {}
    if result.get("unreachable"):
        return (f"{host}: the copy of its stage ({stage_bytes} bytes) into {stage_dir} was cut off "
                f"({_cause(result)}); run deploy.yml again once the host is up: files already staged there "
                "whose SHA-1 matches are not sent again")
    return (f"{host}: could not write its stage to {stage_dir} ({_cause(result)}); the stage needs "
            f"{stage_bytes} bytes there: free space, or set layerline_stage_dir to a disk with room, and run again")


def parse_range(value: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in value.split(":"))
        assert 0 <= a < b
    except (ValueError, AssertionError):
        raise LayerlineError(f"--layers {value!r}: must be A:B with 0 <= A < B") from None
    return a, b
