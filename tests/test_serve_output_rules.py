"""serve/output_rules.py: which grammar a request body asks for, and a 400 naming the field for
each wrong one (no server, no compile: the compile errors are test_serve_structured.py's)."""
import json

import pytest

from engramflow.serve.errors import ApiError
from engramflow.serve.output_rules import output_grammar
from structured_cases import CLOCK, TOOLS, WEATHER

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("body, chat, kind, field", [
    ({}, True, None, None),
    ({"response_format": {"type": "text"}}, True, None, None),
    ({"response_format": {"type": "json_object"}}, False, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}, True,
     "json_schema", "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, False, "json_schema", "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, False, "regex", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, True, "choice", "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, True, "grammar", "structured_outputs.grammar"),
    ({"tools": TOOLS, "tool_choice": "auto"}, True, None, None),
    ({"tools": TOOLS, "tool_choice": "none"}, True, "structural_tag", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required"}, True, "structural_tag", "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, True,
     "structural_tag", "tools"),  # a forced call wins
    ({"tools": TOOLS, "tool_choice": "required"}, False, None, None),  # completions have no tools
])
def test_the_grammar_a_body_asks_for(body, chat, kind, field):
    spec, where = output_grammar(body, chat)
    assert (spec.kind if spec else None, where) == (kind, field)


def test_named_and_single_calls_differ_from_parallel_ones():
    named = output_grammar({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                           True)[0]
    single = output_grammar({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, True)[0]
    parallel = output_grammar({"tools": TOOLS, "tool_choice": "required"}, True)[0]
    assert WEATHER["function"]["name"] not in named.source and CLOCK["function"]["name"] in named.source
    assert '"stop_after_first": true' in single.source and '"stop_after_first": false' in parallel.source


@pytest.mark.parametrize("body, param", [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"if": {}}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"tool_choice": "required", "tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": 'a"b'}}]}, "tools[0]"),
    ({"tool_choice": "required", "tools": "all"}, "tools"),
])
def test_bad_fields_are_400s_naming_them(body, param):
    with pytest.raises(ApiError) as e:
        output_grammar(body, True)
    assert e.value.status == 400 and e.value.param == param and e.value.message
