"""A stage holding the whole model runs ahead (layerline.worker.stage, "Running ahead"): between
messages it computes the greedy step it expects next, answers that step from it when it comes, and
computes any other message as before.

The real Worker in this process (tests/unit/conftest.py), driven over its CURVE sockets; each step
is sent only once the worker has computed its guess (read from the worker object), so which
answers come from a guess does not depend on how busy this machine is. The reference is the same
stage loaded here, stepped with the same calls on a cache of its own: every answer's token equals
it, a guessed one too. The worker runs up to AHEAD steps ahead; each step here is sent once all
of them are computed.
"""
from __future__ import annotations

import time

import torch

from layerline.pipeline import DriveError, Pipeline, control
from layerline.model.loader import load_stage
from layerline.worker.stage import AHEAD

PROMPT = [3, 14, 15, 92, 65]


class Reference:
    """The worker's stage in this process: the same forward calls, its own KV cache."""

    def __init__(self, w):
        a = w.args
        self.stage = load_stage(a.checkpoint, a.start, a.end, True, True, precision=a.precision)
        self.cache = self.stage.new_cache(1, 32, dtype=w.compute.kv_dtype)

    def prefill(self, ids: list[int]) -> int:
        out = self.stage(torch.tensor([ids]), start_pos=0, cache=self.cache, last_only=True)
        return int(out[0, -1].argmax())

    def step(self, token: int, pos: int) -> int:
        out = self.stage.forward_rows(torch.tensor([[token]]), [pos], [self.cache])
        return int(out[0, -1].argmax())


def guessed(w, n: int = AHEAD, timeout_s: float = 30.0) -> None:
    """Wait until the worker has computed n of the steps it may run ahead (all AHEAD by default)."""
    t0 = time.monotonic()
    while sum(a.picked is not None for a in w.compute.ahead) < n:
        assert time.monotonic() - t0 < timeout_s, "the worker never computed its guesses"
        time.sleep(0.001)


def chain_of(res, ref: Reference, tok: int, pos: int) -> tuple[list[int], int, int]:
    """An answer's picks, the asked step's and then's, each checked against the reference stepped
    from (tok, pos); returns them and the (token, position) the next step starts from."""
    chain = [int(res.argmax[0])] + ([] if res.then is None else [int(t) for t in res.then[:, 0]])
    want = []
    for t in chain:
        want.append(ref.step(tok, pos))
        tok, pos = t, pos + 1
    assert chain == want
    return chain, tok, pos


def picked(pipe: Pipeline, rid: str) -> int:
    got, res = pipe.collect()
    assert got == rid
    if isinstance(res, DriveError):
        raise res
    assert res.argmax is not None and bool(res.finite.all())
    return int(res.argmax[0])


