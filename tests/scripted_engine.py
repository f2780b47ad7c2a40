"""An engine whose logits follow a script, for driving chat replies random weights would never
write (tool calls, thoughts): after a registered prompt, each step's logits put all the weight on
the script's next token (then ``<turn|>``). It keeps the `Engine` interface the generation loop
and the server's scheduler use (prefill, prefill_many, logits, decode_step / rows / batch) over a
state that only counts tokens, so everything above the engine runs as it does on real weights."""
from __future__ import annotations

import numpy as np

from gemmalite.errors import ContextError
from gemmalite.runtime.cache import KVState

HIGH = 100.0  # the scripted token's logit; every other is 0 (e^-50 at temperature 2: never drawn)


class ScriptedState(KVState):
    """A state with no K/V: it only counts tokens (truncates anywhere, keeps no checkpoints)."""

    def __init__(self, context: int):
        super().__init__({}, context)


class ScriptedEngine:
    def __init__(self, vocab_size: int, context: int, end_id: int = 106):
        self.vocab_size = vocab_size
        self.context = context
        self.end_id = end_id
        self.scripts: dict[tuple[int, ...], list[int]] = {}
        self.threads = None

    def script(self, prompt: list[int], reply: list[int]) -> None:
        """After exactly ``prompt``, the model 'writes' ``reply`` (then ``<turn|>``)."""
        self.scripts[tuple(prompt)] = list(reply)

    def new_state(self) -> ScriptedState:
        return ScriptedState(self.context)

    def next_token(self, tokens: list[int]) -> int:
        best = max((p for p in self.scripts if tuple(tokens[: len(p)]) == p), key=len, default=None)
        if best is None:
            return self.end_id
        reply, k = self.scripts[best], len(tokens) - len(best)
        return reply[k] if k < len(reply) else self.end_id

    def _row(self, token: int) -> np.ndarray:
        row = np.zeros(self.vocab_size, np.float32)
        row[token] = HIGH
        return row

    def _run(self, state: ScriptedState, ids) -> None:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        if state.length + len(ids) > state.context:
            raise ContextError(f"sequence of {state.length + len(ids)} tokens exceeds the context of {state.context}")
        state.tokens += ids
        state.length += len(ids)

    # -- the Engine interface ----------------------------------------------------------------
    def prefill(self, state, ids, soft=None) -> np.ndarray:
        self._run(state, ids)
        return np.array([[self.next_token(state.tokens)]], np.float32)  # a 'hidden state' naming the next token

    def prefill_many(self, states, prompts) -> np.ndarray:
        return np.concatenate([self.prefill(s, p) for s, p in zip(states, prompts)])

    def logits(self, h: np.ndarray, each: bool = False) -> np.ndarray:
        return np.stack([self._row(int(r[0])) for r in h])

    def decode_step(self, state, token: int) -> np.ndarray:
        self._run(state, [token])
        return self._row(self.next_token(state.tokens))

    def decode_rows(self, state, tokens) -> np.ndarray:
        return self.decode_batch([state], [tokens])

    def decode_batch(self, states, tokens) -> np.ndarray:
        rows = []
        for state, run in zip(states, tokens):
            for t in np.asarray(run).reshape(-1):
                self._run(state, [t])
                rows.append(self._row(self.next_token(state.tokens)))
        return np.stack(rows)


def scripted_model(model):
    """A `Model` with ``model``'s configuration, tokenizer and defaults on a `ScriptedEngine`."""
    from gemmalite.model import Model

    engine = ScriptedEngine(model.config.vocab_size, model.context)
    return Model(model.config, engine, model.tokenizer, model.defaults, source="scripted")
