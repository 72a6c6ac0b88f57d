"""What a request's output must match, from its body: OpenAI's `response_format` and
`tool_choice`, and vLLM's `structured_outputs` -> one GrammarSpec, or None (free).

  response_format  {"type": "text"} | {"type": "json_object"}
                   | {"type": "json_schema", "json_schema": {"name", "schema", "strict"?}}
  structured_outputs (vLLM)  exactly one of "json" (a schema, or its JSON text), "regex",
                   "choice" (a list of strings), "grammar" (EBNF), "json_object": true
  tool_choice      "auto" (free) | "none" (no tool-call block) | "required" (at least one call;
                   one with parallel_tool_calls: false) | {"type": "function", "function":
                   {"name"}} (exactly one call of that tool)

A forced tool call wins over a response format (the answer then is the call, no content).
Every field is checked here and a wrong one is a 400 naming it; the grammar itself is compiled
(and its errors named) by the backend before the request is queued.
"""
from __future__ import annotations

import json

from engramflow.chat.messages import ChatError, function_schemas
from engramflow.serve.errors import bad
from engramflow.structured.errors import GrammarError
from engramflow.structured.grammars import GrammarSpec
from engramflow.structured.tool_calls import forced_calls, no_calls

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CHOICES = 256


def output_grammar(body: dict, chat: bool) -> tuple[GrammarSpec | None, str | None]:
    """(the grammar of the request's output, the field that holds it) -- (None, None) when free."""
    if chat:
        forced = _tool_grammar(body)
        if forced is not None:
            return forced, "tools"
    for field, read in (("response_format", _response_format), ("structured_outputs", _structured_outputs)):
        if body.get(field) is not None:
            spec, where = read(body[field])
            if spec is not None:
                return spec, where
    if chat and body.get("tool_choice") == "none":
        return no_calls(), "tool_choice"
    return None, None


def _response_format(rf) -> tuple[GrammarSpec | None, str]:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("response_format must be {'type': 'text' | 'json_object' | 'json_schema'}", "response_format")
    if rf["type"] == "text":
        return None, "response_format"
    if rf["type"] == "json_object":
        return GrammarSpec("json_object"), "response_format"
    js = rf.get("json_schema")
    if not isinstance(js, dict) or "schema" not in js:
        raise bad("response_format.json_schema must be an object with 'name' and 'schema'",
                  "response_format.json_schema")
    if js.get("name") is not None and not isinstance(js["name"], str):
        raise bad("response_format.json_schema.name must be a string", "response_format.json_schema.name")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise bad("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
    where = "response_format.json_schema.schema"
    return _schema(js["schema"], where), where


def _structured_outputs(so) -> tuple[GrammarSpec | None, str]:
    if not isinstance(so, dict):
        raise bad("structured_outputs must be an object", "structured_outputs")
    given = [k for k in so if so[k] is not None and so[k] is not False]
    unknown = [k for k in given if k not in STRUCTURED_KINDS]
    if unknown:
        raise bad(f"structured_outputs.{unknown[0]} is not served; use one of {', '.join(STRUCTURED_KINDS)}",
                  f"structured_outputs.{unknown[0]}")
    if len(given) != 1:
        raise bad(f"structured_outputs must give exactly one of {', '.join(STRUCTURED_KINDS)}", "structured_outputs")
    kind, value = given[0], so[given[0]]
    where = f"structured_outputs.{kind}"
    return _structured_spec(kind, value, where), where


def _structured_spec(kind: str, value, where: str) -> GrammarSpec:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise bad(f"{where} is not valid JSON: {e}", where) from None
        return _schema(value, where)
    if kind == "json_object":
        if value is not True:
            raise bad(f"{where} must be true", where)
        return GrammarSpec("json_object")
    if kind == "choice":
        if not isinstance(value, list) or not value or len(value) > MAX_CHOICES \
                or not all(isinstance(v, str) and v for v in value):
            raise bad(f"{where} must be a list of 1 to {MAX_CHOICES} non-empty strings", where)
        try:
            return GrammarSpec.choice(value)
        except GrammarError as e:
            raise bad(str(e), where) from None
    if not isinstance(value, str) or not value:
        raise bad(f"{where} must be a non-empty string", where)
    return GrammarSpec("regex" if kind == "regex" else "grammar", value)


def _schema(schema, where: str) -> GrammarSpec:
    try:
        return GrammarSpec.json_schema(schema)
    except GrammarError as e:
        raise bad(str(e).replace("schema", where, 1) if str(e).startswith("schema") else str(e), where) from None


def _tool_grammar(body: dict) -> GrammarSpec | None:
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad(f"parallel_tool_calls must be a boolean, got {parallel!r}", "parallel_tool_calls")
    if choice is None or choice in ("auto", "none"):
        return None
    try:
        functions = function_schemas(body.get("tools"))
    except ChatError as e:
        raise bad(str(e), e.param) from None
    if choice == "required":
        if not functions:
            raise bad("tool_choice 'required' needs tools", "tool_choice")
        return _forced(functions, None, parallel is not False)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise bad("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
                  "tool_choice")
    if name not in [f["name"] for f in functions]:
        known = ", ".join(repr(f["name"]) for f in functions) or "none"
        raise bad(f"tool_choice names the tool {name!r}, which is not in tools (given: {known})", "tool_choice")
    return _forced(functions, name, False)


def _forced(functions: list[dict], only: str | None, parallel: bool) -> GrammarSpec:
    for k, f in enumerate(functions):
        if '"' in f["name"] or "<" in f["name"] or "\n" in f["name"]:
            raise bad(f"tools[{k}].function.name {f['name']!r} cannot be written in a tool call", f"tools[{k}]")
    try:
        return forced_calls(functions, only, parallel)
    except GrammarError as e:
        raise bad(str(e), str(e).split(" ", 1)[0]) from None
