"""The prefix cache's index: which prompts' KV the stages keep, and what a new prompt may reuse of it.

An entry is a prompt whose KV every stage kept when its sequence ended (under the entry's id, in
the stage's KV pool: layerline.model.kv.KVPool.keep), with the chunk bounds it was computed in. A
new prompt reuses the longest prefix that an entry computed up to one of its bounds and that
leaves at least one token of the new prompt to compute (the logits come from it): the new
sequence starts with those bounds, so a replay from position 0 (a stage lost its cache) cuts the
prompt exactly as the cached computation did, and a greedy stream's tokens are those of a run
without the cache at the same chunk bounds. Only prompt chunks are reused: generated tokens were
computed one row step at a time.

Pure: no sockets, no torch. The engine (layerline.engine) owns one, tells the stages to keep and
drop entries, and forgets one a stage turned out to lack (it answers seq_unknown: the sequence
replays from 0). Bounded by entries (MAX_ENTRIES) and tokens (the stages' KV budget), least
recently used out first; an entry that a newer one extends (same tokens, same bounds, more of
them) is dropped, since every lookup it could answer the newer one answers as well.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .wire import MAX_SEQS

MIN_REUSE_TOKENS = 16    # a shorter common prefix is computed again (a fork's copy and message cost more)
MAX_ENTRIES = MAX_SEQS   # entries a stage keeps at most (layerline.model.kv.KVPool: max_entries)


@dataclass(frozen=True)
class Entry:
    id: str
    tokens: tuple[int, ...]
    bounds: tuple[int, ...]   # increasing, the last one == len(tokens)


@dataclass(frozen=True)
class Hit:
    entry: str                # the entry's id: the stages copy `length` tokens of its KV
    length: int               # tokens reused: one of the entry's bounds
    bounds: tuple[int, ...]   # the entry's bounds up to `length`: the new sequence's first chunks


def reusable(entry: Entry, prompt: list[int] | tuple[int, ...]) -> int:
    """The longest of the entry's bounds that the prompt shares and that leaves one token of it to
    compute (0: none)."""
    for b in reversed(entry.bounds):
        if b < len(prompt) and b >= MIN_REUSE_TOKENS and tuple(prompt[:b]) == entry.tokens[:b]:
            return b
    return 0


def _extends(new: Entry, old: Entry) -> bool:
    """Whether `new` answers every lookup `old` could: its tokens start with old's and its bounds
    with old's bounds."""
    n = len(old.tokens)
    return (len(new.tokens) >= n and new.tokens[:n] == old.tokens
            and new.bounds[:len(old.bounds)] == old.bounds)


class PrefixIndex:
    """Entries by id, least recently used first, at most `max_entries` of them and `max_tokens`
    tokens in all. Counters: lookups, hits, reused (tokens), lost (hits a stage turned out to lack)."""

    def __init__(self, max_tokens: int, max_entries: int = MAX_ENTRIES):
        if max_tokens < 1 or max_entries < 1:
            raise ValueError(f"prefix index: max_tokens {max_tokens} and max_entries {max_entries} must be >= 1")
        self.max_tokens, self.max_entries = max_tokens, max_entries
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self.tokens = 0
        self.lookups = self.hits = self.reused = self.lost = 0
        self.looked_up_tokens = 0   # prompt tokens of every lookup (vLLM's prefix_cache_queries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self._entries

    def ids(self) -> list[str]:
        """Entry ids, least recently used first."""
        return list(self._entries)

    def lookup(self, prompt: list[int]) -> Hit | None:
        """The entry that lets this prompt reuse the most (marked used), or None."""
        self.lookups += 1
        self.looked_up_tokens += len(prompt)
        best, best_len = None, 0
        for e in self._entries.values():
            n = reusable(e, prompt)
            if n > best_len:
                best, best_len = e, n
        if best is None:
            return None
        self._entries.move_to_end(best.id)
        self.hits += 1
        self.reused += best_len
        return Hit(best.id, best_len, tuple(b for b in best.bounds if b <= best_len))

    def add(self, entry_id: str, tokens: list[int], bounds: list[int]) -> list[str]:
        """Record an entry (the stages keep it); returns the ids the stages must drop now: entries it
        extends, the least recently used beyond the bounds, or this one itself when an entry held
        already extends it (or it holds nothing worth reusing)."""
        bounds = tuple(b for b in bounds if 0 < b <= len(tokens))
        new = Entry(entry_id, tuple(tokens[:bounds[-1]] if bounds else ()), bounds)
        if entry_id in self._entries:
            raise ValueError(f"prefix index: entry {entry_id} exists")
        if not bounds or bounds[-1] < MIN_REUSE_TOKENS or len(new.tokens) > self.max_tokens:
            return [entry_id]
        for old in self._entries.values():
            if _extends(old, new):
                self._entries.move_to_end(old.id)
                return [entry_id]
        drop = [old.id for old in self._entries.values() if _extends(new, old)]
        for i in drop:
            self._forget(i)
        self._entries[entry_id] = new
        self.tokens += len(new.tokens)
        drop += self.trim(self.max_tokens)
        return drop

    def trim(self, max_tokens: int) -> list[str]:
        """Drop the least recently used entries until at most max_entries and max_tokens remain
        (max_tokens below self.max_tokens: room the running sequences need); their ids."""
        out = []
        while self._entries and (len(self._entries) > self.max_entries or self.tokens > max_tokens):
            out.append(next(iter(self._entries)))
            self._forget(out[-1])
        return out

    def forget(self, entry_id: str, lost: bool = False) -> None:
        """Drop an entry (lost: a stage answered that it lacks it)."""
        if self._forget(entry_id) and lost:
            self.lost += 1

    def _forget(self, entry_id: str) -> bool:
        e = self._entries.pop(entry_id, None)
        if e is None:
            return False
        self.tokens -= len(e.tokens)
        return True
