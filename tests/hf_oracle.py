"""transformers oracle for the parity tests (imported by tests, contains no tests).

Builds tiny random Gemma 4 checkpoints with transformers 5.23 (float32, eager attention),
saves them with ``save_pretrained`` and gives reference logits / greedy generations /
hidden states. Also writes a tiny Gemma-style ``tokenizer.json`` (+ chat template) that both
gemmalite and transformers' ``AutoTokenizer`` can load.

Every weight of the text model is randomised, including every RMSNorm scale (uniform in
[0.5, 1.5]; the sandwich post-norms in [1, 3], q/k norms in [0.25, 0.75]; so a ``(1 + w)``
formula is far off) and the ``layer_scalar`` buffers (uniform in [0.5, 1.5]); non-persistent
buffers (RoPE inverse frequencies, embedding scales) are left alone. torch is only needed by
the tests, never by gemmalite.
"""
from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(1)  # tiny models: one thread is fastest (and immune to oversubscription)


@contextmanager
def float64_throughout():
    """transformers casts to float32 on purpose (``.float()`` in RMSNorm and of q / k / v, a
    float32 softmax): in a float64 run those casts keep float64 here, so that the float64
    reference is float64 everywhere but the RoPE tables (float32 angles by the model's definition,
    which gemmalite reproduces). A product of a float32 tensor made from integers (the vision
    pooler's one-hot weights) and a float64 one takes the float32 side exactly to float64."""
    tensor_float, softmax, matmul = torch.Tensor.float, torch.nn.functional.softmax, torch.Tensor.__matmul__

    def as_float(self, *a, **k):
        return self if self.dtype == torch.float64 else tensor_float(self, *a, **k)

    def softmax64(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=torch.float64 if x.dtype == torch.float64 else dtype)

    def matmul64(a, b):
        if {a.dtype, b.dtype} == {torch.float32, torch.float64}:
            a, b = a.double(), b.double()
        return matmul(a, b)

    torch.Tensor.float, torch.nn.functional.softmax, torch.Tensor.__matmul__ = as_float, softmax64, matmul64
    try:
        yield
    finally:
        torch.Tensor.float, torch.nn.functional.softmax, torch.Tensor.__matmul__ = tensor_float, softmax, matmul

DATA_DIR = Path(__file__).resolve().parent / "data"
CHAT_TEMPLATE_PATH = DATA_DIR / "gemma4-it-chat-template.jinja"

# ------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------

#: defaults of the tiny text config; every field is overridable through ``make_gemma4_checkpoint``
TINY_TEXT_CONFIG: dict = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,  # NB transformers' default when absent is 512, so always pass it
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    sliding_window=8,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=512,
    final_logit_softcapping=30.0,
    max_position_embeddings=1024,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
    tie_word_embeddings=True,
)

#: tiny (but present) vision / audio towers for the ConditionalGeneration layout: the engine
#: must skip their tensors
TINY_VISION_CONFIG = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, head_dim=8, position_embedding_size=64,
)
TINY_AUDIO_CONFIG = dict(
    hidden_size=16, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[4, 4],
    output_proj_dims=16, conv_kernel_size=3,
)


def _text_config_kwargs(overrides: dict) -> dict:
    kw = json.loads(json.dumps(TINY_TEXT_CONFIG))  # deep copy
    kw.update(overrides)
    n = kw["num_hidden_layers"]
    if "layer_types" not in overrides and len(kw["layer_types"]) != n:
        base = ["sliding_attention", "sliding_attention", "full_attention"]
        kw["layer_types"] = [base[i % 3] for i in range(n)]
        kw["layer_types"][-1] = "full_attention"
    if "vocab_size" in overrides and "vocab_size_per_layer_input" not in overrides:
        kw["vocab_size_per_layer_input"] = kw["vocab_size"]
    return kw


