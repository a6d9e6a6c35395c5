"""layerline.model.kv: the KV pool's contract (admit, step at a position, rows, release, epochs,
eviction of the oldest under the budget) and the one write check, on small caches, no model."""
import pytest
import torch

from layerline.errors import LayerlineError
from layerline.model.kv import (KVCache, KVFull, KVGap, KVPool, KVRows, SeqUnknown, Stale, StageCache,
                                check_write)

pytestmark = pytest.mark.unit

PER_TOKEN = 2 * 1 * 2 * 4 * 2   # k and v, 1 kv head, head_dim 2, fp32, 2 layers


def new_cache(batch: int, tokens: int) -> StageCache:
    return StageCache([KVCache(batch, 1, tokens, 2, torch.float32) for _ in range(2)])


def pool(budget_tokens: int = 64, max_seqs: int = 8) -> KVPool:
    return KVPool(new_cache, bytes_per_token=PER_TOKEN, budget=budget_tokens * PER_TOKEN, max_seqs=max_seqs,
                  context=32, name="s0")


def written(c: StageCache, pos: int, t: int) -> StageCache:
    c.length = pos + t   # what the stage's forward records after writing
    return c


def test_check_write_is_the_one_rule():
    c = written(new_cache(2, 8), 0, 5)
    check_write(c, 3, 2, 1)                    # rewind: allowed, fewer rows than the cache: allowed
    with pytest.raises(KVGap, match="start_pos 6"):
        check_write(c, 6, 1, 1)
    with pytest.raises(KVRows, match="2 rows"):
        check_write(c, 5, 1, 1, exact_batch=True)
    with pytest.raises(KVFull, match="KV cache full"):
        check_write(c, 5, 4, 2)
    with pytest.raises(KVGap, match=r"rows\[1\]: position 9"):
        check_write(c, 9, 1, 1, where="rows[1]: ", what="position")


def test_step_admits_at_zero_continues_and_rewinds():
    p = pool()
    c = written(p.step("a", 0, 1, 4, reserve=10, epoch=None), 0, 4)
    assert (c.max_len, len(p)) == (10, 1)
    assert p.step("a", 4, 1, 1, reserve=10, epoch=None) is c      # continues
    assert p.step("a", 2, 1, 1, reserve=10, epoch=None) is c      # rewinds (writes are idempotent by position)
    with pytest.raises(SeqUnknown, match="seq a holds 4 tokens, got position 6") as e:
        p.step("a", 6, 1, 1, reserve=10, epoch=None)
    assert e.value.code == "seq_unknown" and e.value.header == {"seqs": ["a"]}
    with pytest.raises(SeqUnknown, match="seq b is unknown at position 3"):
        p.step("b", 3, 1, 1, reserve=10, epoch=None)
    with pytest.raises(KVRows, match="seq a has batch 1, this step has 2"):
        p.step("a", 4, 2, 1, reserve=10, epoch=None)
    with pytest.raises(LayerlineError, match="would exceed --kv-context 32"):
        p.step("a", 4, 1, 7, reserve=10, epoch=None)
    assert p.step("a", 0, 1, 12, reserve=10, epoch=None) is not c   # position 0 starts it anew, sized to fit
    assert p.get("a").max_len == 12


def test_the_budget_evicts_the_oldest_and_refuses_what_never_fits():
    p = pool(budget_tokens=32)
    for s in ("a", "b"):
        p.step(s, 0, 1, 1, reserve=16, epoch=None)
    p.step("a", 0, 1, 1, reserve=16, epoch=None)               # a is the most recent now
    p.step("c", 0, 1, 1, reserve=16, epoch=None)
    assert (p.get("a") is not None, p.get("b"), p.get("c") is not None) == (True, None, True)
    with pytest.raises(LayerlineError, match="KV budget"):
        p.admit("d", 1, 33)
    small = pool(max_seqs=2)
    for s in ("a", "b", "c"):
        small.step(s, 0, 1, 1, reserve=4, epoch=None)
    assert len(small) == 2 and small.get("a") is None
    small.release("b")
    assert len(small) == 1


