"""The KV cache and its contract, in one place (gpt-fast's `KVCache.update(input_pos, k, v)`).

- `kv_update` is the one write: k, v at a positions tensor, prefill and decode alike.
- `StageCache` is one sequence's caches over a stage's layers and how many tokens they hold.
- `check_write` is the one rule for writing T new tokens of B rows at a position: the position
  continues from at most what the cache holds (an earlier one rewinds it: writes are idempotent by
  position), they fit its length, and its rows hold the step's. `Stage.forward` and
  `Stage.forward_rows` ask it for a cache they are handed.
- `KVPool` is a stage's caches by sequence id within a byte budget: it admits a sequence (the
  oldest go first when the budget or the sequence cap is reached), continues one at a position,
  hands out the caches of a rows step, releases one, and refuses a forward of an older wire epoch
  than the last that wrote a sequence (Stale, naming those sequences). The worker holds one; its
  errors name the sequence so the sender can replay just it.
- Prefix entries (the engine's prefix cache, layerline.prefix): `keep` turns an ended sequence's
  first tokens into an entry under a new id (read-only from then on); `fork` starts a new sequence
  with a copy of an entry's first tokens, so many sequences share one system prompt. Entries live
  in the same byte budget, are evicted least recently used and before any live sequence, and a
  fork from an entry this stage lacks is SeqUnknown naming the new sequence (it replays from 0).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..errors import LayerlineError


def kv_update(kbuf: torch.Tensor, vbuf: torch.Tensor, pos: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The one KV cache update: write k, v [b, n_kv, T, hd] at positions `pos` (int64 [T]) of the
    buffers [batch >= b, n_kv, max_len, hd] and return the buffers' first b rows, every position
    (the caller narrows them to the keys it attends)."""
    if kbuf.shape[0] != k.shape[0]:  # a cache of more rows than this step has
        kbuf, vbuf = kbuf[:k.shape[0]], vbuf[:k.shape[0]]
    if k.dtype != kbuf.dtype:
        k, v = k.to(kbuf.dtype), v.to(vbuf.dtype)
    kbuf.index_copy_(2, pos, k)
    vbuf.index_copy_(2, pos, v)
    return kbuf, vbuf


class KVCache(nn.Module):
    """One layer's keys and values: buffers [batch, n_kv_heads, max_len, head_dim]."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, n_kv, T, hd] at positions `pos` (int64 [T]); the buffers' first B rows."""
        return kv_update(self.k, self.v, pos, k, v)


class StageCache:
    """The KV caches of one stage's layers for one sequence (of `batch` rows), and how many
    tokens they hold: the one record of a sequence's length (the stage's forward keeps it)."""

    def __init__(self, layers: list[KVCache]):
        self.layers = layers
        # each layer's (k, v) buffers, read once: a module's attribute lookup per layer and step
        # added up to a few percent of a small model's step (the buffers are written, never replaced)
        self.pairs = [(c.k, c.v) for c in layers]
        # summed once: the pool sums every cache's bytes at each admission, and a sum over the
        # layers there took about 5% of a worker's CPU at 16 clients (docs/serving.md)
        self.nbytes = sum(c.k.numel() * c.k.element_size() * 2 for c in layers)
        self.length = 0
        self.epoch = -1  # the wire epoch of the last forward that wrote it (KVPool drops older ones)

    @property
    def batch(self) -> int:
        return self.layers[0].k.shape[0]

    @property
    def max_len(self) -> int:
        return self.layers[0].k.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].k.dtype

    def holds(self, pos: int) -> bool:
        """Whether new tokens may start at `pos`: at most where the cached ones end."""
        return 0 <= pos <= self.length

    def reset(self) -> None:
        """Forget the cached tokens (the buffers are overwritten as new ones come)."""
        self.length = 0

    def rows(self) -> list["StageCache"]:
        """One one-row cache per row, over this cache's buffers (views, no copy): how a compiled
        step takes a sequence of several rows. Their lengths are not kept; this cache's is."""
        if self.batch == 1:
            return [self]
        return [StageCache([_RowKV(c.k[i:i + 1], c.v[i:i + 1]) for c in self.layers]) for i in range(self.batch)]