def _text_module(model):
    """The Gemma4TextModel inside either layout."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


@torch.no_grad()
def randomize_text_weights(model, seed: int = 0, *, embed_std: float = 0.2) -> None:
    """Overwrite every text-model parameter and the ``layer_scalar`` buffers with random values."""
    g = torch.Generator().manual_seed(seed)
    text = _text_module(model)
    named = [(f"text.{k}", p) for k, p in text.named_parameters()]
    named += [(f"text.{k}", b) for k, b in text.named_buffers() if k.endswith("layer_scalar")]
    lm_head = model.lm_head.weight
    if lm_head.data_ptr() != text.embed_tokens.weight.data_ptr():
        named.append(("lm_head.weight", lm_head))
    for name, t in sorted(named, key=lambda kv: kv[0]):
        if name.endswith("layer_scalar"):
            t.copy_(0.5 + torch.rand(t.shape, generator=g))
        elif t.ndim == 1 and ".post_" in name:  # sandwich post-norms: larger, so that the layers
            t.copy_(1.0 + 2.0 * torch.rand(t.shape, generator=g))  # (not the embedding) drive the output
        elif t.ndim == 1 and (".q_norm." in name or ".k_norm." in name):  # smaller: softer attention,
            t.copy_(0.25 + 0.5 * torch.rand(t.shape, generator=g))  # less float32 error amplification
        elif t.ndim == 1:  # every other RMSNorm scale in the text model
            t.copy_(0.5 + torch.rand(t.shape, generator=g))
        elif name.endswith("embed_tokens.weight") or name.endswith("embed_tokens_per_layer.weight") \
                or name == "lm_head.weight":
            t.copy_(torch.randn(t.shape, generator=g) * embed_std)
        elif name.endswith("per_layer_input_gate.weight"):
            # reads the un-normalised residual stream (rms ~10 here): keep the gate pre-activations
            # O(1), not deep in GELU's tail where float32 rounding is amplified ~1000x by the norm
            t.copy_(torch.randn(t.shape, generator=g) * 0.15 / math.sqrt(t.shape[1]))
        else:  # linear [out, in]
            t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(t.shape[1]))


def build_gemma4_model(*, layout: str = "causal", seed: int = 0, **text_config_overrides):
    """Tiny random Gemma 4 model (not saved). ``layout`` is "causal" or "conditional"."""
    from transformers import (Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration,
                              Gemma4TextConfig)

    kw = _text_config_kwargs(text_config_overrides)
    torch.manual_seed(seed)
    if layout == "causal":
        cfg = Gemma4TextConfig(**kw, attn_implementation="eager")
        model = Gemma4ForCausalLM(cfg)
    elif layout == "conditional":
        cfg = Gemma4Config(
            text_config=kw, vision_config=dict(TINY_VISION_CONFIG), audio_config=dict(TINY_AUDIO_CONFIG),
            tie_word_embeddings=kw.get("tie_word_embeddings", True), attn_implementation="eager",
        )
        model = Gemma4ForConditionalGeneration(cfg)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    model = model.float()
    randomize_text_weights(model, seed)
    model.eval()
    return model


def make_gemma4_checkpoint(path, *, layout: str = "causal", seed: int = 0, hub_style: bool = False,
                           tokenizer: bool = False, dtype: str = "float32", extra_consumer_kv: bool = False,
                           **text_config_overrides):
    """Build a tiny random Gemma 4 checkpoint, ``save_pretrained(path)`` it (safetensors) and
    return the torch model (float32, eager, eval mode) that computes what the files hold.

    ``hub_style=True`` rewrites the saved text config the way hub checkpoints spell it:
    ``global_head_dim`` / ``num_global_key_value_heads`` builder keys instead of
    ``per_layer_config``. ``tokenizer=True`` also writes the tiny tokenizer into the folder.
    ``dtype="bfloat16"`` stores the weights in bf16 (as on the hub); the returned model is then
    transformers' float32 load of those files. ``extra_consumer_kv=True`` adds (junk)
    ``k_proj``/``v_proj``/``k_norm``/``v_norm`` tensors for the KV-reusing layers, as original
    checkpoints carry; transformers ignores them.
    """
    path = Path(path)
    model = build_gemma4_model(layout=layout, seed=seed, **text_config_overrides)
    if dtype == "bfloat16":
        model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
        model = None
    elif dtype == "float32":
        model.save_pretrained(path, safe_serialization=True)
    else:
        raise ValueError(f"unsupported dtype {dtype!r}")
    if extra_consumer_kv:
        _add_consumer_kv_tensors(path, seed)
    if hub_style:
        kw = _text_config_kwargs(text_config_overrides)
        cfg_path = path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        tc = cfg["text_config"] if "text_config" in cfg else cfg
        tc.pop("per_layer_config", None)
        tc["global_head_dim"] = kw["global_head_dim"]
        if kw.get("num_global_key_value_heads") is not None:
            tc["num_global_key_value_heads"] = kw["num_global_key_value_heads"]
        cfg_path.write_text(json.dumps(cfg, indent=2))
    if tokenizer:
        write_tiny_tokenizer(path, _text_config_kwargs(text_config_overrides)["vocab_size"])
    return model if model is not None else load_hf(path)


def _add_consumer_kv_tensors(path: Path, seed: int) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    tc = cfg.get_text_config()
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    prefix = "model.language_model." if cfg.model_type == "gemma4" else "model."
    g = torch.Generator().manual_seed(seed + 1)
    dtype = tensors[prefix + "embed_tokens.weight"].dtype
    for i, mode in enumerate(tc.kv_sharing_modes):
        if mode != "reuse":
            continue
        lc = tc.per_layer_config[i]
        d, kv = lc.head_dim, lc.num_key_value_heads
        a = f"{prefix}layers.{i}.self_attn."
        tensors[a + "k_proj.weight"] = torch.randn(kv * d, tc.hidden_size, generator=g).to(dtype)
        tensors[a + "v_proj.weight"] = torch.randn(kv * d, tc.hidden_size, generator=g).to(dtype)
        tensors[a + "k_norm.weight"] = torch.rand(d, generator=g).to(dtype)
        tensors[a + "v_norm.weight"] = torch.rand(d, generator=g).to(dtype)
    save_file(tensors, str(f), metadata={"format": "pt"})


def load_hf(path):
    """Reload a saved checkpoint with transformers (float32, eager)."""
    from transformers import AutoConfig, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    cfg = AutoConfig.from_pretrained(path)
    cls = Gemma4ForConditionalGeneration if cfg.model_type == "gemma4" else Gemma4ForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def text_config_of(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


@torch.no_grad()
def hf_logits(model, ids) -> np.ndarray:
    """Softcapped logits ``[T, V]`` of a full forward over ``ids``."""
    x = torch.tensor([list(ids)], dtype=torch.long)
    out = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
    return out.logits[0].float().numpy()


@torch.no_grad()
def hf_greedy(model, ids, n: int, *, eos_token_id=None) -> list[int]:
    """``generate(do_sample=False, max_new_tokens=n)``; returns only the new tokens (a trailing eos
    is kept, as transformers returns it)."""
    x = torch.tensor([list(ids)], dtype=torch.long)
    eos = text_config_of(model).eos_token_id if eos_token_id is None else eos_token_id
    out = model.generate(
        input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
        min_new_tokens=0, eos_token_id=eos, pad_token_id=0, top_k=None, top_p=None, temperature=None,
        repetition_penalty=None,
    )
    return out[0, len(ids):].tolist()


@torch.no_grad()
def hf_hidden_states(model, ids) -> list[np.ndarray]:
    """``output_hidden_states=True`` of the text model: ``num_layers + 1`` arrays ``[T, H]``.
    Element 0 is the scaled token embedding (input of layer 0), element ``l`` (1 <= l < L) the
    output of layer ``l-1`` (after its ``layer_scalar``) and the last one the output of the final
    norm (transformers replaces the last layer's raw output by ``last_hidden_state``)."""
    x = torch.tensor([list(ids)], dtype=torch.long)
    out = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False, output_hidden_states=True)
    return [h[0].float().numpy() for h in out.hidden_states]


