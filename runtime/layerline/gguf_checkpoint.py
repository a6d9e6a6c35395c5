"""GGUF checkpoints (llama.cpp's single-file format), read directly: index, config, tensors, text side.

A `.gguf` path works wherever a Hugging Face checkpoint dir does. Everything is expressed in the
Hugging Face vocabulary the rest of layerline speaks:

- `gguf_index(path)`: the CheckpointIndex, from the GGUF header alone (the `gguf` package's
  GGUFReader memory-maps the file; no tensor data is read). Tensors are keyed by their HF names
  (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`) with torch-order shapes
  (GGUF stores dimensions innermost first, ne0 = columns, so they are reversed).
  Each entry's `dtype` is the precision the tensor is *planned* at once dequantized, and
  `nbytes` its size at that precision: F32 -> F32, F16 -> F16, BF16 -> BF16, every quantized
  type (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, ...) -> BF16. So a quantized file costs and plans as bf16
  (ModelCost.stored_precision "bf16"), which is what its workers hold unless the plan says
  otherwise. The on-disk type and bytes stay in `stored_type` / `stored_bytes`.
- `gguf_config(path)`: a config.json-style dict from the `llama.*` metadata keys.
- `read_tensors(path, names)`: yields (HF name, float32 torch tensor) for only those tensors,
  dequantized with `gguf.quants.dequantize`. llama.cpp's converter permutes the rows of Q and K
  (per head, interleaving the two rotary halves for its RoPE); the inverse permutation is applied
  here, so the weights come back in HF's rotate_half layout.
- `read_row_blocks(path, name)`: a matrix as float32 blocks of rows in HF layout
  (`ROW_CHUNK_BYTES` at most), for the loader's int8 (per-row scales) and for weight staging, so
  no float copy of the whole matrix is made. Q8_0 rows are decoded here from their int8 codes and fp16 block scales
  (exact in float32); the loader re-scales them to one scale per row. That is the same int8 as
  quantizing the dequantized matrix, not Q8_0's own codes: Q8_0 has a scale per 32 weights,
  layerline's int8 one per row (what torch._weight_int8pack_mm takes).
- `read_int4_codes(path, name)`: Q4_0, Q4_1 and Q4_K matrices as their stored 4-bit codes with
  each 32-weight group's scale and offset, which is layerline's int4 layout (`Int4Linear`, groups
  of 32): the loader packs the codes as they are, no float weight made, nothing re-rounded but
  the group's (scale, zero) pair, which int4 holds in bf16.
- `tokenizer_for`, `chat_template_for`, `special_tokens_for`: the text side, for a `.gguf`
  (from `tokenizer.ggml.*` / `tokenizer.chat_template` metadata) and for an HF dir
  (tokenizer.json, tokenizer_config.json, config.json, generation_config.json) alike.
- `write_hf_side_files(path, out)`: config.json, generation_config.json, tokenizer.json and
  tokenizer_config.json of a GGUF, so a staged stage dir is a plain HF checkpoint dir.

Supported: `general.architecture` "llama" (Llama 1/2/3 without rope_freqs, Mistral, SmolLM, ...
as llama.cpp writes them) and "qwen2" (q/k/v biases, no permutation); byte-level BPE tokenizers
(`tokenizer.ggml.model` "gpt2"). SentencePiece ("llama") vocabularies are refused with a clear error.
"""
from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

from .checkpoint import CheckpointError, CheckpointIndex, TensorEntry

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHS = ("llama", "qwen2")
# GGUF tensor name -> HF tensor name; {n} is the layer index
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_PLANNED = {"F32": "F32", "F16": "F16", "BF16": "BF16"}  # anything else (quantized) -> BF16
_PLANNED_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
_TORCH_DTYPE_NAME = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
ROW_CHUNK_BYTES = 8 * 2**20  # float32 bytes decoded at a time when a matrix goes straight to int8
INT4_DIRECT = ("Q4_0", "Q4_1", "Q4_K")  # block types that are int4 codes in groups of 32 as stored

