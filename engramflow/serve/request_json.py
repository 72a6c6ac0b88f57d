"""A request body -> a checked JSON object, or a 400 naming what is wrong (never a 500).

The rules of the checkpoint's parser of outside JSON (io/safetensors.parse_json): UTF-8, valid
JSON, no key twice, bounded nesting. And, since a client is less trusted than a checkpoint:
no NaN/Infinity literals, no number literal longer than `MAX_NUMBER_CHARS` (Python refuses to
convert integers past 4,300 digits, and nothing the API takes needs more than 20), no string
holding a lone surrogate (JSON's `"\\ud800"` escapes allow one; it is no text and cannot be
tokenized). Errors name the field as `messages[0].content`.
"""
from __future__ import annotations

import json

from engramflow.serve.errors import ApiError, bad

MAX_DEPTH = 64  # the API's deepest field (a tool's JSON schema) needs far fewer
MAX_NUMBER_CHARS = 40


class _Refused(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Odd:
    """A value the parser met but the API refuses; the tree walk reports it with its field."""

    def __init__(self, why: str):
        self.why = why


def _pairs(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        for k, _ in pairs:
            if k in seen:
                raise _Refused(f"the body gives key {k!r} twice in one object", k if isinstance(k, str) else None)
            seen.add(k)
    return out


def _int(text: str):
    if len(text) > MAX_NUMBER_CHARS:
        return _Odd(f"a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    return int(text)


def _float(text: str):
    if len(text) > MAX_NUMBER_CHARS:
        return _Odd(f"a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    return float(text)


def _constant(name: str):
    return _Odd(f"{name}, which is not JSON")


def _field(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def _check_string(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"{where or 'the body'} holds a lone surrogate (\\u{ord(s[e.start]):04x} at character {e.start}): "
                  f"not text", where or None, "invalid_string") from None


def _walk(root) -> None:
    """Every value once, without recursion: depth, refused values and strings, with their field."""
    stack = [(root, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, dict):
            if depth >= MAX_DEPTH:
                raise bad(f"{path or 'the body'} is nested more than {MAX_DEPTH} levels deep", path or None)
            for k, v in value.items():
                _check_string(k, path)
                stack.append((v, _field(path, k), depth + 1))
        elif isinstance(value, list):
            if depth >= MAX_DEPTH:
                raise bad(f"{path or 'the body'} is nested more than {MAX_DEPTH} levels deep", path or None)
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_string(value, path)
        elif isinstance(value, _Odd):
            raise bad(f"{path} holds {value.why}", path)


def parse_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text, object_pairs_hook=_pairs, parse_int=_int, parse_float=_float,
                          parse_constant=_constant)
    except json.JSONDecodeError as e:
        raise bad(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad(f"the body is nested more than {MAX_DEPTH} levels deep") from None
    except _Refused as e:
        raise bad(str(e), e.param) from None
    except ValueError as e:  # anything else the number parsers refuse
        raise bad(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    _walk(body)
    return body


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
