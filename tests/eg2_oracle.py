"""transformers / sentence-transformers oracle for the EmbeddingGemma 2 tests (contains no tests).

Builds small random EmbeddingGemma 2 checkpoints with transformers 5.23 (float32, eager):
every parameter randomised (RMSNorm scales, ``layer_scalar`` buffers and the PLE projection
norm included), saved with ``save_pretrained`` as

* ``layout="text"``: ``EmbeddingGemma2TextModel`` (``model_type: embedding_gemma2_text``, no prefix);
* ``layout="nested"``: ``EmbeddingGemma2Model`` (``model_type: embedding_gemma2``, ``language_model.``
  prefix), optionally with tiny vision / audio towers whose tensors a text runtime must skip;

plus a tokenizer whose post-processor adds ``<bos> … <eos>`` (the tiny Gemma-style BPE of
``hf_oracle`` or the real Gemma 4 vocabulary), and the sentence-transformers files the reference
pipeline reads (``modules.json``: Transformer → mean Pooling → Normalize;
``config_sentence_transformers.json`` with the prompt table), written by sentence-transformers
itself. References: ``st_encode`` (the real pipeline, float32, padded batches) and
``ref_embed_ids`` (the same model in float64, one sequence at a time, masked mean + L2 norm).

The tiny config exercises: sliding layers whose radius (``sliding_window``) is far shorter than
the inputs, full layers with a different head size and KV-head count, several layer patterns,
projection-only PLE. The encoder has no KV sharing (transformers' class has no such option).
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
from pathlib import Path

import numpy as np
import torch

import hf_oracle

torch.set_num_threads(1)

#: the prompt table written into synthetic checkpoints (EmbeddingGemma's task-prefix style,
#: under the prompt names EmbeddingGemma 2 tools use)
STANDARD_PROMPTS: dict[str, str] = {
    "SearchQuery": "task: search result | query: ",
    "Document": "title: none | text: ",
    "QuestionAnswering": "task: question answering | query: ",
    "FactChecking": "task: fact checking | query: ",
    "CodeRetrieval": "task: code retrieval | query: ",
    "Classification": "task: classification | query: ",
    "Clustering": "task: clustering | query: ",
    "SentenceSimilarity": "task: sentence similarity | query: ",
}

#: defaults of the tiny text config (every field overridable)
TINY_EG2_CONFIG: dict = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,  # builder keys: transformers bakes them into per_layer_config
    num_global_key_value_heads=1,
    layer_types=["sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention", "full_attention", "full_attention"],
    sliding_window=3,  # inclusive radius: |q - k| <= 3 -> 7 keys, far fewer than the inputs
    hidden_size_per_layer_input=8,
    embedding_dim=48,
    max_position_embeddings=512,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)


def eg2_config_kwargs(overrides: dict) -> dict:
    kw = json.loads(json.dumps(TINY_EG2_CONFIG))
    kw.update(overrides)
    n = kw["num_hidden_layers"]
    if "layer_types" not in overrides and len(kw["layer_types"]) != n:
        base = ["sliding_attention", "sliding_attention", "full_attention"]
        kw["layer_types"] = [base[i % 3] for i in range(n)]
        kw["layer_types"][-1] = "full_attention"
    return {k: v for k, v in kw.items() if v is not None}


def text_module(model):
    """The EmbeddingGemma2TextModel inside either layout."""
    return model.language_model if hasattr(model, "language_model") else model


@torch.no_grad()
def randomize_eg2_weights(model, seed: int = 0, *, embed_std: float = 0.5, gentle: bool = False) -> None:
    """Overwrite every text-model parameter and the ``layer_scalar`` buffers with random values
    (norm scales away from 1 so that a ``1 + w`` or missing norm is far off). ``gentle``: every
    scale in [0.8, 1.2] (post-norms [0.2, 0.4]) instead, a network about as sensitive to weight noise as a trained one
    (for the int8 / int4 fidelity bounds; the wide ranges make a random net chaotic)."""
    g = torch.Generator().manual_seed(seed)
    if gentle:
        for name, t in sorted(list(text_module(model).named_parameters()) + [
                (k, b) for k, b in text_module(model).named_buffers() if k.endswith("layer_scalar")], key=lambda kv: kv[0]):
            if t.ndim == 1 and ".post_" in name:  # sub-block outputs: a moderate update of the residual
                t.copy_(0.2 + 0.2 * torch.rand(t.shape, generator=g))
            elif t.ndim == 1:
                t.copy_(0.8 + 0.4 * torch.rand(t.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                t.copy_(torch.randn(t.shape, generator=g) * embed_std)
            else:
                t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(t.shape[1]))
        return
    text = text_module(model)
    named = [(k, p) for k, p in text.named_parameters()]
    named += [(k, b) for k, b in text.named_buffers() if k.endswith("layer_scalar")]
    for name, t in sorted(named, key=lambda kv: kv[0]):
        if name.endswith("layer_scalar"):
            t.copy_(0.5 + torch.rand(t.shape, generator=g))
        elif t.ndim == 1 and ".post_" in name:
            t.copy_(1.0 + 2.0 * torch.rand(t.shape, generator=g))
        elif t.ndim == 1 and (".q_norm." in name or ".k_norm." in name):
            t.copy_(0.25 + 0.5 * torch.rand(t.shape, generator=g))
        elif t.ndim == 1:  # other RMSNorm scales, the PLE projection norm, the final norm
            t.copy_(0.5 + torch.rand(t.shape, generator=g))
        elif name.endswith("embed_tokens.weight"):
            t.copy_(torch.randn(t.shape, generator=g) * embed_std)
        elif name.endswith("per_layer_input_gate.weight"):
            t.copy_(torch.randn(t.shape, generator=g) * 0.15 / math.sqrt(t.shape[1]))
        else:  # linear [out, in]
            t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(t.shape[1]))
    unset = [k for k, p in text.named_parameters() if k not in dict(named)]
    assert not unset, unset


TINY_VISION_CONFIG = hf_oracle.TINY_VISION_CONFIG
TINY_AUDIO_CONFIG = hf_oracle.TINY_AUDIO_CONFIG


def build_eg2_model(*, layout: str = "text", seed: int = 0, towers: bool = False, gentle: bool = False, **overrides):
    """Tiny random EmbeddingGemma 2 model (float32, eager, eval; not saved)."""
    from transformers import (EmbeddingGemma2Config, EmbeddingGemma2Model, EmbeddingGemma2TextConfig,
                              EmbeddingGemma2TextModel)

    kw = eg2_config_kwargs(overrides)
    torch.manual_seed(seed)
    if layout == "text":
        model = EmbeddingGemma2TextModel(EmbeddingGemma2TextConfig(**kw, attn_implementation="eager"))
    elif layout == "nested":
        extra = dict(vision_config=dict(TINY_VISION_CONFIG), audio_config=dict(TINY_AUDIO_CONFIG)) if towers else {}
        model = EmbeddingGemma2Model(EmbeddingGemma2Config(text_config=kw, attn_implementation="eager", **extra))
    else:
        raise ValueError(f"unknown layout {layout!r}")
    model = model.float()
    randomize_eg2_weights(model, seed, gentle=gentle)
    return model.eval()


# ------------------------------------------------------------------------------------------
# tokenizers
# ------------------------------------------------------------------------------------------

def set_special_template(path: Path, bos: bool = True, eos: bool = True) -> None:
    """Rewrite ``tokenizer.json``'s post-processor: ``[<bos>] $A [<eos>]`` (None when neither)."""
    f = Path(path) / "tokenizer.json"
    tj = json.loads(f.read_text())
    single = ([{"SpecialToken": {"id": "<bos>", "type_id": 0}}] if bos else []) + \
        [{"Sequence": {"id": "A", "type_id": 0}}] + ([{"SpecialToken": {"id": "<eos>", "type_id": 0}}] if eos else [])
    pair = single + [{"Sequence": {"id": "B", "type_id": 1}}]
    specials = {}
    if bos:
        specials["<bos>"] = {"id": "<bos>", "ids": [2], "tokens": ["<bos>"]}
    if eos:
        specials["<eos>"] = {"id": "<eos>", "ids": [1], "tokens": ["<eos>"]}
    tj["post_processor"] = {"type": "TemplateProcessing", "single": single, "pair": pair,
                            "special_tokens": specials} if (bos or eos) else None
    f.write_text(json.dumps(tj, ensure_ascii=False))


