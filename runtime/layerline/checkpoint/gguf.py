"""A GGUF file (llama.cpp's single-file format), read directly with the `gguf` package.

Everything is expressed in the Hugging Face vocabulary the rest of layerline speaks:

- The index comes from the header alone (gguf_header.GGUFHeader memory-maps the file; no tensor
  data is read, and metadata arrays stay views of the map until asked for). Tensors are keyed by
  their HF names (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`) with
  torch-order shapes (GGUF stores dimensions innermost first, ne0 = columns, so they are reversed).
  Each entry's `dtype` is the precision the tensor is dequantized to, and `nbytes` its size at
  that dtype: F32 -> F32, F16 -> F16, BF16 -> BF16, every quantized type (Q8_0, Q4_0, Q4_1, Q4_K,
  Q6_K, ...) -> BF16. The block type, stored bytes and byte range are in `stored_type` /
  `stored_bytes` / `offset`; a file with quantized matrices costs and plans at precision gguf,
  from the stored bytes (layerline.cost).
- The config: a config.json-style dict from the `<arch>.*` metadata keys (a stage file: the whole
  model's, kept as JSON under `STAGE_CONFIG_KEY`).
- `write_stage`: a GGUF stage file of this file's metadata and the stage's tensors' own bytes.
- Tensors are dequantized with `gguf.quants.dequantize`. llama.cpp's converter permutes the rows
  of Q and K (per head, interleaving the two rotary halves for its RoPE); the inverse permutation
  is applied here, so the weights come back in HF's rotate_half layout.
- `row_blocks`: a matrix as float32 blocks of rows, for the loader's int8 (per-row scales) and for
  staging, so no float copy of the whole matrix is made. Q8_0 rows are decoded here from their
  int8 codes and fp16 block scales (exact in float32).
- `int4_codes`: Q4_0, Q4_1 and Q4_K matrices as their stored 4-bit codes with each 32-weight
  group's scale and offset, which is layerline's int4 layout (groups of 32): nothing re-rounded
  but the group's (scale, zero) pair.

Supported: `general.architecture` "llama" (Llama 1/2/3 without rope_freqs, Mistral, SmolLM, ...
as llama.cpp writes them), "qwen2" (q/k/v biases, no permutation), "gemma2" and "gemma3" (no
permutation; norms stored as 1 + weight, read back as HF's weight). A new architecture is a
row of `_ARCHS` and its names in `_LAYER_NAMES`; a new block type needs `gguf.quants` to
dequantize it (or a reader here).
"""
from __future__ import annotations

import json
import math
import re
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Iterable, Iterator

from .. import text
from ..errors import CheckpointError
from .base import ROW_CHUNK_BYTES, Checkpoint, CheckpointIndex, TensorEntry
from .gguf_header import GGUFHeader, GGUFHeaderError
from .stagefile import ByteRanges, GGUFTensorInfo, gguf_kv_string, write_gguf

GGUF_MAGIC = b"GGUF"
STAGE_GGUF = "model.gguf"  # a staged GGUF stage's file in its stage dir
# metadata key of a stage file: the whole model's config, JSON (a stage lacks tensors it is read from)
STAGE_CONFIG_KEY = "layerline.config"
# general.architecture -> the HF class its config names
_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma2": "Gemma2ForCausalLM",
          "gemma3": "Gemma3ForCausalLM"}
_MODEL_TYPES = {"gemma3": "gemma3_text"}  # general.architecture -> config model_type, where they differ
SUPPORTED_ARCHS = tuple(_ARCHS)
_GEMMA = ("gemma2", "gemma3")  # llama.cpp stores Gemma's norm weights as 1 + weight (HF: weight, scaled by 1 + weight)
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
# where an architecture's layer differs from llama's: Gemma's four norms a layer and q/k norms
_GEMMA2_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER_NAMES = {
    "gemma2": _GEMMA2_NAMES,
    "gemma3": {**_GEMMA2_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
}
# llama.cpp's query scale for Gemma: hidden / heads for the 27B models (by layer count), else head_dim
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_PLANNED = {"F32": "F32", "F16": "F16", "BF16": "BF16"}  # anything else (quantized) -> BF16
_PLANNED_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
_TORCH_DTYPE_NAME = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
INT4_DIRECT = ("Q4_0", "Q4_1", "Q4_K")  # block types that are int4 codes in groups of 32 as stored


def has_gguf_magic(path: Path) -> bool:
    """Whether the file starts with GGUF's magic bytes (what open_checkpoint decides by)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor name of `arch` (None when it has no HF counterpart)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def permute_for_gguf(w, n_head: int):
    """llama.cpp's forward permutation (HF rotate_half rows -> GGUF rows): for writing test files."""
    shape = w.shape
    return w.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _unpermute(w, n_head: int):
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf `permute`) along dim 0:
    GGUF rows (head, pair, half) -> HF rows (head, half, pair), i.e. rotate_half order."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _planned(gguf_type: str) -> str:
    return _PLANNED.get(gguf_type, "BF16")


