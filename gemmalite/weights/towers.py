"""Where a checkpoint keeps an encoder tower (vision, audio) and the check that it holds every
tensor the tower reads: one mechanism for both towers, so both refuse a bad checkpoint alike."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

from ..errors import CheckpointError, ConfigError

C = TypeVar("C")


@dataclass(frozen=True)
class TowerLayout:
    """A tower's stored names: (tower, embedder) prefix pairs in the order tried, the tensor whose
    presence under a tower prefix says the tower is there, and its config.json section."""

    kind: str  # "vision", "audio": error messages
    prefixes: tuple[tuple[str, str], ...]
    probe: str
    config_key: str  # "vision_config", "audio_config"

    def find(self, tensors: Mapping[str, Any]) -> tuple[str, str] | None:
        """(tower, embedder) prefixes of a checkpoint's tensors, or None when it has no such tower."""
        for tower, embed in self.prefixes:
            if tower + self.probe in tensors:
                return tower, embed
        return None

    def open(self, tensors: Mapping[str, Any], config: dict, from_hf: Callable[[dict], C],
             expected_shapes: Callable[[C, int, str, str], dict[str, tuple[int, ...]]]) -> tuple[C, str, str]:
        """The tower's config and prefixes, once every tensor it reads is present with its shape;
        otherwise a CheckpointError naming the first problem (and how many more)."""
        prefixes = self.find(tensors)
        if prefixes is None:
            raise CheckpointError(f"no {self.kind} tower: no {self.probe} under "
                                  + " or ".join(repr(t) for t, _ in self.prefixes))
        if not isinstance(config.get(self.config_key), dict):
            raise CheckpointError(f"config.json has no {self.config_key}")
        try:
            cfg = from_hf(config[self.config_key])
        except ConfigError as e:
            raise CheckpointError(f"config.json: {e}") from None
        tower, embed = prefixes
        proj_name = embed + "embedding_projection.weight"
        if proj_name not in tensors:
            raise CheckpointError(f"missing tensor {proj_name}")
        text_hidden = (config.get("text_config") or {}).get("hidden_size", tensors[proj_name].shape[0])
        problems = []
        for name, shape in expected_shapes(cfg, text_hidden, tower, embed).items():
            if name not in tensors:
                problems.append(f"missing tensor {name} (expected shape {shape})")
            elif tuple(tensors[name].shape) != shape:
                problems.append(f"tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CheckpointError(f"{self.kind} tower: {problems[0]}{more}")
        return cfg, tower, embed