_GEMMA4_DIR: list[Path] = []


def gemma4_tokenizer_dir() -> Path:
    """The real Gemma 4 tokenizer as tokenizer.json (converted from the GGUF vocabulary gemmalite
    ships, once per process: the conversion takes a while)."""
    if not _GEMMA4_DIR:
        import tempfile

        from gemmalite.tools.synth import export_tokenizer

        d = Path(tempfile.mkdtemp(prefix="eg2-gemma4-tok-"))
        export_tokenizer(None, d)
        _GEMMA4_DIR.append(d)
    return _GEMMA4_DIR[0]


def write_eg2_tokenizer(path, kind: str = "tiny", vocab_size: int = 512, *, bos: bool = True, eos: bool = True) -> None:
    """``kind="tiny"``: hf_oracle's Gemma-style BPE (vocab ``vocab_size``); ``"gemma4"``: the real
    Gemma 4 vocabulary (262144 tokens) as gemmalite ships it. Both end up with a post-processor that
    adds ``<bos>`` / ``<eos>`` as asked, which is what transformers' AutoTokenizer applies."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if kind == "tiny":
        hf_oracle.write_tiny_tokenizer(path, vocab_size)
        (path / "chat_template.jinja").unlink(missing_ok=True)
    elif kind == "gemma4":
        import shutil

        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(gemma4_tokenizer_dir() / name, path / name)
    else:
        raise ValueError(kind)
    conf = json.loads((path / "tokenizer_config.json").read_text())
    conf.update(tokenizer_class="GemmaTokenizer", add_bos_token=bos, add_eos_token=eos, padding_side="right")
    conf.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
    set_special_template(path, bos, eos)


# ------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------

def write_st_files(path, dim: int, prompts: dict[str, str] | None = STANDARD_PROMPTS,
                   max_seq_length: int | None = None) -> None:
    """The sentence-transformers files, written by sentence-transformers from the saved folder:
    Transformer -> mean Pooling -> Normalize, with ``prompts``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    path = Path(path)
    tr = Transformer(str(path), max_seq_length=max_seq_length, model_kwargs={"attn_implementation": "eager", "dtype": torch.float32},
                     tokenizer_name_or_path=_tokenizer_only(path))
    st = SentenceTransformer(modules=[tr, Pooling(dim, pooling_mode="mean"), Normalize()], prompts=prompts or {},
                             device="cpu")
    st.save(str(path))
    _ST_CACHE[str(path)] = st


