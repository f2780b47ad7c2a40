"""Grammars for OpenAI's ``tools`` / ``tool_choice`` and ``response_format``, in Gemma 4's syntax.

A Gemma 4 tool call is ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:2}<tool_call|>``: bare
keys in sorted order (the chat template renders arguments with ``dictsort``), strings between
``<|"|>`` special tokens (matched by token id, so a string may hold any text, quotes, braces
and newlines included), numbers / ``true`` / ``false`` / ``null`` / ``{...}`` / ``[...]`` bare;
parallel calls concatenated. `tool_grammar` constrains each call's arguments to its tool's
``parameters`` schema, in this subset of JSON Schema:

* ``type`` (one or a list), ``properties``, ``required``, ``additionalProperties`` (a schema for
  free keys when there are no ``properties``; with ``properties`` only they are allowed),
  ``items``, ``enum``, ``const``, ``anyOf``, ``$ref`` to ``#/$defs/...`` / ``#/definitions/...``;
* numbers, integers, booleans and null with any keyword llguidance's JSON compiler enforces
  (``minimum``, ``maximum``, ``multipleOf``, ...): their Gemma form is their JSON form;
* strings with ``minLength`` / ``maxLength``; ``format`` is an annotation (not enforced);
* annotations (``description``, ``title``, ``default``, ``examples``, ...) are ignored.

Anything else (``pattern``, ``oneOf``, ``allOf``, ``not``, ``minItems``, ``uniqueItems``, ...)
is refused with an `InputError` whose ``param`` attribute names where it is
(``tools[0].function.parameters.properties.x``), so the server answers a 400 naming it.

``tool_choice="auto"`` is lazy: free text (no special token) until ``<|tool_call>``, then
constrained calls; ``"required"`` and a named function allow calls only. ``thinking=True``
lets a ``<|channel>...<channel|>`` thought come first. `response_format_grammar` gives OpenAI's
``json_object`` / ``json_schema`` (``strict``) response formats, thought first where allowed.
"""
from __future__ import annotations

import json
from typing import Any

from ..errors import InputError
from ..runtime.constrain import JSON_OPTIONS, Grammar
from ..tokenizer import Tokenizer
from .history import check_tools

TOOL_CALL, TOOL_CALL_END, STRING_DELIM = "<|tool_call>", "<tool_call|>", '<|"|>'
CHANNEL, CHANNEL_END = "<|channel>", "<channel|>"