def test_rows_check_every_row_before_touching_any():
    p = pool()
    a = written(p.step("a", 0, 1, 3, reserve=8, epoch=1), 0, 3)
    b = written(p.step("b", 0, 1, 2, reserve=8, epoch=1), 0, 2)
    written(p.step("w", 0, 2, 2, reserve=8, epoch=1), 0, 2)
    assert p.rows([("a", 3), ("b", 2)], epoch=2) == [a, b] and a.epoch == b.epoch == 2
    with pytest.raises(SeqUnknown) as e:
        p.rows([("a", 3), ("x", 0), ("b", 5)], epoch=2)
    assert e.value.header == {"seqs": ["x", "b"]} and "holds 2 tokens, row pos 5" in str(e.value)
    with pytest.raises(KVRows, match=r"header.rows\[1\]: seq w has batch 2"):
        p.rows([("a", 3), ("w", 2)], epoch=2)
    full = written(p.step("f", 0, 1, 4, reserve=4, epoch=None), 0, 4)
    with pytest.raises(LayerlineError, match="seq f would exceed"):
        p.rows([("f", full.length)], epoch=None)


def test_a_forward_of_an_older_epoch_is_stale():
    p = pool()
    written(p.step("a", 0, 1, 2, reserve=8, epoch=3), 0, 2)
    with pytest.raises(Stale):
        p.step("a", 2, 1, 1, reserve=8, epoch=2)
    with pytest.raises(Stale):
        p.rows([("a", 2)], epoch=2)
    p.step("a", 2, 1, 1, reserve=8, epoch=None)     # no epoch: never stale
    p.step("a", 2, 1, 1, reserve=8, epoch=3)


def test_a_sequence_written_at_an_absurd_epoch_fails_alone():
    """A forward with a huge epoch (a bad or buggy sender) poisons only its own sequence: a rows step
    holding it is refused naming it alone (code seq_unknown: the sender resends the others and
    replays it, which stays stale, so it fails after its replays); its neighbours go on untouched."""
    p = pool()
    a = written(p.step("a", 0, 1, 2, reserve=8, epoch=1), 0, 2)
    b = written(p.step("b", 0, 1, 2, reserve=8, epoch=1), 0, 2)
    written(p.step("a", 2, 1, 1, reserve=8, epoch=2**62), 2, 1)
    with pytest.raises(Stale) as e:
        p.rows([("a", 3), ("b", 2)], epoch=1)
    assert e.value.code == "seq_unknown" and e.value.header == {"seqs": ["a"]}
    assert "a (epoch 4611686018427387904)" in str(e.value) and b.length == 2   # nothing applied
    with pytest.raises(Stale):
        p.step("a", 0, 1, 3, reserve=8, epoch=1)   # its replay from 0 is refused too
    assert p.rows([("b", 2)], epoch=1) == [b]
    assert a.length == 3


# --- prefix entries (layerline.prefix): keep, fork, eviction ------------------------------------------

def filled(c: StageCache, pos: int, t: int, base: float) -> StageCache:
    """Write t tokens at pos whose K and V values say which token they are (base + position)."""
    for layer in c.layers:
        for i in range(pos, pos + t):
            layer.k[:, :, i] = base + i
            layer.v[:, :, i] = -(base + i)
    return written(c, pos, t)


def test_keep_and_fork_copy_the_prefix_and_share_one_entry():
    p = pool()
    filled(p.step("a", 0, 1, 6, reserve=12, epoch=1), 0, 6, 100.0)
    assert p.keep("a", "e1", 5) and p.get("a") is None and (len(p), p.entries) == (0, 1)
    assert p.entry_bytes == 5 * PER_TOKEN                 # a compact copy: 5 tokens, not the 12 reserved
    forks = []
    for s in ("b", "c"):                                   # two sequences from one entry, each its own copy
        c = p.fork(s, "e1", 5, tokens=2, reserve=10, epoch=2)
        assert (c.length, c.max_len, c.epoch) == (5, 10, 2)
        forks.append(filled(c, 5, 2, 200.0 if s == "b" else 300.0))
    for c in forks:
        assert [float(x) for x in c.layers[1].k[0, 0, :5, 0]] == [100.0, 101.0, 102.0, 103.0, 104.0]
        assert [float(x) for x in c.layers[0].v[0, 0, :5, 1]] == [-100.0, -101.0, -102.0, -103.0, -104.0]
    assert float(forks[0].layers[0].k[0, 0, 5, 0]) == 205.0 and float(forks[1].layers[0].k[0, 0, 5, 0]) == 305.0
    assert p.fork("d", "e1", 3, tokens=1, reserve=8, epoch=None).length == 3   # any shorter prefix of it too
    assert p.step("b", 7, 1, 1, reserve=10, epoch=2) is forks[0]                # a forked sequence goes on


