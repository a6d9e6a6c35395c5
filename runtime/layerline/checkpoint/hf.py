"""A Hugging Face model dir: config.json and *.safetensors (one file or sharded), plus its text files.

The index is read from the safetensors headers alone (8-byte length + JSON), so planning a
100 GB model costs a few kilobytes of reads; tensors through safetensors' memory-mapped reader.
"""
from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path
from typing import Iterable, Iterator

from safetensors import safe_open

from .. import text
from ..errors import CheckpointError
from .base import (DTYPE_BYTES, LAYER_RE, ROW_CHUNK_BYTES, STAGE_MANIFEST, SUPPORTED_MODEL_TYPES, Checkpoint,
                   CheckpointIndex, TensorEntry)
from .demo import demo_tensor_shapes
from .stagefile import ByteRanges, write_safetensors

MAX_HEADER_BYTES = 100 * 2**20
# the text files a stage dir carries over from its source dir
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json")
_TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def read_safetensors_header(path: str | Path) -> dict:
    """The JSON header of one .safetensors file, validated for size."""
    return _read_header(path)[0]


def _read_header(path: str | Path) -> tuple[dict, int]:
    """The JSON header of one .safetensors file, validated for size, and where its data starts
    (the 8-byte length plus the header's bytes)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: safetensors header of {n} bytes is over the {MAX_HEADER_BYTES} limit")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + n


def _entries_of(path: Path) -> tuple[list[TensorEntry], int]:
    """The file's tensors, and the byte where their data ends."""
    header, base = _read_header(path)
    out, end_max = [], base
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = meta["dtype"], tuple(int(d) for d in meta["shape"])
            start, end = (int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry ({e})") from e
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        if end - start != nbytes:
            raise CheckpointError(f"{path}: tensor {name!r} spans {end - start} bytes but its shape needs {nbytes}")
        out.append(TensorEntry(name, dtype, shape, path.name, nbytes, stored_type=dtype, stored_bytes=nbytes,
                               offset=base + start))
        end_max = max(end_max, base + end)
    return out, end_max


def read_dir_config(root: Path) -> dict:
    p = root / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{p}: missing; layerline_checkpoint must be a Hugging Face model dir "
                              "(make one with `layerline demo-checkpoint DIR`)") from None
    except ValueError as e:
        raise CheckpointError(f"{p}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{p}: not a JSON object")
    return cfg


def drop_nulls(cfg: dict) -> dict:
    """cfg without the keys saved as null, in nested objects too: transformers writes a key it
    fills in at load (`head_dim: null` is hidden / heads) as null, which means "the default",
    the same as leaving the key out."""
    return {k: drop_nulls(v) if isinstance(v, dict) else v for k, v in cfg.items() if v is not None}


def _staged_range(root: Path) -> tuple[int, int, bool] | None:
    """(start, end, first) of a staged checkpoint, else None (the whole model)."""
    try:
        man = json.loads((root / STAGE_MANIFEST).read_text())
        a, b = man["layers"]
        return int(a), int(b), bool(man.get("first"))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{root / STAGE_MANIFEST}: not a stage manifest ({e}); stage the checkpoint "
                              "again (playbooks/stage.yml)") from None


