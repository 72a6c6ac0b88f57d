"""A request's grammar, compiled once against the checkpoint's tokenizer and cached.

A `GrammarSpec` names what the output must match: a JSON schema, any JSON object, a regex, one
of a few strings, an EBNF grammar, or a structural tag (the DSML tool-call block, tool_calls.py).
Its `key` (kind and canonical text) is the cache key, so every request with the same schema
shares one compiled grammar; compiling happens where the request is prepared, so a grammar that
does not compile is the client's 400, never a failed step.

JSON is compact: no whitespace between tokens beyond what the schema's strings hold. A model
that may write whitespace anywhere can write it forever (a random-weight one does), and a
client reading JSON needs none of it.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import threading

from engramflow.structured.errors import GrammarError
from engramflow.structured.schema_check import check_schema
from engramflow.structured.vocabulary import tokenizer_info

MAX_GRAMMAR_CHARS = 64 * 1024  # a schema, regex or grammar longer than this is refused
CACHE_SIZE = 256  # compiled grammars kept (the least recently used goes first)
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    source: str = ""  # canonical text: JSON for schemas, choices and tags; the regex or EBNF as given

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.source

    @staticmethod
    def json_schema(schema) -> "GrammarSpec":
        check_schema(schema)
        return GrammarSpec("json_schema", _canonical(schema))

    @staticmethod
    def choice(options: list[str]) -> "GrammarSpec":
        return GrammarSpec("choice", _canonical(options))


def _canonical(value) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar is {len(text)} characters long; at most {MAX_GRAMMAR_CHARS}")
    return text


class Grammars:
    """The compiler for one tokenizer and vocab size, and its cache of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()  # the cache
        self._compiling = threading.Lock()  # one compile at a time: requests are prepared on several threads

    def compile(self, spec: GrammarSpec):
        with self._lock:
            if spec.key in self._cache:
                self._cache.move_to_end(spec.key)
                return self._cache[spec.key]
        if len(spec.source) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the {spec.kind} is {len(spec.source)} characters long; at most {MAX_GRAMMAR_CHARS}")
        try:
            with self._compiling:
                compiled = self._compile(spec)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar's parser errors come as RuntimeError / ValueError
            raise GrammarError(f"the {spec.kind.replace('_', ' ')} does not compile: {_reason(e)}") from None
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec):
        import xgrammar as xgr

        c = self.compiler
        if spec.kind == "json_schema":
            return c.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.source)
        if spec.kind == "choice":
            tag = {"type": "structural_tag", "format": {"type": "or", "elements": [
                {"type": "const_string", "value": v} for v in json.loads(spec.source)]}}
            return c.compile_structural_tag(json.dumps(tag))
        if spec.kind == "grammar":
            return c.compile_grammar(spec.source)
        if spec.kind == "structural_tag":
            return c.compile_structural_tag(xgr.StructuralTag.model_validate_json(spec.source))
        raise GrammarError(f"unknown grammar kind {spec.kind!r}; known: {', '.join(KINDS)}")


def _reason(e: Exception) -> str:
    """xgrammar's message without its source location prefix ("[time] file.cc:line: ")."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