@dataclass
class _RowKV:
    """One row of a layer's KV buffers (views into them)."""
    k: torch.Tensor
    v: torch.Tensor


# --- the contract ---------------------------------------------------------------------------------


class KVGap(LayerlineError):
    """New tokens would start past what the cache holds: the prefix must be replayed first."""


class KVFull(LayerlineError):
    """New tokens would not fit the cache's length."""


class KVRows(LayerlineError):
    """The step has rows the cache does not hold (more than it has, or, exactly, other than it has)."""


def check_write(cache: StageCache, pos: int, tokens: int, batch: int, *, exact_batch: bool = False,
                where: str = "", what: str = "start_pos") -> None:
    """Raise KVGap, KVRows or KVFull (in that order) unless `tokens` new tokens of `batch` rows may
    be written at `pos` of `cache`. exact_batch: the step must have the cache's rows, not fewer.
    where: a prefix naming the caller's part (e.g. "rows[2]: "); what: the position's name."""
    if type(pos) is not int or not cache.holds(pos):
        raise KVGap(f"{where}{what} {pos!r}: the KV cache holds {cache.length} tokens; positions must "
                    "continue from at most there (replay the prefix)")
    if batch > cache.batch or (exact_batch and batch != cache.batch):
        raise KVRows(f"{where}batch {batch} does not fit the KV cache's {cache.batch} rows")
    if pos + tokens > cache.max_len:
        raise KVFull(f"{where}KV cache full: {pos + tokens} tokens do not fit its {cache.max_len}; raise --kv-context")


class SeqUnknown(LayerlineError):
    """Sequences a stage lacks (or holds fewer tokens of than asked): the sender replays them.
    The error reply carries code "seq_unknown" and their ids in `seqs`."""

    def __init__(self, message: str, seqs: list[str]):
        super().__init__(message, "seq_unknown")
        self.header = {"seqs": list(seqs)}


class Stale(SeqUnknown):
    """A forward of an older wire epoch than the last one that wrote one of its sequences here. The
    worker answers it as seq_unknown naming those sequences: a driver that failed over forgot the
    request and drops the answer; a sequence some sender wrote at a later (or absurd) epoch fails
    alone after its replays, and the other rows of its step are resent, not stalled."""


