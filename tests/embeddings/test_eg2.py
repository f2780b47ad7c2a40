"""EmbeddingGemma 2 embeddings against transformers / sentence-transformers (tests/eg2_oracle.py).

Reference: the same random checkpoint run by transformers in float64, one sequence at a time,
mean-pooled and L2-normalised (``ref_embed_ids``); and the sentence-transformers pipeline itself
(float32, padded batches) for tokenization, prompts and pooling. Every checkpoint has sliding
layers whose radius is far shorter than the inputs and full layers with another head size and
KV-head count; every weight (norms and ``layer_scalar`` included) is random. float32 vectors are
judged as the vision tower's are: within 4x transformers' own float32 error of the float64
reference (``o.assert_parity``); int8 / int4 at bounds measured on gentle checkpoints.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("sentence_transformers")
import torch  # noqa: E402
import eg2_oracle as o  # noqa: E402

from gemmalite import ContextError, ImageError, InputError, load_embedder  # noqa: E402
from gemmalite.models.gemma.encoder import EncoderConfig  # noqa: E402

TEXTS = [
    "Hello world",
    "the quick brown fox jumps over the lazy dog. " * 6,  # ~60 tokens: many radius-3 windows
    "a",
    "What is the capital of France? The capital of France is Paris.\n\nTell me a story.",
    "Once upon a time there was a little model that wanted to generate text. " * 9,  # ~380 tokens
]


def _st_pair(st, texts, **kw):
    """The sentence-transformers pipeline's (float64, float32) vectors, for `o.assert_parity`."""
    return o.st_encode(st, texts, torch.float64, **kw), o.st_encode(st, texts, **kw)


def _ids(rng, lengths, vocab=512):
    return [list(rng.randint(5, vocab, size=n)) for n in lengths]


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("eg2_text")
    return path, o.make_eg2_checkpoint(path, layout="text", seed=0)


@pytest.fixture(scope="module")
def nested_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("eg2_nested")
    return path, o.make_eg2_checkpoint(path, layout="nested", seed=3, towers=True)


@pytest.fixture(scope="module")
def st_text(text_ckpt):
    return o.st_model(text_ckpt[0])


# ------------------------------------------------------------------------------------------ config

def test_config_matches_transformers(text_ckpt, nested_ckpt):
    for path, model in (text_ckpt, nested_ckpt):
        raw = json.loads((path / "config.json").read_text())
        cfg = EncoderConfig.from_hf(raw)
        tc = o.text_module(model).config
        assert [s.layer_type for s in cfg.layers] == list(tc.layer_types)
        assert len({(s.head_dim, s.num_kv_heads) for s in cfg.layers}) == 2  # two attention geometries
        for s in cfg.layers:
            lc = tc.per_layer_config[s.index]
            assert (s.head_dim, s.num_kv_heads) == (lc.head_dim, lc.num_key_value_heads)
        assert (cfg.sliding_window, cfg.embedding_dim, cfg.ple_dim) == (tc.sliding_window, tc.embedding_dim,
                                                                         tc.hidden_size_per_layer_input)


def test_builder_keys_like_transformers():
    """Hub-style builder keys (no layer_types / per_layer_config) resolve as transformers resolves them."""
    from transformers import EmbeddingGemma2TextConfig

    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, hidden_size_per_layer_input=8, sliding_window=5)
    for extra in ({}, {"global_head_dim": 32}, {"num_global_key_value_heads": 2, "sliding_window_pattern": 3}):
        tc = EmbeddingGemma2TextConfig(**kw, **extra)
        cfg = EncoderConfig.from_hf({"model_type": "embedding_gemma2_text", **kw, **extra})
        assert [s.layer_type for s in cfg.layers] == list(tc.layer_types)
        assert [(s.head_dim, s.num_kv_heads) for s in cfg.layers] == \
            [(tc.per_layer_config[i].head_dim, tc.per_layer_config[i].num_key_value_heads) for i in range(8)]
        assert [s.rope.theta for s in cfg.layers] == \
            [tc.rope_parameters[t]["rope_theta"] for t in tc.layer_types]


def test_decoder_loader_rejects_encoder(gl, text_ckpt):
    with pytest.raises(gl.CheckpointError, match="embedding_gemma2_text.*load_embedder"):
        gl.load(text_ckpt[0])


# ------------------------------------------------------------------------------------------ exactness

