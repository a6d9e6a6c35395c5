"""A checkpoint's text side: tokenizer, chat template and special tokens, from either format.

- A Hugging Face dir: tokenizer.json, tokenizer_config.json (chat template, token texts,
  add_bos_token), chat_template.jinja, config.json and generation_config.json (token ids).
- A GGUF file: the `tokenizer.*` metadata, read through `GGUFMeta` (what the checkpoint's GGUF
  reader offers), from which a `tokenizers.Tokenizer` is built.

The checkpoint objects (layerline.checkpoint) call these; nothing here knows how a file was
recognised. A new GGUF vocabulary type (SentencePiece, ...) is added in `gguf_tokenizer`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from .errors import CheckpointError

# pre-tokenizer splits (tokenizer.ggml.pre) that differ from GPT-2's; the rest use GPT-2's regex
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
               "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


class GGUFMeta(Protocol):
    """A GGUF file's metadata, as the checkpoint reads it."""

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `key` (a list for an array), `default` when the key is absent."""
        ...

    def array_len(self, key: str) -> int | None:
        """The length of array `key` without reading it, None when absent."""
        ...

    def array_item(self, key: str, i: int) -> Any:
        """Item i of array `key`, without reading the rest."""
        ...


# --- GGUF ------------------------------------------------------------------------------------------

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


def gguf_tokenizer(meta: GGUFMeta, where: str | Path):
    """The `tokenizers.Tokenizer` a GGUF's metadata describes; None when it holds no vocabulary.
    Raises CheckpointError for a vocabulary type layerline cannot build yet."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind == "llama":
        return _sentencepiece_tokenizer(meta)
    if kind != "gpt2":
        raise CheckpointError(f"{where}: tokenizer.ggml.model {kind!r} is not supported (layerline builds byte-level "
                              "BPE, 'gpt2', and SentencePiece, 'llama', tokenizers from GGUF); give --input-ids, "
                              "or use the model's HF dir")
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    tokens = meta.get("tokenizer.ggml.tokens") or []
    merges = meta.get("tokenizer.ggml.merges") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    return tok