# pre-tokenizer splits (tokenizer.ggml.pre) that differ from GPT-2's; the rest use GPT-2's regex
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
               "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether `path` is a GGUF file (by its magic; a missing file counts by its .gguf suffix)."""
    p = Path(path)
    if p.is_file():
        try:
            with open(p, "rb") as f:
                return f.read(4) == GGUF_MAGIC
        except OSError:
            return False
    return p.suffix.lower() == ".gguf"


# --- reading the header -----------------------------------------------------------------------------

@lru_cache(maxsize=4)
def _reader_cached(path: str, _mtime: float, _size: int):
    from gguf import GGUFReader
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e}); re-download it") from None


def _reader(path: str | os.PathLike):
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        raise CheckpointError(f"{p}: no such GGUF file; set layerline_checkpoint to a .gguf file or "
                              "a Hugging Face model dir") from None
    if not p.is_file():
        raise CheckpointError(f"{p}: not a file")
    return _reader_cached(str(p.resolve()), st.st_mtime, st.st_size)


def _meta(r, key: str, default=None):
    f = r.get_field(key)
    if f is None:
        return default
    v = f.contents()
    return default if v is None else v


def _arch(r, path) -> str:
    arch = _meta(r, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; layerline reads "
                              f"{', '.join(SUPPORTED_ARCHS)} GGUF files (or give a Hugging Face model dir)")
    return arch


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF llama-layout tensor name (None when it has no HF counterpart)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _tensor_map(path) -> dict[str, object]:
    """HF name -> the reader's tensor, in file order; unknown tensors refused."""
    r = _reader(path)
    out = {}
    for t in r.tensors:
        hf = hf_tensor_name(t.name)
        if hf is None:
            if t.name == "rope_freqs.weight":
                raise CheckpointError(f"{path}: has rope_freqs.weight (Llama 3.1-style RoPE scaling), which layerline "
                                      "cannot read from GGUF yet; use the model's Hugging Face dir")
            raise CheckpointError(f"{path}: tensor {t.name} has no place in a Llama-family model; "
                                  "this GGUF is not a plain llama/qwen2 model")
        out[hf] = t
    return out