def test_a_fork_from_an_entry_not_held_names_the_new_sequence():
    p = pool()
    with pytest.raises(SeqUnknown, match="seq b forks from prefix entry e9, which is not held here") as e:
        p.fork("b", "e9", 4, tokens=1, reserve=8, epoch=None)
    assert e.value.code == "seq_unknown" and e.value.header == {"seqs": ["b"]} and p.get("b") is None
    written(p.step("a", 0, 1, 4, reserve=8, epoch=None), 0, 4)
    assert p.keep("a", "e1", 4)
    with pytest.raises(SeqUnknown, match="holds 4 tokens, not 6"):
        p.fork("b", "e1", 6, tokens=1, reserve=8, epoch=None)
    p.release("e1")                                        # the engine's release of an entry
    with pytest.raises(SeqUnknown, match="not held here"):
        p.fork("b", "e1", 4, tokens=1, reserve=8, epoch=None)
    # nothing is kept of a sequence this stage lacks, holds fewer tokens of, or of several rows
    assert not p.keep("ghost", "e2", 4)
    written(p.step("short", 0, 1, 2, reserve=8, epoch=None), 0, 2)
    assert not p.keep("short", "e2", 3) and p.entries == 0 and p.get("short") is None
    written(p.step("wide", 0, 2, 4, reserve=8, epoch=None), 0, 4)
    assert not p.keep("wide", "e2", 4) and p.entries == 0


def test_entries_go_first_least_recently_used_and_never_push_out_a_live_sequence():
    p = pool(budget_tokens=32)
    for s, e in (("a", "e1"), ("b", "e2")):
        written(p.step(s, 0, 1, 8, reserve=8, epoch=None), 0, 8)
        assert p.keep(s, e, 8)
    p.fork("f", "e1", 8, tokens=1, reserve=10, epoch=None)       # e1 used: e2 is the least recent now
    written(p.step("live", 0, 1, 6, reserve=6, epoch=None), 0, 6)  # 8 + 8 + 10 + 6 = 32: all fit
    assert p.entries == 2
    p.step("x", 0, 1, 1, reserve=8, epoch=None)                  # 8 more: an entry goes, not a sequence
    assert p.entries == 1 and p.fork("g", "e1", 8, tokens=0, reserve=8, epoch=None).length == 8
    assert p.entries == 0 and all(p.get(s) is not None for s in ("f", "live", "x", "g"))  # e1 went for g
    # an entry that does not fit beside the live sequences is not kept (they are never evicted for it)
    full = pool(budget_tokens=16)
    written(full.step("a", 0, 1, 8, reserve=8, epoch=None), 0, 8)
    written(full.step("b", 0, 1, 4, reserve=8, epoch=None), 0, 4)
    assert full.keep("b", "e1", 4) and full.entries == 1          # b's own room holds it
    few = pool(max_seqs=8)
    few.max_entries = 2
    for i in range(3):
        written(few.step(f"s{i}", 0, 1, 2, reserve=2, epoch=None), 0, 2)
        assert few.keep(f"s{i}", f"e{i}", 2)
    assert few.entries == 2
    with pytest.raises(SeqUnknown):
        few.fork("n", "e0", 2, tokens=1, reserve=4, epoch=None)   # the oldest of three went


def test_a_fork_of_an_older_epoch_is_stale():
    p = pool()
    written(p.step("a", 0, 1, 4, reserve=8, epoch=1), 0, 4)
    assert p.keep("a", "e1", 4)
    written(p.step("b", 0, 1, 5, reserve=8, epoch=3), 0, 5)
    with pytest.raises(Stale):
        p.fork("b", "e1", 4, tokens=1, reserve=8, epoch=2)
    assert p.get("b").length == 5                                # not replaced
