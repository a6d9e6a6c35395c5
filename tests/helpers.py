"""Running the project's playbooks the way a user does, from tests."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def ansible_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_FORCE_COLOR="0", ANSIBLE_NOCOLOR="1",
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def playbook(name: str, *args: str, timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "ansible-playbook"), name, *args]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=ansible_env(), capture_output=True, text=True, timeout=timeout)
    # shown with -s (and in a failure's captured output): where an e2e test's time goes
    print(f"[playbook] {name} {' '.join(a for a in args if len(a) < 40)}: {time.perf_counter() - t0:.1f} s, "
          f"rc {r.returncode}")
    if os.environ.get("LAYERLINE_TEST_PLAYBOOK_LOG"):   # a dir: every run's output kept (where a suite's time goes)
        log = Path(os.environ["LAYERLINE_TEST_PLAYBOOK_LOG"])
        log.mkdir(parents=True, exist_ok=True)
        (log / f"{time.time():.3f}-{Path(name).stem}.log").write_text(f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}")
    return r


TESTHOSTS = ROOT / "scripts" / "testhosts.py"


def run_testhosts(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """scripts/testhosts.py (up, down, ...): the multihost tier's network-namespace hosts."""
    return subprocess.run([sys.executable, str(TESTHOSTS), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def nshost_sshd_pid(info: dict, host: str) -> int:
    """The pid of a testhosts host's sshd (`info`: `testhosts.py up --json`'s), in the host's namespaces."""
    return int((Path(info["out"]) / "hosts" / host / "sshd.pid").read_text().split()[0])


def nshost_path(info: dict, host: str, path: str = "/") -> Path:
    """A path as a testhosts host names it (its private /tmp included), seen from here through its sshd's
    /proc root."""
    return Path(f"/proc/{nshost_sshd_pid(info, host)}/root") / path.lstrip("/")


def nshost_settings(info: dict, host: str):
    """The host's layerline settings as a deploy reads them from testhosts' inventory (YAML):
    where its state dirs and stages are is layerline.settings' decision, not a test's."""
    from layerline.settings import HostSettings
    import yaml
    group = yaml.safe_load(Path(info["inventory"]).read_text())["layerline"]
    return HostSettings.from_vars(host, {**group["vars"], **group["hosts"][host]})


def nshost_state_dir(info: dict, home: Path, host: str, slot: int = 0) -> Path:
    """Where a testhosts host's worker in `slot` keeps its state (ready, argv, supervisor), seen from
    here; host "server": the server's, on the controller under layerline_home `home`."""
    if host == "server":
        return home / "state" / "server"
    return nshost_path(info, host, nshost_settings(info, host).state_dir_in(slot))


def nshost_running(info: dict, home: Path, hosts) -> dict[str, int]:
    """Every ready file left, in the hosts' state dirs (both slots) and the server's: name -> pid."""
    from layerline.endpoints import SLOTS
    pids = {}
    for h in hosts:
        for f in (nshost_state_dir(info, home, h, k) / "ready.json" for k in SLOTS):
            if f.exists():
                pids[f"{h}/{f.parent.name}"] = json.loads(f.read_text())["pid"]
    f = nshost_state_dir(info, home, "server") / "ready.json"
    if f.exists():
        pids["server"] = json.loads(f.read_text())["pid"]
    return pids


def remove_testhosts(inventory, extra: str | None, prefix: str, out, work) -> None:
    """What a multihost fixture made goes away, also after a failure: its deployment (teardown.yml, once its
    extra vars were made), its hosts and its work dir; fails when the hosts did not come down."""
    if extra is not None:
        playbook("teardown.yml", "-i", str(inventory), "-e", extra, check=False, timeout=300)
    r = run_testhosts("down", "--prefix", prefix, "--out", str(out), timeout=300)
    shutil.rmtree(work, ignore_errors=True)
    assert r.returncode == 0, f"testhosts down failed: {r.stderr[-2000:]}"


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP counts per host."""
    out = {}
    for m in re.finditer(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$", output, re.M):
        out[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return out


def wait_ready(path: str, proc: subprocess.Popen, log: Path | None = None, timeout: float = 180.0) -> None:
    """Wait for a worker's ready file; fail with its exit status (and log tail) if it dies first."""
    import time
    deadline = time.time() + timeout
    while not os.path.exists(path):
        tail = f": {log.read_text()[-2000:]}" if log is not None else ""
        assert proc.poll() is None, f"worker exited with {proc.returncode}{tail}"
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def chained_greedy(stages, prompt, steps: int, max_len: int = 32):
    """Prefill, then one-token greedy decode steps through chained in-process stages, each with
    its own KV cache; returns the prompt with the `steps` new tokens appended."""
    import torch
    caches = [s.new_cache(batch=prompt.shape[0], max_len=max_len) for s in stages]
    seq, x, pos = prompt, prompt, 0
    for _ in range(steps):
        h = x
        for s, c in zip(stages, caches):
            h = s(h, pos, c, last_only=True)
        pos += x.shape[1]
        x = h[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, x], dim=1)
    assert all(c.length == pos for c in caches)
    return seq


# --- processes ---------------------------------------------------------------------------------------

def alive(pid) -> bool:
    """A live process (zombies count as gone: this machine's init may not reap them)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except (OSError, TypeError):
        return False
    return data[data.rfind(b")") + 2:].split()[0] not in (b"Z", b"X")


def proc_state(pid: int) -> str:
    """Its state letter in /proc: R (running or runnable), S (sleeping), T (stopped), Z, ..."""
    from layerline.supervise import proc_stat
    fields = proc_stat(pid)
    assert fields, f"no process {pid}"
    return fields[0].decode()


def processes_mentioning(text: str) -> list[int]:
    """Live pids whose command line contains text."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if text.encode() in cmdline and alive(entry):
            pids.append(int(entry))
    return pids


def wait_for(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def kill_leftovers(root) -> None:
    """Kill whatever a test left running under root: supervisors first, so nothing gets restarted."""
    import signal
    for _ in range(3):
        pids = processes_mentioning(str(root))
        if not pids:
            break
        supervisors = [p for p in pids if b"layerline.supervise" in Path(f"/proc/{p}/cmdline").read_bytes()]
        for pid in supervisors or pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    assert not processes_mentioning(str(root)), "processes survived the test's cleanup"


def stop_process(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL after timeout seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()



@contextlib.contextmanager
def local_pipeline(checkpoint, stages: int, precision: str, timeout_s: float = 60, **kw):
    """A Pipeline over `stages` local worker processes (layerline.cli.local_stages), stopped and
    their files removed afterwards; kw goes to local_stages (policy, threads, curve, ...)."""
    from layerline.cli import local_stages, stop_local
    from layerline.driver import Pipeline
    from layerline.local import controller_keys
    procs, first, tmp, _ = local_stages(str(checkpoint), stages, precision, **kw)
    try:
        with Pipeline(first, timeout_s=timeout_s, keys_dir=controller_keys(tmp), first_key="stage0") as pipe:
            yield pipe
    finally:
        stop_local(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_writer(out, arch: str, *, layers: int, context: int, hidden: int, ffn: int, heads: int, kv_heads: int,
                rms_eps: float, head_dim: int | None = None, rope_dims: int | None = None,
                rope_base: float | None = None, vocab: int | None = None, **kw):
    """A gguf.GGUFWriter at `out` with the model header llama.cpp's convert script writes for these shapes
    (head_dim: the key and value length; rope_dims: the rotated dims); kw goes to the writer (endianess).
    Tensors, the tokenizer and any family keys are the caller's."""
    import gguf
    w = gguf.GGUFWriter(str(out), arch, **kw)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if rope_dims is not None:
        w.add_rope_dimension_count(rope_dims)
    if rope_base is not None:
        w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(rms_eps)
    if vocab is not None:
        w.add_vocab_size(vocab)
    return w


def llama_gguf_writer(out, cfg: dict):
    """A gguf.GGUFWriter for a llama-architecture file at `out`, its model metadata from a Hugging Face
    config.json dict (what llama.cpp's convert script writes for these keys); tensors and the
    tokenizer are the caller's."""
    w = gguf_writer(out, "llama", layers=cfg["num_hidden_layers"], context=cfg["max_position_embeddings"],
                    hidden=cfg["hidden_size"], ffn=cfg["intermediate_size"], heads=cfg["num_attention_heads"],
                    kv_heads=cfg["num_key_value_heads"], rope_dims=cfg["head_dim"], rope_base=cfg["rope_theta"],
                    rms_eps=cfg["rms_norm_eps"], vocab=cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    return w


def tiny_gguf(hf_dir: Path, out: Path, qtype: str | None = None, embedding: bool = False) -> Path:
    """A Hugging Face demo dir's tensors as a llama GGUF at `out` (F32, or the layers' matrices in the
    block type `qtype` such as "Q8_0", and the token embedding too with `embedding`; the rows not
    permuted: for tests where only the format matters)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from layerline.checkpoint.gguf import hf_tensor_name
    cfg = json.loads((hf_dir / "config.json").read_text())
    w = llama_gguf_writer(out, cfg)
    gguf_of = {hf_tensor_name(g): g for g in ["token_embd.weight", "output_norm.weight", "output.weight"] + [
        f"blk.{n}.{p}.weight" for n in range(cfg["num_hidden_layers"])
        for p in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]}
    for f in sorted(hf_dir.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            a = np.ascontiguousarray(t.float().numpy(), dtype=np.float32)
            if qtype is not None and a.ndim == 2 and (gguf_of[name].startswith("blk.")
                                                      or (embedding and gguf_of[name] == "token_embd.weight")):
                q = gguf.GGMLQuantizationType[qtype]
                w.add_tensor(gguf_of[name], gguf.quants.quantize(a, q), raw_dtype=q)
            else:
                w.add_tensor(gguf_of[name], a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


PHASE_LOG = ROOT / ".cache" / "test-phases.log"


class Phases:
    """Wall time of a long test's phases, printed (shown with -s, and in a failure's captured output):
    `phase = Phases("drain")`, then `phase("w2 drained")` at the end of each phase."""

    def __init__(self, test: str):
        self.test = test
        self.t0 = self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        line = f"[phase] {self.test}: {name}: {now - self.last:.1f} s (at {now - self.t0:.1f} s)"
        print(line)
        # and into PHASE_LOG, which .ci/run prints: a passing test's output is not shown, and a slow
        # phase in CI must be found without a rerun
        PHASE_LOG.parent.mkdir(parents=True, exist_ok=True)
        with open(PHASE_LOG, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        self.last = now


@contextlib.contextmanager
def gguf_read_once():
    """Within it, gguf.GGUFReader (what transformers opens a GGUF file with: for the tokenizer, the config
    and the weights, three times) reads each file once and hands every caller that reader (read-only, a
    memory map); its map a plain array over the same pages, as numpy's memmap subclass made a 262k
    vocabulary's parse 2.9x the CPU (7.7 s against 2.7 s). What transformers makes of the file is
    unchanged. Yields the readers made: (path, mode) -> reader."""
    import gguf
    import numpy as np
    import pytest
    readers: dict = {}
    read, memmap = gguf.GGUFReader, np.memmap

    def once(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            with pytest.MonkeyPatch.context() as plain:
                plain.setattr(np, "memmap", lambda *a, **k: memmap(*a, **k).view(np.ndarray))
                readers[key] = read(path, mode)
        return readers[key]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", once)
        yield readers
