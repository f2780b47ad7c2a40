"""transformers oracle for Gemma 4's MTP drafter (``gemma4_assistant``; imported by tests).

transformers 5.23 cannot build an all-layers-shared Gemma 4 text stack (its
``kv_sharing_modes`` wants a producer of every type inside the stack), although that is
what `Gemma4AssistantConfig` asks for: `all_shared` patches that one property while a model
is built and run so that every layer is a consumer ("reuse"), as the assistant's design
intends. Every weight is randomised (norm scales and ``layer_scalar`` as in hf_oracle, the
projections and centroids, ``token_ordering`` a random permutation).
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

import hf_oracle as H

#: the drafter's text stack: 3 sliding + 1 full layer with the target's (TINY) head geometry
ASSISTANT_TEXT = dict(
    model_type="gemma4_text", vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=8,
    hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=4,
    max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters=H.TINY_TEXT_CONFIG["rope_parameters"],
)
#: the target: TINY (6 layers, S S F S S F) with its last two layers sharing K/V (producers 3 and 2)
TARGET = dict(layout="causal", num_kv_shared_layers=2, sliding_window=8)


@contextlib.contextmanager
def all_shared():
    from transformers import Gemma4TextConfig

    prop = Gemma4TextConfig.kv_sharing_modes

    def modes(self):
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return prop.fget(self)

    Gemma4TextConfig.kv_sharing_modes = property(modes)
    try:
        yield
    finally:
        Gemma4TextConfig.kv_sharing_modes = prop


@torch.no_grad()
def make_assistant(path: Path | None, *, ordered: bool = True, seed: int = 0, backbone: int = 64,
                   num_centroids: int = 16, top_k: int = 4, **text_overrides):
    """A random `Gemma4AssistantForCausalLM` (float32, eager), saved to ``path`` when given."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    with all_shared():
        cfg = Gemma4AssistantConfig(text_config={**ASSISTANT_TEXT, **text_overrides}, backbone_hidden_size=backbone,
                                    use_ordered_embeddings=ordered, num_centroids=num_centroids,
                                    centroid_intermediate_top_k=top_k, attn_implementation="eager")
        torch.manual_seed(seed)
        model = Gemma4AssistantForCausalLM(cfg).float().eval()
        H.randomize_text_weights(model, seed)
        g = torch.Generator().manual_seed(seed + 7)
        for lin in (model.pre_projection, model.post_projection):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / math.sqrt(lin.weight.shape[1]))
        if ordered:
            c = model.masked_embedding.centroids.weight
            c.copy_(torch.randn(c.shape, generator=g) / math.sqrt(c.shape[1]))
            V = cfg.text_config.vocab_size
            model.masked_embedding.token_ordering.copy_(torch.randperm(V, generator=g))
        if path is not None:
            model.save_pretrained(path, safe_serialization=True)
    return model


@torch.no_grad()
def target_state(target, ids: list[int]):
    """A full prefill of ``ids``: (shared K/V by layer type, final-normed hidden of the last position [1, 1, H])."""
    x = torch.tensor([list(ids)], dtype=torch.long)
    out = target(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False, output_hidden_states=True,
                 return_shared_kv_states=True)
    return dict(out.shared_kv_states), out.hidden_states[-1][:, -1:]


@torch.no_grad()
def draft_steps(target, assistant, ids: list[int], token: int, steps: int, hidden=None):
    """transformers' drafting loop (`SinglePositionMultiTokenCandidateGenerator`) over the clean
    state of a prefill of ``ids``: ``steps`` chained steps at position ``len(ids)``, each fed the
    previous argmax. Returns [(logits [V], next hidden [Hb])] as float numpy arrays."""
    shared, h = target_state(target, ids)
    if hidden is not None:
        h = torch.as_tensor(hidden, dtype=h.dtype).reshape(1, 1, -1)
    emb = target.get_input_embeddings()
    pos = torch.tensor([[len(ids)]])
    mask = torch.ones(1, len(ids) + 1, dtype=torch.long)
    out = []
    with all_shared():
        for _ in range(steps):
            inp = torch.cat([emb(torch.tensor([[token]])), h], dim=-1)
            o = assistant(inputs_embeds=inp, attention_mask=mask, position_ids=pos, shared_kv_states=shared,
                          use_cache=False)
            logits, h = o.logits[0, -1], o.last_hidden_state
            out.append((logits.double().numpy(), h[0, -1].double().numpy()))
            token = int(logits.argmax())
    return out
