"""What the engine sends in one turn (`Engine._dispatch`), with nothing listening: the messages are
read off its socket to stage 0 as they leave."""
from __future__ import annotations

import pytest

from layerline import keys, wire
from layerline.driver import Pipeline
from layerline.engine import BUSY_CHUNK, Engine, Sequence


@pytest.fixture
def sent(tmp_path):
    kd = keys.local_keys(str(tmp_path / "keys"), ["stage0"])   # every pipeline socket runs CURVE
    with Pipeline("tcp://127.0.0.1:1", timeout_s=30, keys_dir=kd["controller"], first_key="stage0") as pipe:
        out: list[tuple[dict, dict]] = []
        pipe.to_first.send_multipart = lambda frames, **kw: out.append(wire.decode(frames))
        yield pipe, out


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_prompts_keep_a_chunk_in_flight_for_each_micro_batch_beside_the_rows(sent, depth):
    """While sequences decode, waiting prompts go in busy chunks, as many at once as the pipeline's
    depth (one at a time, they crossed the stages one after another while requests queued for them),
    and the decoding rows as up to depth micro-batches beside them."""
    pipe, out = sent
    eng = Engine(pipe, stages=depth, rows=True)
    decoding = [Sequence(f"d{i}", [1, 2, 3], 8) for i in range(4)]
    waiting = [Sequence(f"p{i}", list(range(5, 5 + 3 * BUSY_CHUNK)), 8) for i in range(4)]
    for s in decoding + waiting:
        eng.add(s)
    eng._admit()
    for s in decoding:   # each with one generated token not fed yet
        s.tokens.append(9)
        s.held = len(s.prompt)
    eng._dispatch()
    chunks = [(h, t) for h, t in out if "rows" not in h]
    rows = [h for h, _ in out if "rows" in h]
    assert [h["seq"] for h, _ in chunks] == [f"p{i}" for i in range(depth)]
    assert all(h["pos"] == 0 and t["input_ids"].shape == (1, BUSY_CHUNK) for h, t in chunks)
    assert sorted(r[0] for h in rows for r in h["rows"]) == [s.sid for s in decoding]
    assert 1 <= len(rows) <= depth
    # nothing more goes out until an answer comes
    n = len(out)
    eng._dispatch()
    assert len(out) == n
