"""layerline.prefix: the prefix cache's index (what a new prompt may reuse, at whose bounds, and
which entries the stages drop), pure, no processes."""
import pytest

from layerline.prefix import MIN_REUSE_TOKENS, PrefixIndex, reusable, Entry

pytestmark = pytest.mark.unit

SYSTEM = list(range(1000, 1100))            # a 100-token system prompt
FIRST = SYSTEM + [1, 2, 3, 4, 5]             # ... and a first user turn: 105 tokens, chunks of 32
BOUNDS = [32, 64, 96, 105]


def test_a_prompt_reuses_the_longest_bound_it_shares_and_computes_at_least_one_token():
    ix = PrefixIndex(max_tokens=10_000)
    assert ix.add("e1", FIRST, BOUNDS) == []
    turn2 = FIRST + [7, 8, 9]                                     # the same conversation, one more turn
    hit = ix.lookup(turn2)
    assert (hit.entry, hit.length, hit.bounds) == ("e1", 105, (32, 64, 96, 105))
    other = SYSTEM + [9, 9]                                       # the system prompt, another question
    hit = ix.lookup(other)
    assert (hit.length, hit.bounds) == (96, (32, 64, 96))          # a bound, not the 100 tokens shared
    hit = ix.lookup(FIRST)                                        # the same prompt again: one token is left
    assert (hit.length, hit.bounds) == (96, (32, 64, 96))
    assert ix.lookup([5] + FIRST) is None                          # shares nothing at its start
    assert ix.lookup(SYSTEM[:MIN_REUSE_TOKENS + 1]) is None        # no bound inside what it shares
    assert (ix.lookups, ix.hits, ix.reused) == (5, 3, 105 + 96 + 96)
    assert ix.looked_up_tokens == sum(map(len, (turn2, other, FIRST, [5] + FIRST, SYSTEM[:MIN_REUSE_TOKENS + 1])))


def test_reusable_needs_the_tokens_up_to_the_bound_and_the_minimum():
    e = Entry("e", tuple(range(40)), (8, 20, 40))
    assert reusable(e, list(range(41))) == 40
    assert reusable(e, list(range(25)) + [99]) == 20
    assert reusable(e, list(range(19)) + [99, 20]) == 0            # differs before 20; 8 is under the minimum
    assert MIN_REUSE_TOKENS > 8


def test_an_entry_that_extends_another_replaces_it_and_one_that_adds_nothing_is_dropped():
    ix = PrefixIndex(max_tokens=10_000)
    ix.add("e1", FIRST, BOUNDS)
    turn2 = FIRST + list(range(50))
    assert ix.add("e2", turn2, BOUNDS + [137, 155]) == ["e1"]      # e2 answers whatever e1 would
    assert ix.ids() == ["e2"] and ix.tokens == len(turn2)
    assert ix.add("e3", FIRST, BOUNDS) == ["e3"]                    # the same again: e2 covers it
    assert ix.add("e4", FIRST, [32, 64, 105]) == []                 # other bounds: not covered, both kept
    assert ix.add("e5", [1] * 10, [10]) == ["e5"]                   # too short to be worth reusing
    assert ix.add("e6", FIRST, []) == ["e6"]
    assert sorted(ix.ids()) == ["e2", "e4"]
    with pytest.raises(ValueError, match="exists"):
        ix.add("e2", FIRST, BOUNDS)


def test_bounded_by_tokens_and_entries_least_recently_used_first():
    ix = PrefixIndex(max_tokens=250, max_entries=3)
    prompts = {f"e{i}": [i] * 100 for i in range(3)}
    assert ix.add("e0", prompts["e0"], [100]) == []
    assert ix.add("e1", prompts["e1"], [100]) == []
    assert ix.lookup(prompts["e0"] + [5]).entry == "e0"            # e0 used: e1 is the oldest now
    assert ix.add("e2", prompts["e2"], [100]) == ["e1"]           # 300 tokens > 250
    assert ix.ids() == ["e0", "e2"] and ix.tokens == 200
    assert ix.trim(150) == ["e0"]                                 # room the running sequences need
    small = PrefixIndex(max_tokens=10_000, max_entries=2)
    for i in range(3):
        small.add(f"s{i}", [i] * 20, [20])
    assert small.ids() == ["s1", "s2"]
    assert ix.add("big", [9] * 300, [300]) == ["big"]              # never fits


def test_forget_counts_a_lost_entry_once():
    ix = PrefixIndex(max_tokens=1000)
    ix.add("e1", FIRST, BOUNDS)
    ix.forget("e1", lost=True)
    ix.forget("e1", lost=True)
    assert (ix.lost, len(ix), ix.tokens) == (1, 0, 0) and ix.lookup(FIRST + [1]) is None