@pytest.mark.parametrize("which", ["text", "nested"])
def test_texts_match_float64_reference(which, text_ckpt, nested_ckpt):
    path, model = text_ckpt if which == "text" else nested_ckpt
    emb = load_embedder(path)
    st = o.st_model(path)
    ids = o.st_token_ids(st, TEXTS)
    assert [list(a) for a in emb.tokenize(TEXTS)] == ids
    assert max(len(i) for i in ids) > 10 * emb.cfg.sliding_window
    got = emb.embed(TEXTS)
    assert got.dtype == np.float32 and got.shape == (len(TEXTS), 48)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    ref64, ref32 = o.ref_pair(model, ids)
    o.assert_parity(got, ref64, ref32, which)
    # the pipeline (padded batches) in float64 is the float64 reference, and ours is as close to it
    # as the pipeline's own float32 run
    st64 = o.st_encode(st, TEXTS, torch.float64)
    np.testing.assert_allclose(st64, ref64, rtol=0, atol=1e-12)
    o.assert_parity(got, st64, o.st_encode(st, TEXTS), (which, "sentence-transformers"))


@pytest.mark.parametrize("variant", [
    dict(sliding_window=1, layer_types=["sliding_attention"] * 5 + ["full_attention"], attention_bias=True),
    dict(num_key_value_heads=4, num_global_key_value_heads=2, global_head_dim=8, head_dim=24, sliding_window=6,
         num_hidden_layers=4, layer_types=None, sliding_window_pattern=2,
         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                          "full_attention": {"rope_type": "default", "rope_theta": 5000.0}}),
])
def test_layer_variants_match_float64(tmp_path, variant):
    model = o.make_eg2_checkpoint(tmp_path, seed=7, tokenizer=None, **variant)
    emb = load_embedder(tmp_path)
    seqs = _ids(np.random.RandomState(1), [1, 2, 9, 64, 200, 511])
    got = emb.embed_ids(seqs)
    o.assert_parity(got, *o.ref_pair(model, seqs), variant)


def test_mixed_batches_equal_one_by_one(text_ckpt):
    path, model = text_ckpt
    emb = load_embedder(path)
    rng = np.random.RandomState(2)
    seqs = _ids(rng, rng.randint(1, 200, size=11))
    one = np.concatenate([emb.embed_ids([s]) for s in seqs])
    for bs in (4, 64):  # bit for bit (tests/embeddings/test_determinism.py)
        np.testing.assert_array_equal(emb.embed_ids(seqs, batch_size=bs), one)
    o.assert_parity(one, *o.ref_pair(model, seqs))


