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
