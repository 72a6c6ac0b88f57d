"""JSON-schema keywords xgrammar does not enforce, refused before compiling.

xgrammar compiles a schema with `not`, `if`/`then`/`else` or a several-part `allOf` without a
word, and the output then need not satisfy them; a client asking for them would get JSON that
fails its own validator. So they are a 400 naming the keyword and where it is, instead.
"""
from __future__ import annotations

from engramflow.structured.errors import GrammarError

UNENFORCED = {"not", "if", "then", "else", "dependentSchemas", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
              "$recursiveAnchor"}
SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}  # name -> schema
SCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
SCHEMA_VALUES = {"items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties",
                 "unevaluatedItems", "additionalItems"}


def check_schema(schema, where: str = "schema") -> None:
    """Raise GrammarError at the first unenforced keyword (or a schema that is not one)."""
    stack = [(schema, where)]
    while stack:
        node, at = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise GrammarError(f"{at} must be a JSON schema (an object or a boolean), got {type(node).__name__}")
        for key, value in node.items():
            if key in UNENFORCED:
                raise GrammarError(f"{at} uses {key!r}, which structured outputs cannot enforce")
            if key == "allOf" and isinstance(value, list) and len(value) > 1:
                raise GrammarError(f"{at} has an allOf of {len(value)} schemas; only one is enforced")
            if key in SCHEMA_MAPS and isinstance(value, dict):
                stack.extend((v, f"{at}.{key}.{k}") for k, v in value.items())
            elif key in SCHEMA_LISTS and isinstance(value, list):
                stack.extend((v, f"{at}.{key}[{i}]") for i, v in enumerate(value))
            elif key in SCHEMA_VALUES and isinstance(value, (dict, bool)):
                stack.append((value, f"{at}.{key}"))
            elif key == "items" and isinstance(value, list):
                stack.extend((v, f"{at}.items[{i}]") for i, v in enumerate(value))