def test_a_whole_model_stage_answers_its_guess_with_the_same_tokens_and_computes_anything_else(worker):
    w, kd = worker
    ref = Reference(w)
    stats = lambda: control(w.net.control_addr, "stats", keys_dir=kd["controller"], peer="w", timeout_s=5.0)  # noqa: E731
    with Pipeline(w.args.bind, keys_dir=kd["controller"], first_key="w", timeout_s=60) as pipe:
        tok = picked(pipe, pipe.submit(torch.tensor([PROMPT]), seq="s", pos=0, cache=True, last_only=True,
                                       reserve=32, pick=True))
        assert tok == ref.prefill(PROMPT)
        pos = len(PROMPT)
        for _ in range(6):   # the expected steps: each answered from its guess
            guessed(w)
            nxt = picked(pipe, pipe.submit_rows([("s", pos)], torch.tensor([tok]), pick=True))
            assert nxt == ref.step(tok, pos)
            tok, pos = nxt, pos + 1
        s = stats()
        assert (s["ahead_used"], s["ahead_dropped"]) == (6, 0), s

        # another token than the one it picked (as a sampled step would send): computed, not guessed
        guessed(w)
        other = (tok + 1) % 500
        nxt = picked(pipe, pipe.submit_rows([("s", pos)], torch.tensor([other]), pick=True))
        assert nxt == ref.step(other, pos)
        tok, pos = nxt, pos + 1
        # a step asking for logits, not a pick, is computed too; its answer is the same step's
        guessed(w)
        rid = pipe.submit_rows([("s", pos)], torch.tensor([tok]), pick=False)
        got, res = pipe.collect()
        assert got == rid and res.logits is not None
        assert int(res.logits[0, -1].argmax()) == ref.step(tok, pos)
        s = stats()
        assert (s["ahead_used"], s["ahead_dropped"]) == (6, 2 * AHEAD), s
        assert not w.compute.ahead, "a logits step sets no guess"

        # a step after a dropped guess is guessed again, and a release drops the guess
        tok, pos = int(res.logits[0, -1].argmax()), pos + 1
        nxt = picked(pipe, pipe.submit_rows([("s", pos)], torch.tensor([tok]), pick=True))
        assert nxt == ref.step(tok, pos)
        guessed(w)
        pipe.release("s")
        t0 = time.monotonic()
        while w.compute.ahead:
            assert time.monotonic() - t0 < 30, "the release did not drop the guess"
            time.sleep(0.005)
        try:
            picked(pipe, pipe.submit_rows([("s", pos + 1)], torch.tensor([nxt]), pick=True))
            raise AssertionError("a released sequence was answered")
        except DriveError as e:
            assert e.code == "seq_unknown", e
        s = stats()
        assert (s["ahead_used"], s["ahead_dropped"], s["sequences"]) == (6, 3 * AHEAD, 0), s


def test_guesses_stop_at_the_sequences_reserve(worker):
    """A sequence admitted for 2 tokens past its prompt gets 2 guesses, no more, and the worker then
    waits (it does not try again and again); the step past the reserve fails as it would have."""
    w, kd = worker
    ref = Reference(w)
    with Pipeline(w.args.bind, keys_dir=kd["controller"], first_key="w", timeout_s=60) as pipe:
        tok = picked(pipe, pipe.submit(torch.tensor([PROMPT]), seq="r", pos=0, cache=True, last_only=True,
                                       reserve=len(PROMPT) + 2, pick=True))
        assert tok == ref.prefill(PROMPT)
        t0 = time.monotonic()
        while w.compute.can_run_ahead():
            assert time.monotonic() - t0 < 30, "the worker never finished its guesses"
            time.sleep(0.005)
        assert [a.rows for a in w.compute.ahead] == [[("r", 5)], [("r", 6)]]
        assert w.compute.ahead[-1].last
        pos = len(PROMPT)
        for _ in range(2):
            nxt = picked(pipe, pipe.submit_rows([("r", pos)], torch.tensor([tok]), pick=True))
            assert nxt == ref.step(tok, pos)
            tok, pos = nxt, pos + 1
        t0 = time.monotonic()
        while w.compute.can_run_ahead():   # the step after the reserve is tried once, and dropped
            assert time.monotonic() - t0 < 30, "the worker never settled"
            time.sleep(0.005)
        assert not w.compute.ahead
        try:
            picked(pipe, pipe.submit_rows([("r", pos)], torch.tensor([tok]), pick=True))
            raise AssertionError("a step past the reserve was answered")
        except DriveError as e:
            assert "would exceed" in str(e), e


