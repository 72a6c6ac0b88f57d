"""Schemas and tools the structured-output tests ask for: bounded, so that a random-weight
model's sampled output ends within a few dozen tokens (a free string or an unbounded array
could run past any max_tokens). A forced tool call is longer: the DSML markup around each
parameter is ~60 characters, which a random model writes in tokens of 1-3 characters."""

NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "name": {"type": "string", "maxLength": 5}}, "required": ["id", "name"]},
    "active": {"type": "boolean"}},
    "required": ["user", "active"]}
ENUMS = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "size": {"type": "string", "enum": ["S", "M", "L"]},
    "mood": {"const": "calm"}},
    "required": ["color", "size", "mood"]}
ARRAYS = {"type": "object", "properties": {
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
    "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
    "required": ["scores", "flags"]}
NUMBERS = {"type": "object", "properties": {
    "ratio": {"type": "number", "minimum": 0, "maximum": 1},
    "temp": {"type": "number", "exclusiveMinimum": -50, "maximum": 60},
    "count": {"type": "integer", "minimum": 10, "maximum": 20}},
    "required": ["ratio", "temp", "count"]}
SCHEMAS = {"nested": NESTED, "enums": ENUMS, "arrays": ARRAYS, "numbers": NUMBERS}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 6},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                                "unit": {"enum": ["C", "F"]}},
                                                "required": ["city", "days", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet", "pst"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, CLOCK]