def test_bidirectional_attention_kernels():
    """numba rows, the blocked BLAS path and a plain numpy reference agree, radius and full."""
    from gemmalite.kernels.ops import attention

    rng = np.random.RandomState(0)
    T, nq, kv, D = 37, 4, 2, 8
    q, k, v = (rng.randn(T, h, D).astype(np.float32) for h in (nq, kv, kv))
    pos = np.arange(T)
    for window in (None, 1, 5, 40):
        ref = np.empty((T, nq, D))
        for i in range(T):
            ok = np.ones(T, bool) if window is None else np.abs(pos - i) <= window
            for h in range(nq):
                s = (k[:, h // 2] @ q[i, h]).astype(np.float64)
                s[~ok] = -np.inf
                p = np.exp(s - s.max())
                ref[i, h] = (p / p.sum()) @ v[:, h // 2]
        for blas in (False, True):  # numba rows / blocked BLAS
            got = attention(q, k, v, pos, pos, window, 1.0, blas, causal=False)
            np.testing.assert_allclose(got.reshape(T, nq, D), ref, atol=2e-6)


# ------------------------------------------------------------------------------------------ prompts, dims

def test_prompts_like_sentence_transformers(text_ckpt, st_text):
    path, model = text_ckpt
    emb = load_embedder(path)
    assert {k: v for k, v in emb.prompts.items() if v} == o.STANDARD_PROMPTS
    for name in ("SearchQuery", "Document"):
        got = emb.embed(TEXTS[:3], prompt_name=name)
        ids = o.st_token_ids(st_text, TEXTS[:3], o.STANDARD_PROMPTS[name])
        assert [list(a) for a in emb.tokenize(TEXTS[:3], prompt=o.STANDARD_PROMPTS[name])] == ids
        o.assert_parity(got, *o.ref_pair(model, ids), name)
        o.assert_parity(got, *_st_pair(st_text, TEXTS[:3], prompt_name=name), (name, "sentence-transformers"))
    lit = emb.embed(TEXTS[:2], prompt="query: ")
    o.assert_parity(lit, *_st_pair(st_text, TEXTS[:2], prompt="query: "), "literal prompt")
    assert not np.allclose(lit, emb.embed(TEXTS[:2]))
    with pytest.raises(InputError, match="unknown prompt name 'Nope'.*SearchQuery"):
        emb.embed("x", prompt_name="Nope")
    with pytest.raises(InputError, match="not both"):
        emb.embed("x", prompt_name="Document", prompt="y")


def test_default_prompt_name(tmp_path, text_ckpt):
    path = o.hf_oracle.copy_checkpoint(text_ckpt[0], tmp_path / "c")
    conf = json.loads((path / "config_sentence_transformers.json").read_text())
    conf["default_prompt_name"] = "Document"
    (path / "config_sentence_transformers.json").write_text(json.dumps(conf))
    emb = load_embedder(path)
    np.testing.assert_array_equal(emb.embed(TEXTS[:2]), emb.embed(TEXTS[:2], prompt_name="Document"))
    o.assert_parity(emb.embed(TEXTS[:2]), *_st_pair(o.st_model(path), TEXTS[:2]))


@pytest.mark.parametrize("dims", [1, 16])
def test_matryoshka_dimensions(text_ckpt, st_text, dims):
    path, model = text_ckpt
    emb = load_embedder(path)
    got = emb.embed(TEXTS, dimensions=dims)
    assert got.shape == (len(TEXTS), dims)
    o.assert_parity(got, *o.ref_pair(model, o.st_token_ids(st_text, TEXTS), dimensions=dims), dims)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_bad_inputs(text_ckpt):
    emb = load_embedder(text_ckpt[0])
    for bad, msg in (([""], r"texts\[0\] is an empty string"), (["ok", 3], r"texts\[1\] is a int"),
                     (["ok", None], r"texts\[1\] is a NoneType"), (7, "not int")):
        with pytest.raises(InputError, match=msg):
            emb.embed(bad)
    with pytest.raises(ImageError, match="no vision tower"):  # bytes are an image (tests/embeddings/test_eg2_images.py)
        emb.embed(b"bytes")
    for d in (0, 49, 2.5, True):
        with pytest.raises(InputError, match="dimensions"):
            emb.embed("x", dimensions=d)
    with pytest.raises(ContextError, match=r"texts\[1\] is \d+ tokens long, more than the model's 512"):
        emb.embed(["short", "word " * 600])
    with pytest.raises(InputError, match="sequences\\[0\\]"):
        emb.embed_ids([[1, 2, 99999]])
    assert emb.embed([]).shape == (0, 48)
    assert emb.embed("one string").shape == (1, 48)
    s = emb.similarity(emb.embed(["a b", "c"]), emb.embed("a b"))
    assert s.shape == (2, 1) and abs(s[0, 0] - 1) < 1e-6


# ------------------------------------------------------------------------------------------ tokenizer

@pytest.fixture(scope="module")
def real_vocab_ckpt(tmp_path_factory):
    """The real Gemma 4 vocabulary (262144 tokens) on a narrow model; max_seq_length 24 for truncation."""
    path = tmp_path_factory.mktemp("eg2_vocab")
    model = o.make_eg2_checkpoint(path, tokenizer="gemma4", vocab_size=262144, hidden_size=16, intermediate_size=32,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=16,
                                  num_hidden_layers=3, embedding_dim=12, max_seq_length=24)
    return path, model


TRICKY = ["Hello, world!", "  leading and trailing  ", "línea\tcon\u00e9 acentos\n\nnueva", "日本語のテキスト 🙂",
          "<bos> literal specials <eos>", "code: def f(x):\n    return x**2", "many words " * 12]


def test_tokenization_identical_to_reference(real_vocab_ckpt):
    path, model = real_vocab_ckpt
    st = o.st_model(path, cached=True)
    emb = load_embedder(path)
    assert emb.max_length == 24
    texts = [t for t in TRICKY]
    for prompt in ("", o.STANDARD_PROMPTS["SearchQuery"]):
        ref = o.st_token_ids(st, texts, prompt)
        assert [list(a) for a in emb.tokenize(texts, prompt=prompt, truncate=True)] == ref
        assert all(r[0] == 2 and r[-1] == 1 for r in ref)  # <bos> ... <eos>, the last kept when truncating
        got = emb.embed(texts, prompt=prompt, truncate=True)
        o.assert_parity(got, *o.ref_pair(model, ref), prompt)
    with pytest.raises(ContextError, match=r"texts\[6\].*truncate=True"):
        emb.embed(texts)


@pytest.mark.parametrize("bos,eos", [(True, False), (False, True)])
def test_special_tokens_follow_the_tokenizer(tmp_path, bos, eos):
    from transformers import AutoTokenizer

    o.write_eg2_tokenizer(tmp_path, "tiny", bos=bos, eos=eos)
    o.make_eg2_checkpoint(tmp_path, tokenizer=None)
    ref = AutoTokenizer.from_pretrained(str(tmp_path))(TEXTS)["input_ids"]
    assert [list(a) for a in load_embedder(tmp_path).tokenize(TEXTS)] == ref


# ------------------------------------------------------------------------------------------ quantized

#: the largest 1 - cos against the float64 reference, measured 2026-12-02 on gentle_ckpt (3 inputs
#: of 3-150 tokens): int8 3.0e-5, int4 4.8e-3 (int8 on the integer tiles, test_int8_prefill_paths_cosine: 3.1e-5); each
#: bound is about 2x the figure, far below an unrelated vector (1 - cos ~ 1)
INT8_GAP, INT4_GAP = 6e-5, 1e-2


@pytest.fixture(scope="module")
def gentle_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("eg2_gentle")
    model = o.make_eg2_checkpoint(path, seed=1, gentle=True, hidden_size=128, intermediate_size=256, head_dim=32,
                                  global_head_dim=64, hidden_size_per_layer_input=16)
    return path, model


@pytest.mark.parametrize("vnni", [True, False], ids=["vnni", "int16"])
def test_int8_prefill_paths_cosine(tmp_path, monkeypatch, vnni, w8a8_weights):
    """int8 with every projection of the integer-tile width (a multiple of 256): the encoder takes
    the int16-activation tiles whether or not the CPU has VNNI (never the W8A8 kernel, whose
    activation rounding exceeds the int8 weights' own error: `Int8Matrix.matmul_alike`), at the
    int8 bound."""
    from gemmalite.kernels import common

    if not common.HAVE_AVX2 or (vnni and not common.HAVE_VNNI):
        pytest.skip("no AVX2 / VNNI on this CPU")
    monkeypatch.setattr(common, "HAVE_VNNI", vnni)
    model = o.make_eg2_checkpoint(tmp_path, seed=2, gentle=True, hidden_size=256, intermediate_size=512,
                                  head_dim=64, global_head_dim=64, hidden_size_per_layer_input=16)
    seqs = _ids(np.random.RandomState(1), [7, 60, 200])
    emb = load_embedder(tmp_path, quant="int8")
    got = emb.embed_ids(seqs)
    # measured 2026-12-02 (this checkpoint, both paths the same bits): 1 - cos 2.2e-5-3.1e-5
    gap = (1 - o.cosine_rows(o.ref_embed_ids(model, seqs), got)).max()
    assert gap <= INT8_GAP, gap
    wide = [m for w in emb.graph.layers for m in w.matrices() if m.shape[1] % 256 == 0]
    assert len(wide) >= 7 * len(emb.graph.layers)  # q, k, v, o, gate, up, down
    assert not w8a8_weights & {id(m.q) for m in wide}  # the W8A8 kernel ran on none


@pytest.mark.parametrize("quant,bound", [("int8", INT8_GAP), ("int4", INT4_GAP)])
def test_quantized_cosine(gentle_ckpt, tmp_path, quant, bound):
    from gemmalite.tools.convert import convert

    path, model = gentle_ckpt
    seqs = _ids(np.random.RandomState(0), [3, 40, 150])
    ref = o.ref_embed_ids(model, seqs)
    emb = load_embedder(path, quant=quant)
    got = emb.embed_ids(seqs)
    gap = 1 - o.cosine_rows(ref, got)
    assert gap.max() <= bound, gap
    assert type(emb.graph.layers[0].q).__name__ == {"int8": "Int8Matrix", "int4": "Int4Matrix"}[quant]
    out = convert(path, tmp_path / quant, quant, progress=False)
    conv = load_embedder(out)
    # the converted checkpoint holds exactly the weights quantizing on load makes (every array, bit
    # for bit), so its vectors are the same bits (no product depends on rows or threads)
    for a, b in zip(conv.graph.layers, emb.graph.layers):
        for ma, mb in zip(a.matrices(), b.matrices()):
            for part, arr in ma.tensors().items():
                np.testing.assert_array_equal(arr, mb.tensors()[part])
    np.testing.assert_array_equal(conv.embed_ids(seqs), got)
    assert conv.prompts == emb.prompts and conv.embed("Hello").shape == (1, 48)


# ------------------------------------------------------------------------------------------ corpus, CLI

def _corpus(path, n):
    rng = np.random.RandomState(5)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(rng.choice(words, size=rng.randint(1, 40)))
            f.write(json.dumps({"id": f"doc-{i}", "text": text}) + "\n" + ("\n" if i % 7 == 0 else ""))
    return [json.loads(x)["text"] for x in open(path) if x.strip()]


def test_corpus_resume_equals_uninterrupted(text_ckpt, tmp_path, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    from gemmalite.embeddings.corpus import embed_corpus

    path = text_ckpt[0]
    texts = _corpus(tmp_path / "c.jsonl", 45)
    emb = load_embedder(path)
    full = embed_corpus(emb, tmp_path / "c.jsonl", tmp_path / "full.parquet", prompt_name="Document",
                        chunk_size=8, progress=False)
    assert full["rows"] == 45 and not (tmp_path / "full.parquet.parts").exists()

    calls = {"n": 0}
    real = emb.embed

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(emb, "embed", flaky)
    with pytest.raises(KeyboardInterrupt):
        embed_corpus(emb, tmp_path / "c.jsonl", tmp_path / "v.parquet", prompt_name="Document", chunk_size=8,
                     progress=False)
    assert len(list((tmp_path / "v.parquet.parts").glob("part-*.parquet"))) == 3
    monkeypatch.setattr(emb, "embed", real)
    with pytest.raises(InputError, match="other settings"):
        embed_corpus(emb, tmp_path / "c.jsonl", tmp_path / "v.parquet", chunk_size=8, progress=False)
    done = embed_corpus(emb, tmp_path / "c.jsonl", tmp_path / "v.parquet", prompt_name="Document", chunk_size=8,
                        progress=False)
    assert done["resumed_rows"] == 24 and done["rows"] == 45
    a, b = pq.read_table(tmp_path / "full.parquet"), pq.read_table(tmp_path / "v.parquet")
    assert a.column("id").to_pylist() == b.column("id").to_pylist() == [f"doc-{i}" for i in range(45)]
    va = np.array(a.column("embedding").to_pylist(), np.float32)
    np.testing.assert_array_equal(va, np.array(b.column("embedding").to_pylist(), np.float32))
    np.testing.assert_allclose(va, emb.embed(texts, prompt_name="Document"), atol=2e-6)


def test_cli_embed(text_ckpt, tmp_path, capsys):
    from gemmalite.cli import main

    path = str(text_ckpt[0])
    assert main(["embed", path, "Hello world", "a", "--prompt-name", "SearchQuery", "--dimensions", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    emb = load_embedder(path)
    np.testing.assert_allclose(out["embeddings"], emb.embed(["Hello world", "a"], prompt_name="SearchQuery",
                                                            dimensions=16), atol=1e-7)
    assert main(["embed", path, "x", "--prompt-name", "Nope"]) == 1
    assert "unknown prompt name" in capsys.readouterr().err
    (tmp_path / "c.jsonl").write_text('"first text"\n"second"\n')
    assert main(["embed", path, "--input", str(tmp_path / "c.jsonl"), "--output", str(tmp_path / "o.parquet"),
                 "-q"]) == 0
    pq = pytest.importorskip("pyarrow.parquet")
    t = pq.read_table(tmp_path / "o.parquet")
    assert t.column("id").to_pylist() == [0, 1]
    np.testing.assert_allclose(np.array(t.column("embedding").to_pylist()), emb.embed(["first text", "second"]),
                               atol=2e-6)


# ------------------------------------------------------------------------------------------ synth

def test_synth_eg2_tiny_loads_in_transformers(tmp_path):
    """`synth --preset eg2-tiny` (bf16, real tokenizer, prompts) is a checkpoint transformers and
    sentence-transformers read, and gemmalite computes what they compute."""
    from gemmalite.tools.synth_eg2 import synth_eg2

    # without its towers: sentence-transformers loads a multimodal folder's video processor, which
    # needs torchvision (tests/tools/test_synth_towers.py checks the towered folder in transformers)
    path = synth_eg2("eg2-tiny", tmp_path / "s", tokenizer=o.gemma4_tokenizer_dir() / "tokenizer.json", progress=False,
                     vision=False)
    st = o.st_model(path)
    model = st[0].model  # transformers' float32 eager load of the folder
    emb = load_embedder(path)
    assert {k: v for k, v in emb.prompts.items()} == o.STANDARD_PROMPTS
    ids = o.st_token_ids(st, TRICKY, o.STANDARD_PROMPTS["Document"])
    got = emb.embed(TRICKY, prompt_name="Document")
    o.assert_parity(got, *o.ref_pair(model, ids))
    o.assert_parity(got, *_st_pair(st, TRICKY, prompt_name="Document"), "sentence-transformers")