def test_a_step_asking_for_more_takes_the_computed_steps_after_it_in_one_answer(worker):
    """`more` (Pipeline.submit_rows): the answer carries the picks of the steps computed after the
    asked one (StepResult.then), the next step is sent past them and answered from the chain; a
    driver that takes fewer than it was given and steps from an earlier position is computed
    afresh and answered right (the cache is rewound to its position)."""
    w, kd = worker
    ref = Reference(w)
    with Pipeline(w.args.bind, keys_dir=kd["controller"], first_key="w", timeout_s=60) as pipe:
        tok = picked(pipe, pipe.submit(torch.tensor([PROMPT]), seq="m", pos=0, cache=True, last_only=True,
                                       reserve=40, pick=True))
        assert tok == ref.prefill(PROMPT)
        pos = len(PROMPT)
        for more in (AHEAD, 1):
            guessed(w)
            rid = pipe.submit_rows([("m", pos)], torch.tensor([tok]), pick=True, more=more)
            got, res = pipe.collect()
            assert got == rid and res.then is not None and res.then.shape == (min(more, AHEAD - 1), 1), res
            _, tok, pos = chain_of(res, ref, tok, pos)
        s = control(w.net.control_addr, "stats", keys_dir=kd["controller"], peer="w", timeout_s=5.0)
        assert (s["ahead_used"], s["ahead_dropped"]) == (AHEAD + 2, 0), s

        # the driver takes none of what it is given next, and steps from the asked position + 1
        guessed(w)
        rid = pipe.submit_rows([("m", pos)], torch.tensor([tok]), pick=True, more=AHEAD)
        got, res = pipe.collect()
        assert res.then is not None and int(res.argmax[0]) == ref.step(tok, pos)
        tok, pos = int(res.argmax[0]), pos + 1
        nxt = picked(pipe, pipe.submit_rows([("m", pos)], torch.tensor([tok]), pick=True))
        assert nxt == ref.step(tok, pos)


def test_a_step_asking_for_more_waits_for_the_steps_after_it_up_to_the_reserve(worker):
    """The expected step, sent while few steps after it are computed, is parked until `more` are
    (the chain here is AHEAD long, so AHEAD - 1 come back with it); a sequence's reserve ends the
    chain, and the step is then answered with what there is rather than waited on."""
    w, kd = worker
    ref = Reference(w)
    with Pipeline(w.args.bind, keys_dir=kd["controller"], first_key="w", timeout_s=60) as pipe:
        tok = picked(pipe, pipe.submit(torch.tensor([PROMPT]), seq="p", pos=0, cache=True, last_only=True,
                                       reserve=len(PROMPT) + AHEAD + 3, pick=True))
        assert tok == ref.prefill(PROMPT)
        pos = len(PROMPT)
        chains = []
        for _ in range(2):
            guessed(w, 1)
            rid = pipe.submit_rows([("p", pos)], torch.tensor([tok]), pick=True, more=AHEAD)
            got, res = pipe.collect()
            assert got == rid and res.then is not None and bool(res.finite.all()), res
            chain, tok, pos = chain_of(res, ref, tok, pos)
            chains.append(len(chain))
        # the reserve holds positions 0..len(PROMPT) + AHEAD + 2: the first step and the AHEAD - 1
        # after it write AHEAD of them from len(PROMPT) on, which leaves three
        assert chains == [AHEAD, 3], chains


def test_a_parked_answer_that_fails_fails_that_request_alone(worker, monkeypatch):
    """A parked step whose answer cannot be made: its sender gets the error, the chain it waited on is
    dropped, and the worker goes on (the same step sent again is computed and answered right)."""
    w, kd = worker
    ref = Reference(w)
    calls = []

    def broken(force):
        calls.append(force)
        if len(calls) == 1:   # the forward's own check: not due yet, so the step stays parked
            return None
        raise RuntimeError("no memory for the answer")
    with Pipeline(w.args.bind, keys_dir=kd["controller"], first_key="w", timeout_s=60) as pipe:
        tok = picked(pipe, pipe.submit(torch.tensor([PROMPT]), seq="f", pos=0, cache=True, last_only=True,
                                       reserve=32, pick=True))
        assert tok == ref.prefill(PROMPT)
        pos = len(PROMPT)
        guessed(w)
        monkeypatch.setattr(w.compute, "unpark", broken)
        rid = pipe.submit_rows([("f", pos)], torch.tensor([tok]), pick=True, more=AHEAD)
        got, res = pipe.collect()
        assert got == rid and isinstance(res, DriveError) and "no memory for the answer" in str(res), res
        assert len(calls) >= 2 and w.compute.parked is None and not w.compute.ahead
        monkeypatch.undo()
        assert picked(pipe, pipe.submit_rows([("f", pos)], torch.tensor([tok]), pick=True)) == ref.step(tok, pos)
        s = control(w.net.control_addr, "stats", keys_dir=kd["controller"], peer="w", timeout_s=5.0)
        assert s["errors"] >= 1, s