def _config_int(cfg: dict, key: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise CheckpointError(f"config.json: {key} is {'missing' if key not in cfg else repr(v)}; "
                              "it must be a positive integer")
    return v


def check_index(idx: CheckpointIndex, staged: tuple[int, int, bool] | None = None) -> None:
    """A Hugging Face checkpoint's config and tensors agree: a supported family, the keys the
    model needs, every layer's tensors (a staged one: its range's) with the shapes the config
    gives (headers only)."""
    cfg = drop_nulls(idx.config)  # a key saved as null means its default
    mtype = cfg.get("model_type", "llama")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"config.json: model_type {mtype!r} is not supported; layerline runs "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
    h, heads = _config_int(cfg, "hidden_size"), _config_int(cfg, "num_attention_heads")
    want = dict(cfg, hidden_size=h, num_attention_heads=heads,
                num_hidden_layers=_config_int(cfg, "num_hidden_layers"),
                intermediate_size=_config_int(cfg, "intermediate_size"), vocab_size=_config_int(cfg, "vocab_size"),
                num_key_value_heads=_config_int(cfg, "num_key_value_heads", heads),
                head_dim=_config_int(cfg, "head_dim", 256 if mtype in ("gemma2", "gemma3_text")  # as transformers
                                     else h // heads if h % heads == 0 else None))
    if mtype == "mixtral":
        want["num_local_experts"] = _config_int(cfg, "num_local_experts")
    layers = want["num_hidden_layers"]
    beyond = sorted({t.layer for t in idx.tensors.values() if t.layer is not None and t.layer >= layers})
    if beyond:
        raise CheckpointError(f"{idx.path}: the weights hold layer {beyond[-1]} but config.json num_hidden_layers "
                              f"is {layers}; the config and the weights are of different models")
    for name, shape in _fused(demo_tensor_shapes(want)) if mtype == "phi3" else demo_tensor_shapes(want):
        t = idx.tensors.get(name)
        if t is None:
            m = LAYER_RE.match(name)
            needed = (staged[0] <= int(m.group(1)) < staged[1]) if m and staged else \
                (bool(m) or (name == "model.embed_tokens.weight" and (staged is None or staged[2])))
            if needed:
                raise CheckpointError(f"{idx.path}: tensor {name} is missing (config.json num_hidden_layers "
                                      f"{layers}); the checkpoint is incomplete")
            continue   # lm_head / final norm: tie_word_embeddings defaults differ between families
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{idx.path}: tensor {name} has shape {list(t.shape)} but config.json gives "
                                  f"{list(shape)}; the config and the weights are of different models")


def _fused(shapes: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """Phi-3's names: q/k/v as one qkv_proj, gate/up as one gate_up_proj (rows stacked)."""
    out, rows = [], {}
    for name, shape in shapes:
        for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            part = next((x for x in parts if f".{x}.weight" in name), None)
            if part is not None:
                key = name.replace(part, fused)
                rows[key] = rows.get(key, 0) + shape[0]
                if part == parts[-1]:
                    out.append((key, (rows[key], shape[1])))
                break
        else:
            out.append((name, shape))
    return out


class HFCheckpoint(Checkpoint):
    """A Hugging Face model dir. check: the index also refuses a dir whose files are cut short or whose
    config and tensors disagree (`check_index`)."""

    def __init__(self, path: Path, check: bool = True, only: list[str] | None = None):
        super().__init__(path)
        self.check = check
        self.only = only  # a stage dir: the files its manifest lists, whatever else lies there
        self._handles: dict[tuple[str, str], object] = {}  # (file, device) -> safe_open handle

    def _read_config(self) -> dict:
        return read_dir_config(self.path)

    def source_files(self) -> list[Path]:
        if self.only is not None:
            return sorted(self.path / f for f in self.only if f.endswith(".safetensors"))
        return sorted(self.path.glob("*.safetensors"))

    def _read_index(self) -> CheckpointIndex:
        root = self.path
        config = self.config
        files = self.source_files()
        if not files:
            raise CheckpointError(f"{root}: holds no *.safetensors files")
        idx = CheckpointIndex(str(root), config)
        for f in files:
            size = f.stat().st_size
            entries, data_end = _entries_of(f)
            for e in entries:
                if e.name in idx.tensors:
                    raise CheckpointError(f"{root}: tensor {e.name!r} appears in both {idx.tensors[e.name].file} "
                                          f"and {f.name}")
                idx.tensors[e.name] = e
            if self.check and data_end > size:
                raise CheckpointError(f"{f}: truncated: its header places tensor data up to byte {data_end} but "
                                      f"the file has {size} bytes; copy or download it again")
        if self.check:
            check_index(idx, _staged_range(root))
        return idx

    # --- tensors -----------------------------------------------------------------------------------

    def _open(self, entry: TensorEntry, device: str):
        key = (entry.file, device)
        f = self._handles.get(key)
        if f is None:
            f = self._handles[key] = safe_open(str(self.file_path(entry)), framework="pt", device=device)
        return f

    def close(self) -> None:
        self._handles.clear()  # safe_open handles unmap when dropped

    def tensors(self, names: Iterable[str], device: str = "cpu", planned: bool = False) -> Iterator[tuple[str, object]]:
        for name in names:  # safetensors tensors are at their planned dtype already
            yield name, self._open(self.entry(name), device).get_tensor(name)

    def row_blocks(self, name: str, max_bytes: int = ROW_CHUNK_BYTES) -> Iterator[tuple[int, object]]:
        e = self.entry(name)
        if len(e.shape) != 2:
            raise CheckpointError(f"{self.path}: tensor {name} has shape {list(e.shape)}, not a matrix")
        n, k = e.shape
        step = max(1, max_bytes // (4 * k))
        rows = self._open(e, "cpu").get_slice(name)
        for a in range(0, n, step):
            yield a, rows[a:a + step].float()

    # --- staging -----------------------------------------------------------------------------------

    def write_stage(self, names: list[str], out: Path) -> dict[str, str]:
        """Each tensor's bytes copied as a byte range of its source file; the text files copied."""
        entries = [self.entry(n) for n in names]
        with ByteRanges(self.file_path) as src:
            model = write_safetensors(out / "model.safetensors", entries, src.copy)
        for side in SIDE_FILES:
            if (self.path / side).exists():
                shutil.copy2(self.path / side, out / side)
        return {"model.safetensors": model}

    # --- the text side -----------------------------------------------------------------------------

    def _read_tokenizer(self):
        return text.dir_tokenizer(self.path)

    def _read_chat_template(self) -> str | None:
        return text.dir_chat_template(self.path)

    def _read_special_tokens(self) -> dict:
        return text.dir_special_tokens(self.path, self.tokenizer)