ANNOTATIONS = {"description", "title", "default", "examples", "format", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "$defs", "definitions", "strict"}
SCALAR_KEYS = {"type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
STRING_KEYS = {"type", "enum", "const", "minLength", "maxLength"}
OBJECT_KEYS = {"type", "properties", "required", "additionalProperties"}
ARRAY_KEYS = {"type", "items"}
TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")


def bad(param: str, message: str) -> InputError:
    """An `InputError` about ``param`` (its ``param`` attribute names it for the server's 400)."""
    e = InputError(f"{param}: {message}")
    e.param = param  # type: ignore[attr-defined]
    return e


class _Rules:
    """The Lark rules of one grammar, built from JSON schemas: one rule per schema node."""

    def __init__(self, tokenizer: Tokenizer, defs: dict[str, Any] | None = None, prefix: str = ""):
        self.lines: list[str] = []
        self.n = 0
        self.prefix = prefix  # rule names of one tool apart from another's
        self.defs = defs or {}
        self.def_rules: dict[str, str] = {}
        self.q = special(tokenizer, STRING_DELIM)

    def rule(self, body: str, name: str | None = None) -> str:
        if name is None:
            self.n += 1
            name = f"{self.prefix}r{self.n}"
        self.lines.append(f"{name}: {body}")
        return name

    def value(self, schema: Any, where: str) -> str:
        """A rule for one value of ``schema`` in Gemma's argument syntax."""
        if schema is True or schema == {}:
            return self.any_value()
        if not isinstance(schema, dict):
            raise bad(where, f"a schema must be an object, got {type(schema).__name__}")
        s = {k: v for k, v in schema.items() if k not in ANNOTATIONS}
        if "$ref" in s:
            if len(s) > 1:
                raise bad(where, "$ref with other keywords is not supported")
            return self.ref(s["$ref"], where)
        if "anyOf" in s:
            alts = s.pop("anyOf")
            if not isinstance(alts, list) or not alts:
                raise bad(where + ".anyOf", "must be a non-empty list of schemas")
            if s:
                raise bad(where, f"anyOf beside {sorted(s)} is not supported (put them inside each alternative)")
            return self.rule(" | ".join(self.value(a, f"{where}.anyOf[{i}]") for i, a in enumerate(alts)))
        if "const" in s:
            s["enum"] = [s.pop("const")]
        if "enum" in s:
            vals = s["enum"]
            if not isinstance(vals, list) or not vals:
                raise bad(where + ".enum", "must be a non-empty list")
            return self.rule(" | ".join(self.literal(v) for v in vals))
        t = s.get("type")
        if t is None:
            t = "object" if "properties" in s else "array" if "items" in s else None
            if t is None:
                self.check_keys(s, set(), where)
                return self.any_value()
        if isinstance(t, list):
            if not t or not all(x in TYPES for x in t):
                raise bad(where + ".type", f"must be one of {list(TYPES)} or a list of them, got {t!r}")
            return self.rule(" | ".join(self.value({**s, "type": x}, where) for x in dict.fromkeys(t)))
        if t not in TYPES:
            raise bad(where + ".type", f"must be one of {list(TYPES)}, got {t!r}")
        if t == "string":
            self.check_keys(s, STRING_KEYS, where)
            return self.string(s, where)
        if t == "object":
            self.check_keys(s, OBJECT_KEYS, where)
            return self.object(s, where)
        if t == "array":
            self.check_keys(s, ARRAY_KEYS, where)
            item = self.value(s.get("items", True), where + ".items")
            return self.rule(f'"[" ({item} ("," {item})*)? "]"')
        self.check_keys(s, SCALAR_KEYS, where)  # numbers, booleans, null: written as in JSON
        return self.rule("%json " + json.dumps({**s, "x-guidance": {**JSON_OPTIONS, "lenient": False}}))

    @staticmethod
    def check_keys(s: dict, allowed: set[str], where: str) -> None:
        extra = sorted(set(s) - allowed)
        if extra:
            raise bad(where, f"the keyword{'s' * (len(extra) > 1)} {', '.join(extra)} cannot be enforced in a tool "
                      "call's arguments (see gemmalite.chat.tool_grammar for the supported subset)")

    def ref(self, ref: Any, where: str) -> str:
        for prefix in ("#/$defs/", "#/definitions/"):
            if isinstance(ref, str) and ref.startswith(prefix) and ref[len(prefix):] in self.defs:
                key = ref[len(prefix):]
                if key not in self.def_rules:
                    self.n += 1
                    name = self.def_rules[key] = f"{self.prefix}d{self.n}"
                    self.rule(self.value(self.defs[key], f"{where}($ref {ref})"), name)
                return self.def_rules[key]
        raise bad(where + ".$ref", f"only references to this schema's $defs / definitions are supported, got {ref!r}")

    def string(self, s: dict, where: str) -> str:
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        for k, v in (("minLength", lo), ("maxLength", hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise bad(f"{where}.{k}", f"must be an integer >= 0, got {v!r}")
        if hi is not None and hi < lo:
            raise bad(where, f"maxLength {hi} is below minLength {lo}")
        if hi == 0:
            return self.rule(f"{self.q} {self.q}")
        if lo == 0 and hi is None:
            return self.rule(f"{self.q} STRING? {self.q}")
        body = self.rule("/(?s:.{%d,%s})/" % (max(lo, 1), "" if hi is None else hi))
        return self.rule(f"{self.q} {body}{'?' if lo == 0 else ''} {self.q}")

    def object(self, s: dict, where: str) -> str:
        props = s.get("properties")
        required = s.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise bad(where + ".required", "must be a list of property names")
        if props is None:
            if required:
                raise bad(where + ".required", "names properties the schema does not declare")
            extra = s.get("additionalProperties", True)
            value = self.any_value() if extra is True else self.value(extra, where + ".additionalProperties")
            if extra is False:
                return self.rule('"{" "}"')
            member = self.rule(f'KEY ":" {value}')
            return self.rule(f'"{{" ({member} ("," {member})*)? "}}"')
        if not isinstance(props, dict):
            raise bad(where + ".properties", "must be an object of schemas")
        missing = sorted(set(required) - set(props))
        if missing:
            raise bad(where + ".required", f"names properties the schema does not declare: {missing}")
        extra = s.get("additionalProperties", False)
        if extra not in (True, False) and not isinstance(extra, dict):
            raise bad(where + ".additionalProperties", "must be a boolean or a schema")
        keys = sorted(props)  # the template's dictsort order
        members = [self.rule(f"{json.dumps(k + ':')} {self.value(props[k], f'{where}.properties.{k}')}") for k in keys]
        need = [k in required for k in keys]
        # tails[i]: the members from i on, each after a comma (the optional ones may be absent)
        tails: list[str] = [""] * (len(keys) + 1)
        for i in range(len(keys) - 1, -1, -1):
            item = f'"," {members[i]}'
            tails[i] = f"({item})" if need[i] else f"({item})?"
            tails[i] = f"{tails[i]} {tails[i + 1]}".strip()
        # body[i]: the members from i on, the first present one without a comma
        body: list[str] = [""] * (len(keys) + 1)
        for i in range(len(keys) - 1, -1, -1):
            first = f"{members[i]} {tails[i + 1]}".strip()
            if need[i]:
                body[i] = self.rule(first)
            else:
                alts = [f"({first})"] + ([body[i + 1]] if body[i + 1] else [])
                body[i] = self.rule(" | ".join(alts))
        if not keys:
            return self.rule('"{" "}"')
        optional_all = not any(need)
        return self.rule(f'"{{" {body[0]}{"?" if optional_all else ""} "}}"')

    def literal(self, v: Any) -> str:
        """A constant in Gemma's syntax (the template's ``format_argument``, bare keys)."""
        if isinstance(v, str):
            return f"{self.q} {json.dumps(v)} {self.q}" if v else f"{self.q} {self.q}"
        if v is None or isinstance(v, (bool, int, float)):
            return json.dumps(v)
        if isinstance(v, list):
            return '"[" ' + ' "," '.join(self.literal(x) for x in v) + ' "]"' if v else '"[" "]"'
        if isinstance(v, dict):
            parts = [f"{json.dumps(str(k) + ':')} {self.literal(v[k])}" for k in sorted(v)]
            return '"{" ' + ' "," '.join(parts) + ' "}"' if parts else '"{" "}"'
        raise InputError(f"cannot write {type(v).__name__} {v!r} as a tool argument")

    def any_value(self) -> str:
        """Any value in Gemma's syntax (bare keys)."""
        v, o, a = (f"{self.prefix}any{k}" for k in ("value", "object", "array"))
        if "any" not in self.def_rules:
            self.def_rules["any"] = v
            self.rule(f'{self.q} STRING? {self.q} | NUMBER | "true" | "false" | "null" | {o} | {a}', v)
            self.rule(f'"{{" (KEY ":" {v} ("," KEY ":" {v})*)? "}}"', o)
            self.rule(f'"[" ({v} ("," {v})*)? "]"', a)
        return v


TERMINALS = ["STRING: /(?s:.+)/", "KEY: /[A-Za-z_][A-Za-z0-9_]*/",
             "NUMBER: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/", "TEXT: /(?s:.+)/"]


def special(tokenizer: Tokenizer, token: str) -> str:
    """``token`` as a Lark special-token reference by id (``<[52]>``); `InputError` when the
    vocabulary has no such token (not a Gemma 4 tokenizer)."""
    tid = tokenizer.token_id(token)
    if tid is None:
        raise InputError(f"this model's vocabulary has no {token} token: it has no Gemma 4 tool-call format")
    return f"<[{tid}]>"


def chosen_tools(tools: list[dict[str, Any]], tool_choice: Any) -> tuple[list[dict[str, Any]], bool] | None:
    """(the tools a reply may call, whether it must call one) for ``tool_choice``; None for
    ``"none"`` (no constraint). An unknown name or shape is an `InputError` naming ``tool_choice``."""
    if tool_choice is None:
        tool_choice = "auto"
    if tool_choice == "none":
        return None
    if tool_choice in ("auto", "required"):
        if not tools:
            raise bad("tool_choice", f"{tool_choice!r} needs tools")
        return tools, tool_choice == "required"
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")
    picked = [t for t in tools if t["function"]["name"] == name]
    if not picked:
        raise bad("tool_choice", f"names the function {name!r}, which is not among the tools")
    return picked, True


def tool_grammar(tokenizer: Tokenizer, tools: Any, tool_choice: Any = "auto", parallel_tool_calls: bool = True, *,
                 thinking: bool = False, response_format: Any = None) -> Grammar | None:
    """The grammar of a reply to a request with OpenAI ``tools`` (None for ``tool_choice="none"``
    without a ``response_format``): ``"auto"``: free text, then optionally tool calls;
    ``"required"`` / a named function: calls only (of that function); ``parallel_tool_calls``:
    one call or several. Each call's arguments follow its tool's ``parameters`` (see the
    module's supported subset). ``thinking``: a thought (``<|channel>...<channel|>``) may come
    first. ``response_format`` (json_object / json_schema): with ``"auto"`` the reply is either
    that JSON or calls; with ``"none"`` just the JSON (`response_format_grammar`); with
    ``"required"`` / a named function it is refused (``param`` response_format): the reply is a call."""
    tools = check_tools(tools)
    picked = chosen_tools(tools, tool_choice)
    body = _json_body(response_format)
    if picked is None:
        return response_format_grammar(tokenizer, response_format, thinking=thinking) if body else None
    chosen, required = picked
    if body and required:
        raise bad("response_format", "cannot be combined with tool_choice 'required' or a named function: "
                  "that reply is a tool call, never JSON content")
    if not isinstance(parallel_tool_calls, bool):
        raise bad("parallel_tool_calls", f"must be a boolean, got {parallel_tool_calls!r}")
    lines: list[str] = []
    alts: list[str] = []
    for t in chosen:
        k = tools.index(t)
        params = t["function"].get("parameters") or {"type": "object", "properties": {}}
        if params.get("type", "object") != "object":
            raise bad(f"tools[{k}].function.parameters.type", "must be 'object' (arguments are named)")
        rules = _Rules(tokenizer, {**params.get("definitions", {}), **params.get("$defs", {})}, prefix=f"t{k}_")
        args = rules.value({"type": "object", **params}, f"tools[{k}].function.parameters")  # writes the braces
        lines += rules.lines
        lines.append(f't{k}_call: {special(tokenizer, TOOL_CALL)} {json.dumps("call:" + t["function"]["name"])} '
                     f"{args} {special(tokenizer, TOOL_CALL_END)}")
        alts.append(f"t{k}_call")
    lines.append(f"call: {' | '.join(alts)}")
    calls = "call+" if parallel_tool_calls else "call"
    head = "thought? " if thinking else ""
    if required:
        start = f"{head}{calls}"
    elif body:
        schema, strict = body
        lines.append("body: %json " + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, "lenient": not strict}}))
        start = f"{head}(body | {calls})"
    else:
        start = f"{head}TEXT? ({calls})?"
    if thinking:
        lines.append(thought_rule(tokenizer))
    what = "response_format" if body else "tools"
    return Grammar.lark(tokenizer, "\n".join([f"start: {start}", *lines, *TERMINALS]) + "\n", what=what)