class KVPool:
    """A stage's KV caches by sequence id, least recently used first, within `budget` bytes and
    `max_seqs` sequences (and `max_entries` prefix entries). The one owner of the cache contract on a worker.

    new_cache(batch, tokens) makes an empty StageCache; bytes_per_token is what one token of one
    row costs across the stage's layers; context is the most tokens a sequence may reach (the
    worker's --kv-context, named in errors); name is the stage's, for errors.
    """

    def __init__(self, new_cache: Callable[[int, int], StageCache], *, bytes_per_token: int, budget: int,
                 max_seqs: int, context: int, name: str, max_entries: int | None = None):
        self.new_cache = new_cache
        self.bytes_per_token, self.budget, self.max_seqs = bytes_per_token, budget, max_seqs
        self.max_entries = max_seqs if max_entries is None else max_entries
        self.context, self.name = context, name
        self._seqs: OrderedDict[str, StageCache] = OrderedDict()
        self._entries: OrderedDict[str, StageCache] = OrderedDict()   # prefix entries, read-only

    def __len__(self) -> int:
        """Live sequences (prefix entries are not sequences: `entries`)."""
        return len(self._seqs)

    def get(self, seq: str) -> StageCache | None:
        return self._seqs.get(seq)

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def entry_bytes(self) -> int:
        return sum(c.nbytes for c in list(self._entries.values()))

    @property
    def held_bytes(self) -> int:
        return sum(c.nbytes for c in list(self._seqs.values())) + self.entry_bytes

    def release(self, seq: str) -> None:
        """Free a sequence's cache, or a prefix entry's (the same id space: the engine's ids)."""
        self._seqs.pop(seq, None)
        self._entries.pop(seq, None)

    def _make_room(self, need: int, *, seqs: bool) -> None:
        """Evict prefix entries, least recently used first, then (seqs) the oldest sequences, until
        `need` more bytes fit the budget and a new sequence (seqs) or entry (not seqs) fits its cap."""
        while self._entries and (self.held_bytes + need > self.budget
                                 or (not seqs and len(self._entries) >= self.max_entries)):
            self._entries.popitem(last=False)
        while seqs and self._seqs and (len(self._seqs) >= self.max_seqs or self.held_bytes + need > self.budget):
            self._seqs.popitem(last=False)

    def admit(self, seq: str, batch: int, reserve: int) -> StageCache:
        """A new cache for `seq` of `batch` rows and `reserve` tokens (replacing one it had), within
        the budget: prefix entries are evicted first, then the oldest sequences (their senders replay them)."""
        self._seqs.pop(seq, None)
        need = batch * reserve * self.bytes_per_token
        if need > self.budget:
            raise LayerlineError(f"stage {self.name}: seq {seq} needs {need} KV bytes ({batch} x {reserve} tokens) "
                                 f"but the stage's KV budget is {self.budget}; shorten it or raise the plan's "
                                 "layerline_objective.context / batch")
        self._make_room(need, seqs=True)
        cache = self.new_cache(batch, reserve)
        self._seqs[seq] = cache
        return cache

    def keep(self, seq: str, entry: str, length: int) -> bool:
        """The sequence ends; its first `length` tokens stay as prefix entry `entry` (a compact copy
        unless its cache is that long already). False (and nothing kept) when this stage lacks it,
        holds fewer tokens of it, it has several rows, or no room is left beside the live sequences."""
        cache = self._seqs.pop(seq, None)
        self._entries.pop(entry, None)
        if cache is None or cache.length < length or cache.batch != 1 or length < 1:
            return False
        if cache.max_len != length:
            kept = self.new_cache(1, length)
            for dst, src in zip(kept.layers, cache.layers):
                dst.k.copy_(src.k[:, :, :length])
                dst.v.copy_(src.v[:, :, :length])
            cache = kept
        cache.length = length
        self._make_room(cache.nbytes, seqs=False)
        if self.held_bytes + cache.nbytes > self.budget:
            return False
        self._entries[entry] = cache
        return True

    def fork(self, seq: str, entry: str, length: int, tokens: int, reserve: int, epoch: int | None) -> StageCache:
        """A new one-row cache for `seq` (replacing one it had) holding a copy of prefix entry
        `entry`'s first `length` tokens, for `tokens` new tokens at position `length`. Raises
        SeqUnknown naming `seq` when this stage lacks the entry (evicted, restarted, a new stage)
        or it holds fewer tokens, else as `step`."""
        self._fresh(epoch, [seq])
        src = self._entries.get(entry)
        if src is None or src.length < length:
            why = "is not held here (evicted, or this worker restarted)" if src is None else \
                f"holds {src.length} tokens, not {length}"
            raise SeqUnknown(f"stage {self.name}: seq {seq} forks from prefix entry {entry}, which {why}; "
                             "replay it from 0", [seq])
        self._entries.move_to_end(entry)
        cache = self.admit(seq, 1, min(max(reserve, length + tokens), self.context))  # may evict src: it stays valid
        if cache.max_len < length + tokens:
            raise LayerlineError(f"stage {self.name}: seq {seq} would exceed --kv-context {self.context} "
                                 f"(it reserved {cache.max_len} tokens)")
        for dst, s in zip(cache.layers, src.layers):
            dst.k[:, :, :length].copy_(s.k[:, :, :length])
            dst.v[:, :, :length].copy_(s.v[:, :, :length])
        cache.length = length
        return self.step(seq, length, 1, tokens, reserve, epoch)

    def _fresh(self, epoch: int | None, seqs: list[str]) -> None:
        """Raise Stale for a forward of an older epoch than the last one that wrote any of these
        sequences (one this stage lacks is not stale). Forwards without an epoch are never stale."""
        if epoch is None:
            return
        stale = [(q, c.epoch) for q in seqs if (c := self._seqs.get(q)) is not None and c.epoch > epoch]
        if stale:
            raise Stale(f"stage {self.name}: epoch {epoch} is older than the one that last wrote "
                        f"{', '.join(f'{q} (epoch {e})' for q, e in stale)} here; a forward of a route "
                        "failed over since, or a sequence written at a wrong epoch", [q for q, _ in stale])

    def _touch(self, seq: str, cache: StageCache, epoch: int | None) -> None:
        self._seqs.move_to_end(seq)
        if epoch is not None:
            cache.epoch = epoch

    def step(self, seq: str, pos: int, batch: int, tokens: int, reserve: int, epoch: int | None) -> StageCache:
        """The cache for `tokens` new tokens of `batch` rows of `seq` at `pos`: a new one (sized for
        max(reserve, tokens)) at position 0, else the one held, rewound to `pos` by the write.
        Raises Stale, SeqUnknown (lacking it, or holding fewer than pos tokens), KVRows (another
        batch than it holds) or LayerlineError (past its reserve)."""
        self._fresh(epoch, [seq])
        cache = self._seqs.get(seq)
        if pos == 0 or cache is None:
            if pos != 0:
                raise SeqUnknown(f"stage {self.name}: seq {seq} is unknown at position {pos}; "
                                 "replay its prefix from 0", [seq])
            cache = self.admit(seq, batch, max(reserve, tokens))
        try:
            check_write(cache, pos, tokens, batch, exact_batch=True)
        except KVGap:
            raise SeqUnknown(f"stage {self.name}: seq {seq} holds {cache.length} tokens, got position {pos}; "
                             "replay its prefix from 0", [seq]) from None
        except KVRows:
            raise KVRows(f"input: seq {seq} has batch {cache.batch}, this step has {batch}") from None
        except KVFull:
            raise LayerlineError(f"stage {self.name}: seq {seq} would exceed --kv-context {self.context} "
                                 f"(it reserved {cache.max_len} tokens)") from None
        self._touch(seq, cache, epoch)
        return cache

    def rows(self, rows: list[tuple[str, int]], epoch: int | None) -> list[StageCache]:
        """The caches of a rows step (one new token for each row's one-row sequence at its pos), all
        checked before any is touched. Raises Stale, SeqUnknown naming every sequence this stage
        lacks or holds fewer tokens of, KVRows (a sequence of several rows) or LayerlineError (past
        a reserve)."""
        self._fresh(epoch, [seq for seq, _ in rows])
        bad = []
        for seq, pos in rows:
            c = self._seqs.get(seq)
            if c is None:
                bad.append((seq, "unknown"))
            elif not c.holds(pos):
                bad.append((seq, f"holds {c.length} tokens, row pos {pos}"))
        if bad:
            raise SeqUnknown(f"stage {self.name}: rows name sequences this stage lacks or holds fewer tokens of: "
                             f"{', '.join(f'{s} ({why})' for s, why in bad)}; replay them from 0 and resend",
                             [s for s, _ in bad])
        caches = []
        for i, (seq, pos) in enumerate(rows):
            c = self._seqs[seq]
            try:
                check_write(c, pos, 1, 1, exact_batch=True)
            except KVRows:
                raise KVRows(f"header.rows[{i}]: seq {seq} has batch {c.batch}; a row steps a sequence of "
                             "batch 1") from None
            except KVFull:
                raise LayerlineError(f"stage {self.name}: seq {seq} would exceed --kv-context {self.context} "
                                     f"(it reserved {c.max_len} tokens)") from None
            caches.append(c)
        for (seq, _), c in zip(rows, caches):
            self._touch(seq, c, epoch)
        return caches