@lru_cache(maxsize=4)
def _reader_cached(path: str, _mtime: float, _size: int):
    """One memory-mapped header per file version, shared by the checkpoints opened on it."""
    try:
        return GGUFHeader(path)
    except (GGUFHeaderError, ValueError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e}); re-download it") from None


class _Meta:
    """The reader's metadata as text.GGUFMeta: values read only when asked for."""

    def __init__(self, reader):
        self.r = reader

    def get(self, key: str, default: Any = None) -> Any:
        f = self.r.get_field(key)
        if f is None:
            return default
        v = f.contents()
        return default if v is None else v

    def array_len(self, key: str) -> int | None:
        f = self.r.get_field(key)
        return None if f is None else len(f)

    def array_item(self, key: str, i: int) -> Any:
        return self.r.get_field(key).contents(i)


class GGUFCheckpoint(Checkpoint):
    """A .gguf file."""

    stage_format = "gguf"  # what write_stage makes (a Hugging Face dir's stages: safetensors)

    @cached_property
    def reader(self):
        try:
            st = self.path.stat()
        except OSError:
            raise CheckpointError(f"{self.path}: no such GGUF file; set layerline_checkpoint to a .gguf file or "
                                  "a Hugging Face model dir") from None
        return _reader_cached(str(self.path.resolve()), st.st_mtime, st.st_size)

    @cached_property
    def meta(self) -> _Meta:
        return _Meta(self.reader)

    @cached_property
    def arch(self) -> str:
        arch = self.meta.get("general.architecture")
        if arch not in _ARCHS:
            raise CheckpointError(f"{self.path}: GGUF architecture {arch!r} is not supported; layerline reads "
                                  f"{', '.join(SUPPORTED_ARCHS)} GGUF files (or give a Hugging Face model dir)")
        return arch

    def file_path(self, entry: TensorEntry) -> Path:
        return self.path

    def source_files(self) -> list[Path]:
        return [self.path]

    # --- header ------------------------------------------------------------------------------------

    @cached_property
    def _tensor_map(self) -> dict[str, Any]:
        """HF name -> the reader's tensor, in file order; unknown tensors refused."""
        out = {}
        for t in self.reader.tensors:
            hf = hf_tensor_name(t.name, self.arch)
            if hf is None:
                if t.name == "rope_freqs.weight":
                    raise CheckpointError(f"{self.path}: has rope_freqs.weight (Llama 3.1-style RoPE scaling), which "
                                          "layerline cannot read from GGUF yet; use the model's Hugging Face dir")
                raise CheckpointError(f"{self.path}: tensor {t.name} has no place in a {self.arch} model "
                                      "as layerline builds it; this GGUF is not a plain model of its architecture")
            out[hf] = t
        return out

    def _read_config(self) -> dict:
        m, arch, path = self.meta, self.arch, self.path
        staged = m.get(STAGE_CONFIG_KEY)
        if staged is not None:  # a stage file: the model's config as the whole file gave it
            try:
                return json.loads(staged)
            except ValueError:
                raise CheckpointError(f"{path}: metadata {STAGE_CONFIG_KEY} is not JSON; stage the checkpoint again") from None
        tensors = {t.name: t for t in self.reader.tensors}

        def need(key):
            v = m.get(f"{arch}.{key}")
            if v is None:
                raise CheckpointError(f"{path}: GGUF metadata {arch}.{key} is missing; the file is incomplete")
            return v

        hidden = int(need("embedding_length"))
        heads = int(need("attention.head_count"))
        kv_heads = m.get(f"{arch}.attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # per-layer counts: layerline needs one
            if len(set(kv_heads)) != 1:
                raise CheckpointError(f"{path}: {arch}.attention.head_count_kv varies per layer; not supported")
            kv_heads = kv_heads[0]
        vocab = m.get(f"{arch}.vocab_size")
        if vocab is None and "token_embd.weight" in tensors:
            vocab = int(tensors["token_embd.weight"].shape[1])
        if vocab is None:
            vocab = m.array_len("tokenizer.ggml.tokens")
        head_dim = m.get(f"{arch}.attention.key_length") or hidden // heads
        cfg = {
            "architectures": [_ARCHS[arch]],
            "model_type": _MODEL_TYPES.get(arch, arch),
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads),
            "head_dim": int(head_dim),
            "hidden_act": "silu",
            "max_position_embeddings": int(m.get(f"{arch}.context_length", 4096)),
            "rms_norm_eps": float(m.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(m.get(f"{arch}.rope.freq_base", 10000.0)),
            "rope_scaling": None,
            "tie_word_embeddings": "output.weight" not in tensors,
            "torch_dtype": _TORCH_DTYPE_NAME.get(_planned(tensors["token_embd.weight"].tensor_type.name)
                                                 if "token_embd.weight" in tensors else "F32", "bfloat16"),
        }
        if arch == "llama":
            cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
            cfg["mlp_bias"] = False
        elif arch in _GEMMA:
            # what llama.cpp assumes for Gemma: Gemma 3 every 6th layer global, the rest over the window
            # with their own RoPE base; Gemma 2 every other layer, soft-capped
            big = cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
            cfg.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                       sliding_window=int(need("attention.sliding_window")),
                       sliding_window_pattern=6 if arch == "gemma3" else 2,
                       query_pre_attn_scalar=hidden // heads if big else int(head_dim), attention_bias=False)
            if arch == "gemma3":
                cfg["rope_local_base_freq"] = float(m.get(f"{arch}.rope.freq_base_swa", 10000.0))
            else:
                cfg.update(attn_logit_softcapping=float(m.get(f"{arch}.attn_logit_softcapping", 50.0)),
                           final_logit_softcapping=float(m.get(f"{arch}.final_logit_softcapping", 30.0)))
        else:  # qwen2: biased q/k/v, no sliding window in GGUF metadata
            cfg.update(use_sliding_window=False, sliding_window=cfg["max_position_embeddings"],
                       max_window_layers=cfg["num_hidden_layers"])
        stype = m.get(f"{arch}.rope.scaling.type")
        if stype == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(m.get(f"{arch}.rope.scaling.factor", 1.0))}
        elif stype not in (None, "none"):
            raise CheckpointError(f"{path}: {arch}.rope.scaling.type {stype!r} is not supported from GGUF")
        for key, meta in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
            v = m.get(f"tokenizer.ggml.{meta}")
            if v is not None:
                cfg[key] = int(v)
        cfg["gguf"] = {"file": path.name, "file_type": m.get("general.file_type"), "name": m.get("general.name")}
        return cfg

    def _read_index(self) -> CheckpointIndex:
        idx = CheckpointIndex(str(self.path), self.config)
        for hf, t in self._tensor_map.items():
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            stype = t.tensor_type.name
            dtype = _planned(stype)
            idx.tensors[hf] = TensorEntry(hf, dtype, shape, self.path.name, math.prod(shape) * _PLANNED_BYTES[dtype],
                                          stored_type=stype, stored_bytes=int(t.n_bytes), offset=int(t.data_offset))
        return idx

    # --- tensors -----------------------------------------------------------------------------------

    def _stored_plus_one(self, name: str) -> bool:
        """Whether the file stores this tensor as 1 + the HF weight (llama.cpp's Gemma norms)."""
        return self.arch in _GEMMA and name.endswith("norm.weight")

    def _q_k_heads(self, name: str) -> int | None:
        """The head count whose row permutation llama.cpp applied to this tensor (llama Q and K), else None."""
        cfg = self.config
        if cfg["model_type"] != "llama":  # llama.cpp permutes Q/K only for its llama architecture
            return None
        if ".self_attn.q_proj." in name:
            return cfg["num_attention_heads"]
        if ".self_attn.k_proj." in name:
            return cfg["num_key_value_heads"]
        return None

    def _tensor(self, name: str):
        t = self._tensor_map.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: tensor {name} is not in this GGUF file")
        return t

    def tensors(self, names: Iterable[str], device: str = "cpu", planned: bool = False) -> Iterator[tuple[str, Any]]:
        """Dequantized to float32 (planned: to the index dtype), HF layout; only these tensors' bytes are read."""
        import numpy as np
        import torch
        from gguf.quants import dequantize

        for name in names:
            t = self._tensor(name)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            try:
                arr = dequantize(np.asarray(t.data), t.tensor_type)
            except NotImplementedError as e:
                raise CheckpointError(f"{self.path}: tensor {t.name} is {t.tensor_type.name}, which the gguf package "
                                      f"cannot dequantize ({e})") from None
            except (ValueError, OSError) as e:
                raise CheckpointError(f"{self.path}: cannot read tensor {t.name} ({e}); the file may be "
                                      "truncated") from None
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            if not arr.flags.writeable:  # an F32 tensor is a view of the read-only map: own a copy
                arr = arr.copy()
            w = torch.from_numpy(arr).reshape(shape)
            n_head = self._q_k_heads(name)
            if n_head:
                w = _unpermute(w, n_head).contiguous()
            if self._stored_plus_one(name):
                w = w - 1
            if device != "cpu":
                w = w.to(device)
            if planned:
                w = w.to(getattr(torch, _TORCH_DTYPE_NAME[self.entry(name).dtype]))
            yield name, w

    def _matrix_rows(self, name: str):
        """(reader tensor, its data as [rows, stored row] (a view of the map), rows, columns) of a matrix."""
        import numpy as np
        t = self._tensor(name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if len(shape) != 2:
            raise CheckpointError(f"{self.path}: tensor {name} has shape {list(shape)}, not a matrix")
        try:
            raw = np.asarray(t.data).reshape(shape[0], -1)
        except ValueError as e:
            raise CheckpointError(f"{self.path}: cannot read tensor {t.name} ({e}); the file may be truncated") from None
        return t, raw, shape[0], shape[1]

    def row_blocks(self, name: str, max_bytes: int = ROW_CHUNK_BYTES) -> Iterator[tuple[int, Any]]:
        """For llama Q and K, whole heads a block (llama.cpp's row permutation stays within a head, so
        each block is unpermuted on its own)."""
        t, raw, n, k = self._matrix_rows(name)
        step = max(1, max_bytes // (4 * k))
        n_head = self._q_k_heads(name)
        if n_head:
            head = n // n_head
            step = max(1, step // head) * head
        for a in range(0, n, step):
            try:
                rows = _float_rows(raw[a:a + step], t.tensor_type)
            except CheckpointError as e:
                raise CheckpointError(f"{self.path}: tensor {t.name}: {e}") from None
            if n_head:
                rows = _unpermute(rows, rows.shape[0] // head).contiguous()
            yield a, rows

    def int4_codes(self, name: str):
        """Q4_0 / Q4_1 / Q4_K matrices as their stored codes, in HF row order: no float weight made."""
        import numpy as np
        import torch

        t, raw, n, k = self._matrix_rows(name)
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
        n_head = self._q_k_heads(name)
        return tuple(_unpermute(x, n_head).contiguous() if n_head else x for x in (codes, s, m))

    def stored_blocks(self, name: str):
        """The matrix's own blocks, read from the map (no float copy), rows in HF order: llama Q/K
        rows un-permuted as whole rows of blocks (each row's blocks are its own, so this is exact)."""
        import numpy as np
        import torch

        from .base import STORED_BLOCK_TYPES  # imported here: this method is the stored-bits work's part of the file
        t, raw, _n, _k = self._matrix_rows(name)
        if t.tensor_type.name not in STORED_BLOCK_TYPES:
            return None
        blocks = torch.from_numpy(np.array(raw, dtype=np.uint8))  # a copy: the map is read-only
        n_head = self._q_k_heads(name)
        if n_head:
            blocks = _unpermute(blocks, n_head).contiguous()
        return blocks, t.tensor_type.name

    # --- staging -----------------------------------------------------------------------------------

    def write_stage(self, names: list[str], out: Path) -> dict[str, str]:
        """A GGUF stage file (`STAGE_GGUF` in dir `out`): every metadata key/value of this file (the
        tokenizer's too) plus the model's config (`STAGE_CONFIG_KEY`: a stage lacks tensors the config
        is read from), and the tensors `names` as this file stores them, copied as byte ranges."""
        r = self.reader
        if r.byte_order == "S":
            raise CheckpointError(f"{self.path}: a big-endian GGUF file; layerline stages little-endian GGUF files only")
        entries = sorted((self.entry(n) for n in names), key=lambda e: e.offset or 0)
        infos = []
        for e in entries:
            t = self._tensor(e.name)
            infos.append(GGUFTensorInfo(e, t.name, tuple(int(d) for d in t.shape), int(t.tensor_type)))
        kv: list = []
        for key, f in r.fields.items():
            if key != STAGE_CONFIG_KEY:
                kv.append(memoryview(r.data[f.offset:f.offset + f.nbytes]))
        kv.append(gguf_kv_string(STAGE_CONFIG_KEY, json.dumps(self.config, sort_keys=True)))
        version = r.version
        with ByteRanges(self.file_path) as src:
            sha1 = write_gguf(out / STAGE_GGUF, version, kv, infos, int(r.alignment), src.copy)
        return {STAGE_GGUF: sha1}

    # --- the text side -----------------------------------------------------------------------------

    def _read_tokenizer(self):
        return text.gguf_tokenizer(self.meta, self.path)

    def _read_chat_template(self) -> str | None:
        return text.gguf_chat_template(self.meta)

    def _read_special_tokens(self) -> dict:
        return text.gguf_special_tokens(self.meta)


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


__all__ = ["GGUF_MAGIC", "STAGE_GGUF", "STAGE_CONFIG_KEY", "SUPPORTED_ARCHS", "INT4_DIRECT", "GGUFCheckpoint", "has_gguf_magic",
           "hf_tensor_name", "permute_for_gguf"]