def _json_body(response_format: Any) -> tuple[dict, bool] | None:
    """(schema, strict) of a JSON ``response_format``, None for text or none (checked as
    `response_format_grammar` checks it)."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}, False
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad("response_format.json_schema", "must be {'name': ..., 'schema': {...}, 'strict': bool}")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad("response_format.json_schema.strict", f"must be a boolean, got {strict!r}")
        return spec.get("schema", {}), bool(strict)
    raise bad("response_format", "must be {'type': 'text' | 'json_object' | 'json_schema', ...}")


def thought_rule(tokenizer: Tokenizer) -> str:
    """The Lark rule ``thought``: ``<|channel>`` free text ``<channel|>`` (uses ``TEXT``)."""
    return f"thought: {special(tokenizer, CHANNEL)} TEXT? {special(tokenizer, CHANNEL_END)}"


def response_format_grammar(tokenizer: Tokenizer, response_format: Any, *, thinking: bool = False) -> Grammar | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (None), ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (strict: every keyword
    enforced, else an `InputError`; not strict: keywords the engine cannot enforce are ignored).
    ``thinking``: a thought may come before the JSON."""
    body = _json_body(response_format)
    if body is None:
        return None
    schema, strict = body
    where = "response_format.json_schema.schema" if response_format["type"] == "json_schema" else "response_format"
    try:
        if not thinking:
            return Grammar.json_schema(tokenizer, schema, strict=strict, what=where)
        js = json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, "lenient": not strict}})
        lark = f"start: thought? body\nbody: %json {js}\n{thought_rule(tokenizer)}\nTEXT: /(?s:.+)/\n"
        return Grammar.lark(tokenizer, lark, what=where)
    except InputError as e:
        raise bad(where, str(e).removeprefix(where + ": ")) from None
