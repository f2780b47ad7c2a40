"""`synth --preset e2b-assistant / e4b-assistant` writes the drafter transformers builds from
that config: every tensor name and shape (meta device, nothing allocated), ~78 M parameters,
``token_ordering`` a permutation; gemmalite reads the folder back."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import assistant_oracle as A  # noqa: E402
from gemmalite.formats.folder import read_config, read_tensors  # noqa: E402
from gemmalite.models.gemma.assistant import Assistant, AssistantConfig  # noqa: E402
from gemmalite.tools.synth import assistant_config, synth_assistant  # noqa: E402


@pytest.mark.parametrize("preset", ["e2b-assistant", "e4b-assistant"])
def test_shapes_are_transformers(preset):
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    raw = assistant_config(preset)
    with A.all_shared(), torch.device("meta"):
        model = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(**{k: v for k, v in raw.items()
                                                                    if k not in ("model_type", "architectures")}))
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert AssistantConfig.from_hf(raw).expected_shapes() == want
    assert round(sum(int(np.prod(s)) for s in want.values()) / 1e6) in (78, 79)


def test_written_folder_loads(tmp_path):
    out = synth_assistant("e2b-assistant", tmp_path / "d", progress=False)
    raw = read_config(out)
    tensors = read_tensors(out, raw)
    order = np.asarray(tensors["masked_embedding.token_ordering"])
    assert order.dtype == np.int64 and np.array_equal(np.sort(order), np.arange(262144))
    a = Assistant(AssistantConfig.from_hf(raw), tensors)
    assert a.ordering.shape == (2048, 128) and a.pre.shape == (256, 3072)