_ST_CACHE: dict[str, object] = {}


def _tokenizer_only(path: Path) -> str:
    """A copy of the folder's tokenizer files alone. For the nested layout transformers' AutoProcessor
    wants the whole multimodal processor (image / audio / video configs); on text its call is the
    tokenizer's, so the reference pipeline here loads the tokenizer by itself."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="eg2-tok-"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (path / name).exists():
            shutil.copy(path / name, d / name)
    return str(d)


def make_eg2_checkpoint(path, *, layout: str = "text", seed: int = 0, tokenizer: str | None = "tiny",
                        st: bool = True, prompts: dict[str, str] | None = STANDARD_PROMPTS, towers: bool = False,
                        bos: bool = True, eos: bool = True, max_seq_length: int | None = None, gentle: bool = False,
                        **overrides):
    """Build, save (safetensors, float32) and return the torch model of a tiny EG2 checkpoint."""
    path = Path(path)
    kw = eg2_config_kwargs(overrides)
    model = build_eg2_model(layout=layout, seed=seed, towers=towers, gentle=gentle, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        write_eg2_tokenizer(path, tokenizer, kw["vocab_size"], bos=bos, eos=eos)
        if st:
            write_st_files(path, kw["embedding_dim"], prompts, max_seq_length)
    return model


def load_eg2_hf(path):
    """transformers' float32 eager load of a saved folder (either layout)."""
    from transformers import AutoConfig, EmbeddingGemma2Model, EmbeddingGemma2TextModel

    cfg = AutoConfig.from_pretrained(path)
    cls = EmbeddingGemma2Model if cfg.model_type == "embedding_gemma2" else EmbeddingGemma2TextModel
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


# ------------------------------------------------------------------------------------------
# references
# ------------------------------------------------------------------------------------------