def _merges_of(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (transformers' `generate_merges`): every
    split of a token into two tokens, best score first, ties by the pieces' lengths then ids."""
    merges = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _sentencepiece_tokenizer(meta: GGUFMeta):
    """A SentencePiece vocabulary (tokenizer.ggml.model "llama": tokens, scores, token types) as the BPE with
    byte fallback that transformers' GGUF loader builds: Gemma's (GemmaTokenizer: spaces as "▁", no
    prefix space, merges in the file's token order) for gemma architectures, else Llama's (Metaspace,
    a prefix space on the first word, merges by score). Control tokens are special, user-defined ones
    added whole; the BOS is added when the file says so."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    types = meta.get("tokenizer.ggml.token_type") or []
    gemma = str(meta.get("general.architecture", "")).startswith("gemma")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if gemma:
        # runs of spaces are stored as spaces but looked up as "▁"s; the scores do not follow the merge order
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = _merges_of(vocab, {t: -i for i, t in enumerate(tokens)})
        unk = tokens[int(unk_id)] if unk_id is not None and int(unk_id) < len(tokens) else "<unk>"
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk, byte_fallback=True))
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    else:
        vocab = {t: i for i, t in enumerate(tokens)}
        file_merges = meta.get("tokenizer.ggml.merges")
        merges = ([tuple(m.split(" ", 1)) for m in file_merges] if file_merges else
                  _merges_of(vocab, dict(zip(tokens, meta.get("tokenizer.ggml.scores") or []))))
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    # llama.cpp (and transformers' GGUF loader) add BOS to a SentencePiece vocabulary that does not say otherwise
    if bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos_id is not None and int(bos_id) < len(tokens):
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                                           special_tokens=[(bos, int(bos_id))])
    return tok


def gguf_chat_template(meta: GGUFMeta) -> str | None:
    v = meta.get("tokenizer.chat_template")
    return v if isinstance(v, str) else None


def gguf_special_tokens(meta: GGUFMeta) -> dict:
    """`special_tokens` (see `dir_special_tokens`) from the tokenizer.ggml.* metadata."""
    out: dict = {}
    n_tokens = meta.array_len("tokenizer.ggml.tokens")
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"),
                      ("unk", "unknown_token_id")):
        i = meta.get(f"tokenizer.ggml.{name}")
        known = n_tokens is not None and i is not None and int(i) < n_tokens
        text = meta.array_item("tokenizer.ggml.tokens", int(i)) if known else None
        out[key] = {"id": None if i is None else int(i), "text": text}
    eos = {out["eos"]["id"]} - {None}
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos.add(int(eot))
    out["eos_ids"] = sorted(eos)
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
    out["add_bos"] = bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))
    return out


# --- a Hugging Face dir ----------------------------------------------------------------------------

def read_json(path: Path) -> dict:
    """A JSON object file; {} when the file is absent or holds something else."""
    try:
        v = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from None
    return v if isinstance(v, dict) else {}


def dir_tokenizer(root: Path):
    """The dir's tokenizer.json as a `tokenizers.Tokenizer`; None when it has none."""
    path = root / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions
        raise CheckpointError(f"{path}: not a tokenizers file ({e})") from None


def dir_chat_template(root: Path) -> str | None:
    """tokenizer_config.json's chat_template (the "default" one of a list), else chat_template.jinja."""
    template = read_json(root / "tokenizer_config.json").get("chat_template")
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


def dir_special_tokens(root: Path, tokenizer) -> dict:
    """{"bos", "eos", "pad", "unk"} -> {"id": int | None, "text": str | None}, plus "eos_ids" (every
    stop id) and "add_bos" (whether prompts start with BOS); `tokenizer` (or None) fills in ids from
    texts and texts from ids."""
    cfg, gen = read_json(root / "config.json"), read_json(root / "generation_config.json")
    tcfg = read_json(root / "tokenizer_config.json")
    out: dict = {}
    for key in ("bos", "eos", "pad", "unk"):
        text = _token_text(tcfg.get(f"{key}_token"))
        i = _first_id(gen.get(f"{key}_token_id"))
        if i is None:
            i = _first_id(cfg.get(f"{key}_token_id"))
        if i is None and text is not None and tokenizer is not None:
            i = tokenizer.token_to_id(text)
        if text is None and i is not None and tokenizer is not None:
            text = tokenizer.id_to_token(i)
        out[key] = {"id": i, "text": text}
    eos = set()
    for v in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
        eos |= {x for x in (v if isinstance(v, list) else [v]) if isinstance(x, int) and not isinstance(x, bool)}
    if out["eos"]["id"] is not None:
        eos.add(out["eos"]["id"])
    out["eos_ids"] = sorted(eos)
    out["add_bos"] = bool(tcfg.get("add_bos_token", False))
    return out


def write_side_files(out: Path, config: dict, special: dict, tokenizer, template: str | None) -> list[str]:
    """A Hugging Face dir's text files for a checkpoint of another format: config.json,
    generation_config.json, tokenizer.json (when there is a tokenizer) and tokenizer_config.json
    (chat template, special tokens). Returns the names written."""
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = {k + "_token_id": special[k]["id"] for k in ("bos", "eos", "pad") if special[k]["id"] is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    names = ["config.json", "generation_config.json"]
    if tokenizer is not None:
        tokenizer.save(str(out / "tokenizer.json"))
        names.append("tokenizer.json")
    tcfg = {f"{k}_token": special[k]["text"] for k in ("bos", "eos", "pad", "unk") if special[k]["text"] is not None}
    tcfg["add_bos_token"] = special["add_bos"]
    if template is not None:
        tcfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    return names + ["tokenizer_config.json"]
