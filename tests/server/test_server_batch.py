"""The batched decode step (several sequences, one token each, each weight read once) gives
every sequence exactly the logits of its own one-token decode step."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import random_ids


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from gemmalite.tools.synth import synth

    return synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False)


@pytest.fixture(scope="module", params=["stored", "int8"])
def model(request, tiny_dir, tmp_path_factory, gl):
    if request.param == "stored":
        return gl.load(tiny_dir, context=64)
    from gemmalite.tools.convert import convert

    out = convert(tiny_dir, tmp_path_factory.mktemp(request.param), request.param, progress=False)
    return gl.load(out, context=64)


def _twins(eng, prompts) -> tuple[list, list]:
    """Two states per prompt, each prefilled with it: one to step alone, one to step in a batch."""
    solo, batch = [eng.new_state() for _ in prompts], [eng.new_state() for _ in prompts]
    for p, a, b in zip(prompts, solo, batch):
        eng.prefill(a, np.array(p))
        eng.prefill(b, np.array(p))
    return solo, batch


def test_decode_batch_equals_decode_step(model):
    eng = model.engine
    vocab = model.config.vocab_size
    # five sequences at different lengths (one past the 16-token sliding window), so each row
    # attends to its own cache; five rows also crosses the 4-row fused-kernel chunk
    prompts = [random_ids(n, vocab, seed=n) for n in (1, 3, 7, 20, 11)]
    solo, batch = _twins(eng, prompts)
    rng = np.random.default_rng(0)
    for step in range(3):
        toks = [int(t) for t in rng.integers(5, vocab, size=len(prompts))]
        want = np.stack([eng.decode_step(s, t) for s, t in zip(solo, toks)])
        got = eng.decode_batch(batch, toks)
        assert got.shape == (len(prompts), vocab)
        np.testing.assert_array_equal(got, want)
    for a, b in zip(solo, batch):
        assert a.tokens == b.tokens and a.length == b.length


def test_prefill_many_equals_prefill(model):
    """Prompts prefilled together (one stack of rows through the products, attention per
    sequence) give each sequence bit for bit its solo prefill: the last position's logits, the
    cache (the next decode step's logits), the recorded tokens. Lengths 1 and 3 take the few-row
    products, the others the prefill ones (int8: the integer tiles on the 256-wide down
    projections, shared by all of them); one prompt continues a cached prefix."""
    eng = model.engine
    vocab = model.config.vocab_size
    prompts = [random_ids(n, vocab, seed=10 + n) for n in (7, 1, 3, 20, 11, 1, 6)]
    solo, batch = [eng.new_state() for _ in prompts], [eng.new_state() for _ in prompts]
    eng.prefill(solo[-1], np.array(prompts[0][:4]))  # a state that already holds tokens
    eng.prefill(batch[-1], np.array(prompts[0][:4]))
    want = np.stack([eng.logits(eng.prefill(s, np.array(p)))[0] for s, p in zip(solo, prompts)])
    got = eng.logits(eng.prefill_many(batch, [np.array(p) for p in prompts]), each=True)
    np.testing.assert_array_equal(got, want)
    for a, b in zip(solo, batch):
        assert a.tokens == b.tokens and a.length == b.length
    toks = [int(t) for t in np.argmax(want, axis=1)]
    np.testing.assert_array_equal(eng.decode_batch(batch, toks), np.stack([eng.decode_step(s, t) for s, t in zip(solo, toks)]))


def test_prefill_many_checks_every_context_first(gl, tiny_dir):
    """A prompt that does not fit raises before any state is written."""
    eng = gl.load(tiny_dir, context=8).engine
    states = [eng.new_state(), eng.new_state()]
    with pytest.raises(gl.ContextError):
        eng.prefill_many(states, [np.arange(5, 8), np.arange(5, 15)])
    assert [s.length for s in states] == [0, 0] and not states[0].tokens


def _ggml(name: str, w: np.ndarray):
    """A GGML block matrix of ``w`` (gguf-py quantizes; K-quants get random blocks of the right size)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    from gemmalite.kernels.ggml import block_info
    from gemmalite.weights.ggml import GGMLMatrix

    try:
        raw = np.ascontiguousarray(quants.quantize(w, Q[name])).view(np.uint8)
    except NotImplementedError:
        bs, ts = block_info(name)
        raw = np.random.default_rng(0).integers(0, 256, size=(w.shape[0], w.shape[1] // bs * ts), dtype=np.uint8)
        d = np.array([0.01, 0.01], np.float16).view(np.uint8)  # small finite float16 scales
        blocks = raw.reshape(w.shape[0], -1, ts)
        if name == "Q6_K":  # d at the end of the block
            blocks[..., 208:210] = d[:2]
        else:  # d, dmin first
            blocks[..., 0:4] = d
    return GGMLMatrix(raw, name, w.shape)


@pytest.mark.parametrize("cols", [256, 8192])  # 8192: the kernels' four-rows-per-task variant
def test_matmul_each_equals_one_row_products(cols):
    """Every weight format's batched product equals its one-row product, row by row, bit for bit."""
    from gemmalite.weights.matrix import BF16, F32Matrix, HalfMatrix
    from gemmalite.weights.quant import Int4Matrix, Int8Matrix

    rng = np.random.default_rng(cols)
    w = rng.standard_normal((37, cols)).astype(np.float32)
    x = rng.standard_normal((9, cols)).astype(np.float32)
    mats = [F32Matrix(w), HalfMatrix(w.astype(BF16)), HalfMatrix(w.astype(np.float16)), Int8Matrix.quantize(w),
            Int4Matrix.quantize(w, 32, search=False), Int4Matrix.quantize(w, 64, search=False),
            Int4Matrix.quantize(w, symmetric=True)]
    if cols == 256:  # the multi-row W8A16 kernel (Q8_0), and a fused-kernel type in chunks (Q4_K)
        mats += [_ggml(name, w) for name in ("Q8_0", "Q4_K")]
    for m in mats:
        np.testing.assert_array_equal(m.matmul_each(x), np.concatenate([m.matmul(r[None]) for r in x]), err_msg=repr(m))


def test_decode_batch_context_full(gl, tiny_dir):
    m = gl.load(tiny_dir, context=8)
    eng = m.engine
    s = eng.new_state()
    eng.prefill(s, np.arange(5, 13))
    with pytest.raises(gl.ContextError):
        eng.decode_batch([s], [5])



def test_decode_batch_with_drafts_equals_decode_rows(model):
    """A batched step whose sequences bring 1 to 4 tokens (the current one and prompt-lookup
    drafts) gives each the logits of its own step: ``decode_step`` for one token, ``decode_rows``
    (each row a one-token step) for several; too many tokens are refused before anything runs."""
    eng = model.engine
    vocab = model.config.vocab_size
    prompts = [random_ids(n, vocab, seed=30 + n) for n in (5, 18, 2, 9)]
    solo, batch = _twins(eng, prompts)
    rng = np.random.default_rng(1)
    for step in range(2):
        runs = [int(rng.integers(5, vocab))] + [[int(t) for t in rng.integers(5, vocab, size=n)] for n in (4, 2, 3)]
        want = np.concatenate([eng.decode_step(s, r)[None] if isinstance(r, int) else eng.decode_rows(s, r)
                               for s, r in zip(solo, runs)])
        got = eng.decode_batch(batch, runs)
        assert got.shape == (10, vocab)
        np.testing.assert_array_equal(got, want)
    for a, b in zip(solo, batch):
        assert a.tokens == b.tokens and a.length == b.length
    with pytest.raises(ValueError, match="1 to 4 tokens"):
        eng.decode_batch(batch, [5, [5] * 5])
    assert [b.length for b in batch] == [a.length for a in solo]


def _serve(sch, seqs) -> list:
    """Put ``seqs`` in ``sch``'s queue together, run them, and return each one's (text, `Finish`)."""
    import queue

    from gemmalite.server.scheduler import Finish

    sinks = []
    for seq in seqs:  # all waiting before the scheduler looks
        sinks.append(queue.Queue())
        seq.sink = sinks[-1].put
        sch.waiting.put_nowait(seq)
    sch.start()
    try:
        out = []
        for q in sinks:
            text = []
            while not isinstance(ev := q.get(timeout=60), Finish):
                text.append(ev.text)
            out.append(("".join(text), ev))
        return out
    finally:
        sch.close()


def test_prompt_lookup_in_a_batch_keeps_every_text(model):
    """Sequences decoding by prompt lookup beside plain ones, in one batch: greedy, seeded
    sampling, a prediction that is the reply itself (so most drafts are kept: the rollback of the
    rest and the acceptance of several rows in one step are both exercised), and replies that run
    into the end of the context. Every text and finish reason equals the plain solo run's."""
    from gemmalite.runtime.sampling import SamplingParams
    from gemmalite.server.scheduler import Scheduler, Sequence

    vocab = model.config.vocab_size
    base = random_ids(10, vocab, seed=8)
    prompts = [base + random_ids(4, vocab, seed=9) + base, base[:6] + base, random_ids(12, vocab, seed=10) + base,
               base * 4]
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_k=40, seed=4),
              SamplingParams(temperature=0), SamplingParams(temperature=0)]
    limits = [12, 12, 12, 100]  # the last runs into the context's end (64)

    def seqs(lookup, predictions=None):
        return [Sequence(ids=list(p), max_tokens=n, params=sp, stop_ids=set(), stop_strings=[], sink=None,
                         lookup=lookup, prediction=list(predictions[i]) if predictions else [])
                for i, (p, sp, n) in enumerate(zip(prompts, params, limits))]

    plain = [_serve(Scheduler(model.engine, model.tokenizer, prefix_cache=0), [s])[0] for s in seqs(0)]
    replies = [model.tokenizer.encode(t, add_special_tokens=False) for t, _ in plain]
    for lookup, predictions in ((3, None), (3, replies), (1, None)):
        got = _serve(Scheduler(model.engine, model.tokenizer, max_concurrency=8, prefix_cache=0),
                     seqs(lookup, predictions))
        assert [(t, ev.reason) for t, ev in got] == [(t, ev.reason) for t, ev in plain], (lookup, predictions is None)
        assert sum(ev.drafted for _, ev in got) > 0
        assert all(ev.accepted <= ev.drafted for _, ev in got)
        if predictions is not None:  # greedy, drafting from its own reply (the batch's draft rows take turns)
            assert got[2][1].accepted > 0
    solo = _serve(Scheduler(model.engine, model.tokenizer, prefix_cache=0), seqs(3, replies)[2:3])[0]
    assert solo[0] == plain[2][0] and solo[1].accepted >= 4  # alone: up to three drafts kept per step
    assert plain[3][1].reason == "length" and plain[3][1].completion_tokens == 64 - len(prompts[3]) + 1


def test_requests_that_start_alike_share_one_prefill(model):
    """A burst of requests with a common prompt (the same prompt twice, one that shares 27 of its
    tokens, one unrelated): the followers copy the computed state (`KVState.clone`, of sliding
    rings that have wrapped: 30 tokens in 20 slots) and run only the rest, and every text equals
    the one the request gets alone."""
    from gemmalite.runtime.sampling import SamplingParams
    from gemmalite.server.scheduler import SHARE_MIN, Scheduler, Sequence

    vocab = model.config.vocab_size
    base = random_ids(30, vocab, seed=5)
    prompts = [base, base, base[:27] + random_ids(3, vocab, seed=6), random_ids(28, vocab, seed=7)]
    assert 27 >= SHARE_MIN and prompts[2][27] != base[27] and prompts[3][0] != base[0]

    def run(sch, ids_list):
        return [(t, ev.cached_tokens) for t, ev in _serve(sch, [
            Sequence(ids=list(ids), max_tokens=6, params=SamplingParams(temperature=0), stop_ids=set(),
                     stop_strings=[], sink=None) for ids in ids_list])]

    alone = [run(Scheduler(model.engine, model.tokenizer, prefix_cache=0), [p])[0] for p in prompts]
    burst = run(Scheduler(model.engine, model.tokenizer, max_concurrency=8, prefix_cache=0), prompts)
    assert [t for t, _ in burst] == [t for t, _ in alone]
    assert [c for _, c in burst] == [0, 30, 27, 0]
