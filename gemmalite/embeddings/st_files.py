"""The sentence-transformers files of an embedding checkpoint: what the reference pipeline reads.

``modules.json`` (Transformer -> mean Pooling -> Normalize is the pipeline gemmalite computes),
``config_sentence_transformers.json`` (task prompts, the default prompt, ``truncate_dim``),
``1_Pooling/config.json`` and ``sentence_bert_config.json`` (``max_seq_length``). A folder
without them gets the model card's pipeline: mean pooling, L2 normalisation, no prompts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

#: the task prompts `gemmalite synth --preset eg2` writes: EmbeddingGemma's task-prefix style under
#: the prompt names EmbeddingGemma 2 tools use
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
MODULE_KINDS = ("Transformer", "Pooling", "Normalize")


@dataclass
class PipelineConfig:
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    truncate_dim: int | None = None
    max_seq_length: int | None = None


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def read_pipeline(folder: Path) -> PipelineConfig:
    """The sentence-transformers settings of ``folder``; CheckpointError for a pipeline gemmalite does not compute."""
    conf = PipelineConfig()
    modules_path = folder / "modules.json"
    if modules_path.exists():
        modules = _json(modules_path)
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules] if isinstance(modules, list) else None
        if kinds != list(MODULE_KINDS):
            raise CheckpointError(f"{modules_path}: gemmalite computes the Transformer -> Pooling -> Normalize "
                                  f"pipeline, this one is {kinds}")
        pool_dir = folder / modules[1].get("path", "1_Pooling") / "config.json"
        if pool_dir.exists():
            pool = _json(pool_dir)
            mode = pool.get("pooling_mode") or ("mean" if pool.get("pooling_mode_mean_tokens") else None)
            if mode != "mean":
                raise CheckpointError(f"{pool_dir}: pooling mode {mode!r} is not supported (only mean)")
            if pool.get("include_prompt") is False:
                raise CheckpointError(f"{pool_dir}: include_prompt=false is not supported")
    st_path = folder / "config_sentence_transformers.json"
    if st_path.exists():
        st = _json(st_path)
        prompts = st.get("prompts") or {}
        if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
            raise CheckpointError(f"{st_path}: prompts must map names to strings")
        conf.prompts = dict(prompts)
        conf.default_prompt_name = st.get("default_prompt_name")
        if conf.default_prompt_name is not None and conf.default_prompt_name not in conf.prompts:
            raise CheckpointError(f"{st_path}: default_prompt_name {conf.default_prompt_name!r} is not in prompts")
        if st.get("truncate_dim") is not None:
            conf.truncate_dim = int(st["truncate_dim"])
    bert_path = folder / "sentence_bert_config.json"
    if bert_path.exists() and _json(bert_path).get("max_seq_length") is not None:
        conf.max_seq_length = int(_json(bert_path)["max_seq_length"])
    return conf


def write_pipeline(folder: Path, dim: int, prompts: dict[str, str] | None = None) -> None:
    """Write the files sentence-transformers saves for Transformer -> mean Pooling -> Normalize."""
    folder = Path(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.base.modules.normalize.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"embedding_dimension": dim, "pooling_mode": "mean", "include_prompt": True}, indent=4))
    (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "2_Normalize" / "config.json").write_text("{}")
    (folder / "sentence_bert_config.json").write_text(json.dumps({
        "transformer_task": "feature-extraction",
        "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
        "module_output_name": "token_embeddings"}, indent=4))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({
        "model_type": "SentenceTransformer", "prompts": dict(prompts or {}), "default_prompt_name": None,
        "similarity_fn_name": "cosine"}, indent=2))
