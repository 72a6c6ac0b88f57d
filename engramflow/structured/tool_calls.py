"""The DSML tool-call block a forced `tool_choice` must write, as an xgrammar structural tag.

The block is exactly what chat/encoder.py writes for an assistant's calls (and what
chat/parser.py reads back):

    \\n\\n<｜DSML｜ calls>\\n
    <｜DSML｜ invoke name="NAME">\\n
    <｜DSML｜ parameter name="KEY" string="true">raw text</｜DSML｜ parameter>\\n
    <｜DSML｜ parameter name="KEY2" string="false">JSON</｜DSML｜ parameter>\\n
    </｜DSML｜ invoke>\\n
    </｜DSML｜ calls>

Parameters come in the schema's order, required ones always and the others optionally. A
parameter whose schema is a string (or an enum of strings) is written raw (string="true"):
its enum, pattern or length are enforced on the raw text, and it may not hold the closing
tag (a length-bounded one holds no `<` at all). Any other parameter is JSON under its own schema (string="false"); the tool's `$defs`
go along so a `$ref` in it still resolves. `tool_choice: "none"` is text that never writes
`｜DSML｜`, so no block can start.
"""
from __future__ import annotations

import json

from engramflow.chat import tokens as T
from engramflow.structured.errors import GrammarError
from engramflow.structured.grammars import GrammarSpec
from engramflow.structured.schema_check import check_schema

DEFS = ("$defs", "definitions")


def forced_calls(functions: list[dict], only: str | None = None, parallel: bool = True) -> GrammarSpec:
    """At least one call of the functions (OpenAI tools' `function` objects; `only`: exactly
    one call of that one; `parallel` False: exactly one call)."""
    invokes = [_invoke(f, f"tools[{k}].function.parameters") for k, f in enumerate(functions)
               if only is None or f["name"] == only]
    calls = {"type": "tags_with_separator", "tags": invokes, "separator": "\n", "at_least_one": True,
             "stop_after_first": only is not None or not parallel}
    block = {"type": "sequence", "elements": [_text(f"{T.CALLS_START}\n"), calls, _text(f"\n{T.CALLS_CLOSE}")]}
    return _spec(block)


def no_calls() -> GrammarSpec:
    """Free text that never writes the DSML marker (`tool_choice: "none"`)."""
    return _spec({"type": "any_text", "excludes": [T.DSML]})


def _invoke(function: dict, where: str) -> dict:
    params = function.get("parameters") or {"type": "object", "properties": {}}
    check_schema(params, where)
    props = params.get("properties") or {}
    if not isinstance(props, dict):
        raise GrammarError(f"{where}.properties must be an object")
    required = set(params.get("required") or [])
    defs = {k: params[k] for k in DEFS if k in params}
    parts = []
    for name, schema in props.items():
        param = _parameter(name, schema, defs)
        parts.append(param if name in required else {"type": "optional", "content": param})
    body = [_text(f'{T.INVOKE_OPEN} name="{function["name"]}">\n')]
    for k, part in enumerate(parts):  # a newline between parameters, as the encoder joins them
        body.append(part if k == 0 else {"type": "sequence", "elements": [_text("\n"), part]}
                    if part["type"] != "optional" else {"type": "optional", "content": {
                        "type": "sequence", "elements": [_text("\n"), part["content"]]}})
    body.append(_text(f"\n{T.INVOKE_CLOSE}"))
    return {"type": "tag", "begin": "", "content": {"type": "sequence", "elements": body}, "end": ""}


def _parameter(name: str, schema, defs: dict) -> dict:
    close = T.PARAM_CLOSE
    if _is_string(schema):
        begin = f'{T.PARAM_OPEN} name="{name}" string="true">'
        return {"type": "tag", "begin": begin, "content": _raw_string(schema), "end": close}
    begin = f'{T.PARAM_OPEN} name="{name}" string="false">'
    sub = dict(schema, **{k: v for k, v in defs.items() if k not in schema}) if isinstance(schema, dict) else schema
    return {"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": sub,
                                                       "max_whitespace_cnt": 1}, "end": close}


def _is_string(schema) -> bool:
    if not isinstance(schema, dict):
        return False
    if "enum" in schema:
        return bool(schema["enum"]) and all(isinstance(v, str) for v in schema["enum"])
    return schema.get("type") == "string" and "const" not in schema


def _raw_string(schema: dict) -> dict:
    if "enum" in schema:
        return {"type": "or", "elements": [_text(v) for v in schema["enum"]]}
    if "pattern" in schema:
        return {"type": "regex", "pattern": schema["pattern"]}
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if isinstance(high, int) or low:  # counted in characters: a bounded raw string holds no "<"
        return {"type": "regex", "pattern": f"[^<]{{{low},{high if isinstance(high, int) else ''}}}"}
    return {"type": "any_text", "excludes": [T.PARAM_CLOSE]}


def _text(value: str) -> dict:
    return {"type": "const_string", "value": value}


def _spec(fmt: dict) -> GrammarSpec:
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False,
                                                    sort_keys=True))