def gguf_config(path: str | os.PathLike) -> dict:
    """A Hugging Face config.json dict derived from the GGUF metadata."""
    r = _reader(path)
    arch = _arch(r, path)
    tensors = {t.name: t for t in r.tensors}

    def need(key):
        v = _meta(r, f"{arch}.{key}")
        if v is None:
            raise CheckpointError(f"{path}: GGUF metadata {arch}.{key} is missing; the file is incomplete")
        return v

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = _meta(r, f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts: layerline needs one
        if len(set(kv_heads)) != 1:
            raise CheckpointError(f"{path}: {arch}.attention.head_count_kv varies per layer; not supported")
        kv_heads = kv_heads[0]
    tokens_field = r.get_field("tokenizer.ggml.tokens")
    vocab = _meta(r, f"{arch}.vocab_size")
    if vocab is None and "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[1])
    if vocab is None and tokens_field is not None:
        vocab = len(tokens_field.data)
    head_dim = _meta(r, f"{arch}.attention.key_length") or hidden // heads
    cfg = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "max_position_embeddings": int(_meta(r, f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(_meta(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_meta(r, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": _TORCH_DTYPE_NAME.get(_planned(tensors["token_embd.weight"].tensor_type.name)
                                             if "token_embd.weight" in tensors else "F32", "bfloat16"),
    }
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
        cfg["mlp_bias"] = False
    else:  # qwen2: biased q/k/v, no sliding window in GGUF metadata
        cfg.update(use_sliding_window=False, sliding_window=cfg["max_position_embeddings"],
                   max_window_layers=cfg["num_hidden_layers"])
    stype = _meta(r, f"{arch}.rope.scaling.type")
    if stype == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(_meta(r, f"{arch}.rope.scaling.factor", 1.0))}
    elif stype not in (None, "none"):
        raise CheckpointError(f"{path}: {arch}.rope.scaling.type {stype!r} is not supported from GGUF")
    for key, meta in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        v = _meta(r, f"tokenizer.ggml.{meta}")
        if v is not None:
            cfg[key] = int(v)
    cfg["gguf"] = {"file": Path(path).name, "file_type": _meta(r, "general.file_type"),
                   "name": _meta(r, "general.name")}
    return cfg


def _planned(gguf_type: str) -> str:
    return _PLANNED.get(gguf_type, "BF16")


def gguf_index(path: str | os.PathLike) -> CheckpointIndex:
    """The CheckpointIndex of a GGUF file, from its header only (HF names, torch shapes, planned dtypes)."""
    import math
    cfg = gguf_config(path)
    idx = CheckpointIndex(str(path), cfg)
    for hf, t in _tensor_map(path).items():
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        stype = t.tensor_type.name
        dtype = _planned(stype)
        idx.tensors[hf] = TensorEntry(hf, dtype, shape, Path(path).name, math.prod(shape) * _PLANNED_BYTES[dtype],
                                      stored_type=stype, stored_bytes=int(t.n_bytes))
    return idx


# --- tensor data ------------------------------------------------------------------------------------

def _unpermute(w, n_head: int):
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf `permute`) along dim 0:
    GGUF rows (head, pair, half) -> HF rows (head, half, pair), i.e. rotate_half order."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def permute_for_gguf(w, n_head: int):
    """llama.cpp's forward permutation (HF rotate_half rows -> GGUF rows): for writing test files."""
    shape = w.shape
    return w.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _q_k_heads(cfg: dict, name: str) -> int | None:
    """The head count whose row permutation llama.cpp applied to this tensor (llama Q and K), else None."""
    if cfg["model_type"] != "llama":  # llama.cpp permutes Q/K only for its llama architecture
        return None
    if ".self_attn.q_proj." in name:
        return cfg["num_attention_heads"]
    if ".self_attn.k_proj." in name:
        return cfg["num_key_value_heads"]
    return None


def _tensor(path, name: str):
    t = _tensor_map(path).get(name)
    if t is None:
        raise CheckpointError(f"{path}: tensor {name} is not in this GGUF file")
    return t


def read_tensors(path: str | os.PathLike, names: Iterable[str], device: str = "cpu") -> Iterator[tuple[str, object]]:
    """(HF name, float32 torch tensor on `device`) for each of `names`, dequantized, in HF layout.
    Only these tensors' bytes are read (the file is memory-mapped)."""
    import numpy as np
    import torch
    from gguf.quants import dequantize

    cfg = gguf_config(path)
    for name in names:
        t = _tensor(path, name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            arr = dequantize(np.asarray(t.data), t.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(f"{path}: tensor {t.name} is {t.tensor_type.name}, which the gguf package "
                                  f"cannot dequantize ({e})") from None
        except (ValueError, OSError) as e:
            raise CheckpointError(f"{path}: cannot read tensor {t.name} ({e}); the file may be truncated") from None
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not arr.flags.writeable:  # an F32 tensor is a view of the read-only map: own a copy
            arr = arr.copy()
        w = torch.from_numpy(arr).reshape(shape)
        n_head = _q_k_heads(cfg, name)
        if n_head:
            w = _unpermute(w, n_head).contiguous()
        yield name, (w if device == "cpu" else w.to(device))


def _matrix_rows(path, name: str):
    """(reader tensor, its data as [rows, stored row] (a view of the map), rows, columns) of a matrix."""
    import numpy as np
    t = _tensor(path, name)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if len(shape) != 2:
        raise CheckpointError(f"{path}: tensor {name} has shape {list(shape)}, not a matrix")
    try:
        raw = np.asarray(t.data).reshape(shape[0], -1)
    except ValueError as e:
        raise CheckpointError(f"{path}: cannot read tensor {t.name} ({e}); the file may be truncated") from None
    return t, raw, shape[0], shape[1]


def _float_rows(raw, qtype):
    """float32 torch rows [r, K] of a block of stored rows (Q8_0 decoded here: int8 codes times the fp16
    block scale, exact in float32; other types by gguf.quants.dequantize)."""
    import numpy as np
    import torch
    from gguf.quants import dequantize

    r = raw.shape[0]
    if qtype.name == "Q8_0":
        blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(r, -1, 34)  # a copy: the map is read-only
        d = blocks[..., :2].contiguous().view(torch.float16).float()  # [r, blocks, 1]
        return (blocks[..., 2:].contiguous().view(torch.int8).float() * d).reshape(r, -1)
    try:
        out = dequantize(raw, qtype)
    except NotImplementedError as e:
        raise CheckpointError(f"tensor type {qtype.name}: the gguf package cannot dequantize it ({e})") from None
    out = np.ascontiguousarray(out, dtype=np.float32).reshape(r, -1)
    return torch.from_numpy(out if out.flags.writeable else out.copy())  # F32: a view of the read-only map


def read_row_blocks(path: str | os.PathLike, name: str,
                    max_bytes: int = ROW_CHUNK_BYTES) -> Iterator[tuple[int, object]]:
    """(first row, float32 torch rows [r, K]) of matrix `name` in HF layout, a block of rows at a time:
    at most `max_bytes` of float32 and at least one row; for llama Q and K, whole heads (llama.cpp's
    row permutation stays within a head, so each block is unpermuted on its own). int8 from a GGUF
    (`model.quant.quantize_row_blocks`) and GGUF staging read through this, so no float copy of
    the whole matrix is made."""
    t, raw, n, k = _matrix_rows(path, name)
    step = max(1, max_bytes // (4 * k))
    n_head = _q_k_heads(gguf_config(path), name)
    if n_head:
        head = n // n_head
        step = max(1, step // head) * head
    for a in range(0, n, step):
        try:
            rows = _float_rows(raw[a:a + step], t.tensor_type)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: tensor {t.name}: {e}") from None
        if n_head:
            rows = _unpermute(rows, rows.shape[0] // head).contiguous()
        yield a, rows


def to_hf_rows(path: str | os.PathLike, name: str, x):
    """`x` (indexed by the rows of matrix `name` as the file stores them: int4 codes, group scales)
    in HF row order: llama Q and K rows unpermuted, anything else as it is."""
    n_head = _q_k_heads(gguf_config(path), name)
    return _unpermute(x, n_head).contiguous() if n_head else x


def _int4_blocks(raw, qtype):
    """(codes uint8 [r, K] in 0..15, scale float32 [r, K / 32], offset float32 [r, K / 32]) of Q4_0 /
    Q4_1 / Q4_K rows, with weight = code * scale + offset in each group of 32."""
    import numpy as np
    from gguf.quants import Q4_K

    r = raw.shape[0]
    shifts = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    if qtype.name in ("Q4_0", "Q4_1"):
        head = 2 if qtype.name == "Q4_0" else 4
        b = raw.reshape(r, -1, head + 16)
        d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        # low nibbles are weights 0..15 of the block, high nibbles 16..31
        codes = ((b[..., None, head:] >> shifts) & 0x0F).reshape(r, -1)
        m = -8 * d if qtype.name == "Q4_0" else b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return codes, d, m
    # Q4_K: 256-weight super-blocks of eight 32-weight groups: weight = d * sc * code - dmin * mn
    b = raw.reshape(-1, 144)  # 2 (d) + 2 (dmin) + 12 (6-bit scales, mins) + 128 (codes)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(b[:, 4:16])
    # each 32 bytes of codes: low nibbles are one group, high nibbles the next
    codes = ((b[:, 16:].reshape(-1, 4, 1, 32) >> shifts) & 0x0F).reshape(r, -1)
    return codes, (d * sc).reshape(r, -1), (-dmin * mn).reshape(r, -1)


def read_int4_codes(path: str | os.PathLike, name: str):
    """(codes int32 [N, K] in 0..15, scale float32 [N, K / 32], offset float32 [N, K / 32]) of a
    Q4_0 / Q4_1 / Q4_K matrix, weight = code * scale + offset per group of 32, in HF row order: the
    stored codes as they are, no float weight made. None for any other type."""
    import numpy as np
    import torch

    t, raw, n, k = _matrix_rows(path, name)
    if t.tensor_type.name not in INT4_DIRECT:
        return None
    codes = torch.empty(n, k, dtype=torch.int32)
    s = torch.empty(n, k // 32, dtype=torch.float32)
    m = torch.empty(n, k // 32, dtype=torch.float32)
    step = max(1, ROW_CHUNK_BYTES // (4 * k))
    for a in range(0, n, step):
        c, sa, ma = _int4_blocks(raw[a:a + step], t.tensor_type)
        codes[a:a + step] = torch.from_numpy(np.ascontiguousarray(c))
        s[a:a + step], m[a:a + step] = torch.from_numpy(sa), torch.from_numpy(ma)
    return tuple(to_hf_rows(path, name, x) for x in (codes, s, m))


class GGUFTensors:
    """`safetensors.safe_open`'s shape for a GGUF file (a context manager with `get_tensor(name)`,
    float32, HF layout), so the stage loader reads either format through one loop."""

    def __init__(self, path: str | os.PathLike, device: str = "cpu", planned: bool = False):
        self.path, self.device = path, device
        self.dtypes = None
        if planned:  # cast each tensor to its planned dtype (the index's: bf16 for quantized types)
            import torch
            self.dtypes = {n: getattr(torch, _TORCH_DTYPE_NAME[e.dtype]) for n, e in gguf_index(path).tensors.items()}

    def __enter__(self) -> "GGUFTensors":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def keys(self) -> list[str]:
        return list(_tensor_map(self.path))

    def get_tensor(self, name: str):
        t = next(read_tensors(self.path, [name], self.device))[1]
        return t if self.dtypes is None else t.to(self.dtypes[name])


def open_tensors(ckpt: str | os.PathLike, fname: str, device: str = "cpu"):
    """`safe_open(ckpt/fname)` for an HF dir, GGUFTensors for a .gguf file (fname is then its own name;
    tensors come at their planned dtype, as the index lists them): weight staging reads through this."""
    if is_gguf(ckpt):
        return GGUFTensors(ckpt, device, planned=True)
    from safetensors import safe_open
    return safe_open(str(Path(ckpt) / fname), framework="pt", device=device)


# --- text side --------------------------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE's alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _gguf_tokenizer(path):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    r = _reader(path)
    kind = _meta(r, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (layerline builds byte-level "
                              "BPE, 'gpt2', tokenizers from GGUF); give --input-ids, or use the model's HF dir")
    tokens = _meta(r, "tokenizer.ggml.tokens") or []
    merges = _meta(r, "tokenizer.ggml.merges") or []
    types = _meta(r, "tokenizer.ggml.token_type") or []
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    split = _PRE_SPLITS.get(_meta(r, "tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == 3 and set(t) <= alphabet]  # 3: CONTROL
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4]  # USER_DEFINED
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    return tok


def _read_json(path: Path) -> dict:
    try:
        v = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from None
    return v if isinstance(v, dict) else {}


def tokenizer_for(checkpoint: str | os.PathLike):
    """The checkpoint's `tokenizers.Tokenizer`: built from GGUF metadata, or an HF dir's tokenizer.json.
    Raises CheckpointError when there is none."""
    if is_gguf(checkpoint):
        return _gguf_tokenizer(checkpoint)
    path = Path(checkpoint) / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(f"{path}: missing; this checkpoint has no tokenizer, give token ids instead")
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions
        raise CheckpointError(f"{path}: not a tokenizers file ({e})") from None


def chat_template_for(checkpoint: str | os.PathLike) -> str | None:
    """The chat template (jinja source): GGUF `tokenizer.chat_template`, or an HF dir's
    tokenizer_config.json chat_template (the "default" one of a list) / chat_template.jinja."""
    if is_gguf(checkpoint):
        v = _meta(_reader(checkpoint), "tokenizer.chat_template")
        return v if isinstance(v, str) else None
    root = Path(checkpoint)
    template = _read_json(root / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if not isinstance(template, str) and (root / "chat_template.jinja").exists():
        template = (root / "chat_template.jinja").read_text()
    return template if isinstance(template, str) else None


def _token_text(v) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _first_id(v) -> int | None:
    if isinstance(v, list):
        v = v[0] if v else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def special_tokens_for(checkpoint: str | os.PathLike) -> dict:
    """{"bos", "eos", "pad", "unk"} -> {"id": int | None, "text": str | None}, plus "eos_ids" (every
    stop id) and "add_bos" (whether prompts start with BOS), for a GGUF file or an HF dir."""
    out: dict = {}
    if is_gguf(checkpoint):
        r = _reader(checkpoint)
        tokens = r.get_field("tokenizer.ggml.tokens")
        for key, meta in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"),
                          ("unk", "unknown_token_id")):
            i = _meta(r, f"tokenizer.ggml.{meta}")
            known = tokens is not None and i is not None and int(i) < len(tokens.data)
            text = tokens.contents(int(i)) if known else None
            out[key] = {"id": None if i is None else int(i), "text": text}
        eos = {out["eos"]["id"]} - {None}
        eot = _meta(r, "tokenizer.ggml.eot_token_id")
        if eot is not None:
            eos.add(int(eot))
        out["eos_ids"] = sorted(eos)
        out["add_bos"] = bool(_meta(r, "tokenizer.ggml.add_bos_token", False))
        return out
    root = Path(checkpoint)
    cfg, gen = _read_json(root / "config.json"), _read_json(root / "generation_config.json")
    tcfg = _read_json(root / "tokenizer_config.json")
    tok = None
    if (root / "tokenizer.json").exists():
        tok = tokenizer_for(root)
    for key in ("bos", "eos", "pad", "unk"):
        text = _token_text(tcfg.get(f"{key}_token"))
        i = _first_id(gen.get(f"{key}_token_id"))
        if i is None:
            i = _first_id(cfg.get(f"{key}_token_id"))
        if i is None and text is not None and tok is not None:
            i = tok.token_to_id(text)
        if text is None and i is not None and tok is not None:
            text = tok.id_to_token(i)
        out[key] = {"id": i, "text": text}
    eos = set()
    for v in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
        eos |= {x for x in (v if isinstance(v, list) else [v]) if isinstance(x, int) and not isinstance(x, bool)}
    if out["eos"]["id"] is not None:
        eos.add(out["eos"]["id"])
    out["eos_ids"] = sorted(eos)
    out["add_bos"] = bool(tcfg.get("add_bos_token", False))
    return out


def write_hf_side_files(path: str | os.PathLike, out: str | os.PathLike) -> list[str]:
    """Write config.json, generation_config.json, tokenizer.json (when buildable) and
    tokenizer_config.json (chat template, special tokens) of a GGUF into dir `out`; returns the names."""
    out = Path(out)
    cfg = gguf_config(path)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    sp = special_tokens_for(path)
    gen = {k + "_token_id": sp[k]["id"] for k in ("bos", "eos", "pad") if sp[k]["id"] is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    names = ["config.json", "generation_config.json"]
    try:
        tokenizer_for(path).save(str(out / "tokenizer.json"))
        names.append("tokenizer.json")
    except CheckpointError:
        pass
    tcfg = {f"{k}_token": sp[k]["text"] for k in ("bos", "eos", "pad", "unk") if sp[k]["text"] is not None}
    tcfg["add_bos_token"] = sp["add_bos"]
    template = chat_template_for(path)
    if template is not None:
        tcfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    return names + ["tokenizer_config.json"]