@torch.no_grad()
def token_outputs(model, ids, dtype=torch.float64) -> np.ndarray:
    """Per-token ``embedding_projection`` outputs ``[T, D]`` of one sequence (no padding); float64
    throughout in float64 (`hf_oracle.float64_throughout`)."""
    m = text_module(model)
    if dtype != torch.float32:
        m = copy.deepcopy(m).to(dtype)
    x = torch.tensor([list(ids)], dtype=torch.long)
    with hf_oracle.float64_throughout() if dtype == torch.float64 else contextlib.nullcontext():
        return m(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state[0].double().numpy()


def ref_embed_ids(model, sequences, dtype=torch.float64, dimensions: int | None = None) -> np.ndarray:
    """Mean over the tokens, L2-normalised (then Matryoshka cut + renormalise), one sequence at a
    time in ``dtype``: the float64 reference by default. float64 ``[n, d]``."""
    m = text_module(model)
    if dtype != torch.float32:
        m = copy.deepcopy(m).to(dtype)
    out = []
    for ids in sequences:
        v = token_outputs(m, ids, dtype=torch.float32 if dtype == torch.float32 else dtype)
        v = v.mean(axis=0)
        v = v / np.linalg.norm(v)
        if dimensions is not None:
            v = v[:dimensions] / np.linalg.norm(v[:dimensions])
        out.append(v)
    return np.stack(out)


def st_model(path, *, cached: bool = False):
    """The saved sentence-transformers pipeline (modules.json, prompts), float32, eager. ``cached``:
    the one `write_st_files` built before saving it (loading a 262144-token tokenizer is slow)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    if cached and str(path) in _ST_CACHE:
        return _ST_CACHE[str(path)]
    path = Path(path)
    if json.loads((path / "config.json").read_text()).get("model_type") == "embedding_gemma2_text":
        return SentenceTransformer(str(path), device="cpu", model_kwargs={"attn_implementation": "eager", "dtype": torch.float32})
    conf = json.loads((path / "config_sentence_transformers.json").read_text())
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((path / "modules.json").read_text())]
    assert modules == ["Transformer", "Pooling", "Normalize"], modules
    tr = Transformer(str(path), model_kwargs={"attn_implementation": "eager", "dtype": torch.float32}, tokenizer_name_or_path=_tokenizer_only(path))
    pool = Pooling.load(str(path / "1_Pooling"))
    return SentenceTransformer(modules=[tr, pool, Normalize()], prompts=conf.get("prompts"), device="cpu")


def st_encode(st, texts, dtype=torch.float32, **kw) -> np.ndarray:
    """sentence-transformers' own encode (padded batches): the reference pipeline, float32 as a
    user runs it, or ``dtype=torch.float64`` (a float64 copy, float64 throughout)."""
    if dtype == torch.float64:
        st = copy.deepcopy(st).double()
    with torch.no_grad(), hf_oracle.float64_throughout() if dtype == torch.float64 else contextlib.nullcontext():
        return st.encode(list(texts), convert_to_numpy=True, normalize_embeddings=False, **kw).astype(np.float64)


def st_token_ids(st, texts, prompt: str | None = None) -> list[list[int]]:
    """The token ids the reference pipeline feeds the model (prompt prepended to the text, padding removed)."""
    texts = [(prompt or "") + t for t in texts]
    feats = st.tokenize(texts)
    ids, mask = feats["input_ids"], feats["attention_mask"]
    return [[int(i) for i, m in zip(row, mrow) if m] for row, mrow in zip(ids.tolist(), mask.tolist())]


def ref_pair(model, sequences, dimensions: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(float64, float32) references of ``sequences`` (`ref_embed_ids`), for `assert_parity`."""
    return (ref_embed_ids(model, sequences, dimensions=dimensions),
            ref_embed_ids(model, sequences, torch.float32, dimensions))


#: how far gemmalite's float32 vectors may be from the float64 reference, in units of
#: transformers' own float32 distance from it (the vision and audio towers' yardstick). Measured
#: 2026-12-02 on the text / nested checkpoints of test_eg2.py (5 texts of 3-380 tokens): ours
#: 5e-8-1.9e-7, transformers' float32 7e-8-1.9e-7, the largest row ratio 1.7.
SLACK = 4.0


def assert_parity(got, ref64, ref32, what: object = "", slack: float = SLACK) -> None:
    """float32 vectors ``got [n, d]`` as close to the float64 reference as transformers' own float32
    run is: ``max |got - ref64| <= slack * max |ref32 - ref64|`` over the rows (no absolute floor:
    the reference's error is measured on the same inputs; where it is 0, as for a 1-dimension cut,
    ours must be exact too). The failure names both ``1 - cos``."""
    got, ref64, ref32 = (np.atleast_2d(np.asarray(a, np.float64)) for a in (got, ref64, ref32))
    assert got.shape == ref64.shape == ref32.shape, (what, got.shape, ref64.shape, ref32.shape)
    err, own = np.abs(got - ref64).max(), np.abs(ref32 - ref64).max()
    assert err <= slack * own, (
        f"{what}: max |ours - float64| = {err:.3g} > {slack:g} x transformers' float32 error {own:.3g}; "
        f"1 - cos: ours {(1 - cosine_rows(got, ref64)).max():.3g}, "
        f"transformers float32 {(1 - cosine_rows(ref32, ref64)).max():.3g}")


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


if __name__ == "__main__":  # smoke run: python tests/eg2_oracle.py
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for layout in ("text", "nested"):
            p = Path(d) / layout
            model = make_eg2_checkpoint(p, layout=layout, towers=layout == "nested")
            st = st_model(p)
            texts = ["Hello world", "the quick brown fox jumps over the lazy dog " * 3, "a"]
            ids = st_token_ids(st, texts)
            ref = ref_embed_ids(model, ids)
            got = st_encode(st, texts)
            print(layout, sorted(x.name for x in p.iterdir()), [len(i) for i in ids], ids[0],
                  cosine_rows(ref, got).min(), file=sys.stderr)
            q = st_encode(st, texts, prompt_name="SearchQuery")
            ids_q = st_token_ids(st, texts, STANDARD_PROMPTS["SearchQuery"])
            print("prompt", cosine_rows(ref_embed_ids(model, ids_q), q).min(), ids_q[0][:8], file=sys.stderr)