# ------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------

#: Gemma 4 special tokens at their real ids
GEMMA_SPECIAL_TOKENS = {
    0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>",
    46: "<|tool>", 47: "<tool|>", 48: "<|tool_call>", 49: "<tool_call|>",
    50: "<|tool_response>", 51: "<tool_response|>", 52: '<|"|>',
    98: "<|think|>", 100: "<|channel>", 101: "<channel|>", 105: "<|turn>", 106: "<turn|>",
}
SPACE = "\u2581"  # "▁"
_BYTE_BASE = 109  # <0x00> .. <0xFF> at 109 .. 364

_CORPUS = (
    "the quick brown fox jumps over the lazy dog. Hello, world! How are you today? "
    "I am fine, thank you. What is the capital of France? The capital of France is Paris. "
    "Tell me a story about a cat and a dog who were friends in the old town. "
    "Once upon a time there was a little model that wanted to generate text. "
    "Please answer the question: what is two plus two? The answer is four. "
    "This is a test of the tokenizer and the chat template, system user model turn. "
) * 3


def _tiny_vocab(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    if vocab_size < 512:
        raise ValueError("the tiny tokenizer needs vocab_size >= 512")
    vocab: dict[str, int] = {}
    for i in range(_BYTE_BASE):
        vocab[GEMMA_SPECIAL_TOKENS.get(i, f"<unused{i}>")] = i
    del vocab["<unused107>"], vocab["<unused108>"]
    vocab["\n"] = 107
    vocab["\n\n"] = 108
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = _BYTE_BASE + b
    nxt = _BYTE_BASE + 256
    for ch in [SPACE] + [chr(c) for c in range(0x21, 0x7F)]:
        vocab[ch] = nxt
        nxt += 1
    merges: list[tuple[str, str]] = [("\n", "\n")]
    # deterministic BPE "training" on a tiny fixed corpus
    words = [list(w) for w in _CORPUS.replace(" ", SPACE).split(SPACE) if w]
    words = [[SPACE] + w for w in words]
    while nxt < vocab_size:
        pairs: Counter = Counter()
        for w in words:
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += 1
        cands = [(c, p) for p, c in pairs.items() if p[0] + p[1] not in vocab]
        if not cands:
            break
        cands.sort(key=lambda cp: (-cp[0], cp[1]))
        a, b = cands[0][1]
        merges.append((a, b))
        vocab[a + b] = nxt
        nxt += 1
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                i += 1
    while nxt < vocab_size:  # pad with unused tokens if the corpus ran out of pairs
        vocab[f"<unused{nxt}>"] = nxt
        nxt += 1
    return vocab, merges


def write_tiny_tokenizer(path, vocab_size: int = 512) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` into ``path``.

    Gemma-like: BPE over "▁"-for-space text with byte fallback, no space prefix, ``<bos>``
    prepended, the Gemma 4 special tokens at their real ids and the Gemma 4 instruction chat
    template. Loadable by ``tokenizers.Tokenizer.from_file`` and transformers' ``AutoTokenizer``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab, merges = _tiny_vocab(vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B:1", special_tokens=[("<bos>", 2)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for _, t in sorted(GEMMA_SPECIAL_TOKENS.items())])
    for i, t in GEMMA_SPECIAL_TOKENS.items():
        assert tok.token_to_id(t) == i, (t, i, tok.token_to_id(t))
    tok.save(str(path / "tokenizer.json"))
    template = CHAT_TEMPLATE_PATH.read_text()
    (path / "chat_template.jinja").write_text(template)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "padding_side": "left",
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
    }, indent=2))


def load_hf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def copy_checkpoint(src, dst) -> Path:
    dst = Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst
