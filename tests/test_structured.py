"""structured/: the checkpoint's vocabulary as bytes, grammars compiled and cached, the masked
pick, and a request's constraint driven to the end of its grammar by real token choices on
random logits (no Ray, no model): what comes out parses and validates."""
import json

import jsonschema
import numpy as np
import pytest
import torch

from engramflow.chat import tokens as T
from engramflow.chat.parser import parse_completion
from engramflow.io.tokenizer_file import load_checkpoint_tokenizer
from engramflow.model.sampling import Pick, Sampling
from engramflow.structured.constraint import Constraint
from engramflow.structured.errors import GrammarError
from engramflow.structured.grammars import Grammars, GrammarSpec
from engramflow.structured.masked_pick import MaskedPick, allowed_tokens
from engramflow.structured.tool_calls import forced_calls, no_calls
from engramflow.structured.vocabulary import token_bytes

CKPT = "checkpoints/v41-small"
VOCAB = 129280

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    "home": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}},
             "required": ["lat"]}},
    "required": ["name", "age", "role", "tags", "home"]}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "units": {"enum": ["c", "f"]},
    "alerts": {"type": "boolean"}},
    "required": ["city", "days", "units", "alerts"]}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {
    "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_checkpoint_tokenizer(CKPT)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, VOCAB)


def run(grammars, tokenizer, spec, seed, think_end=None, prefix=(), max_steps=400) -> list[int]:
    """Write a whole completion under `spec` from random logits: the scheduler's loop in small
    (the constraint's pick for each step, then advance with the picked token)."""
    c = Constraint(grammars.compile(spec), VOCAB, think_end)
    gen = torch.Generator().manual_seed(seed)
    eos = tokenizer.token_to_id(T.EOS)
    out = []
    for step in range(max_steps):
        if step < len(prefix):
            token = prefix[step]  # forced tokens, as a model might write them (thinking)
        else:
            logits = torch.randn(VOCAB, generator=gen) * 3
            token = c.pick(Pick())(logits).token  # greedy on fresh random logits: cheap, and varied
        c.advance(token)
        out.append(token)
        if token == eos:
            return out
    raise AssertionError(f"no EOS in {max_steps} steps: {tokenizer.decode(out)!r}")


def text_of(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False).removesuffix(T.EOS)


def test_token_bytes_are_what_the_tokenizer_writes(tokenizer):
    tb = token_bytes(tokenizer, VOCAB)
    text = '{"a": "héllo wörld\\n", "b": [1, 2.5]} 日本語 ｜DSML｜'
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert b"".join(tb[i] for i in ids).decode() == text
    assert tb[tokenizer.token_to_id(T.DSML)] == T.DSML.encode()
    for control in (T.EOS, T.BOS, T.THINK_END, T.USER):  # never written under a grammar
        assert tb[tokenizer.token_to_id(control)] == b""


def test_compiled_once_per_grammar(grammars):
    a = grammars.compile(GrammarSpec.json_schema(PERSON))
    b = grammars.compile(GrammarSpec.json_schema(json.loads(json.dumps(PERSON))))
    assert a is b
    assert grammars.compile(GrammarSpec("regex", "[ab]+")) is not a


@pytest.mark.parametrize("spec, words", [
    (lambda: GrammarSpec.json_schema({"type": "nope"}), "Unsupported type"),
    (lambda: GrammarSpec.json_schema({"not": {"type": "string"}}), "'not'"),
    (lambda: GrammarSpec.json_schema({"type": "object", "properties": {"a": {"if": {}}}}), "schema.properties.a"),
    (lambda: GrammarSpec.json_schema({"allOf": [{"type": "integer"}, {"minimum": 3}]}), "allOf of 2"),
    (lambda: GrammarSpec.json_schema(5), "must be a JSON schema"),
    (lambda: GrammarSpec("regex", "[a-z"), "Unclosed"),
    (lambda: GrammarSpec("grammar", 'rule ::= "a"'), "root"),
])
def test_bad_grammars_are_named(grammars, spec, words):
    with pytest.raises(GrammarError, match=None) as e:
        grammars.compile(spec())
    assert words in str(e.value)


def test_mask_leaves_only_allowed_tokens_and_logprobs_of_the_masked_logits(grammars, tokenizer):
    c = Constraint(grammars.compile(GrammarSpec.choice(["yes", "no"])), VOCAB)
    words = c.bitmask()
    allowed = allowed_tokens(words, VOCAB)
    starts = {i for i in range(VOCAB) if allowed[i]}
    assert starts and all("yes".startswith(tokenizer.decode([i])) or "no".startswith(tokenizer.decode([i]))
                          for i in starts)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))
    picked = MaskedPick(Pick(Sampling(0.7, 0, 3), 0, 0, logprobs=5), words)(logits)
    assert picked.token in starts and set(picked.top_tokens) <= starts | set()
    masked = logits.masked_fill(~allowed, float("-inf"))
    assert picked.logprob == pytest.approx(float(torch.log_softmax(masked, -1)[picked.token]))
    # the same pick without a mask is untouched: the unconstrained path is the plain Pick
    assert Pick(Sampling(0.7, 0, 3), 0, 0)(logits).token == Pick(Sampling(0.7, 0, 3), 0, 0)(logits.clone()).token


def test_top_logprobs_hold_only_allowed_tokens(grammars, tokenizer):
    """Two tokens allowed, five asked for: the top list has the allowed ones, no -inf."""
    words = Constraint(grammars.compile(GrammarSpec.choice(["yes", "no"])), VOCAB).bitmask()
    allowed = int(allowed_tokens(words, VOCAB).sum())
    picked = MaskedPick(Pick(logprobs=allowed + 3), words)(torch.randn(VOCAB))
    assert len(picked.top_tokens) == allowed and all(np.isfinite(picked.top_logprobs))


@pytest.mark.parametrize("seed", range(5))
def test_sampled_json_validates(grammars, tokenizer, seed):
    ids = run(grammars, tokenizer, GrammarSpec.json_schema(PERSON), seed)
    jsonschema.validate(json.loads(text_of(tokenizer, ids)), PERSON)


def test_regex_and_choice_and_ebnf(grammars, tokenizer):
    for seed in range(5):
        assert text_of(tokenizer, run(grammars, tokenizer, GrammarSpec.choice(["red", "green"]), seed)) in ("red",
                                                                                                          "green")
        text = text_of(tokenizer, run(grammars, tokenizer, GrammarSpec("regex", r"[0-9]{3}-[a-c]{2}"), seed))
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and set(text[4:]) <= set("abc")
        ebnf = 'root ::= "(" item ("," item)? ")"\nitem ::= "x" | "y"'
        assert text_of(tokenizer, run(grammars, tokenizer, GrammarSpec("grammar", ebnf), seed)) in (
            "(x)", "(y)", "(x,x)", "(x,y)", "(y,x)", "(y,y)")


@pytest.mark.parametrize("seed", range(4))
def test_forced_calls_parse_and_validate(grammars, tokenizer, seed):
    spec = forced_calls([WEATHER["function"], CLOCK["function"]], parallel=seed % 2 == 0)
    calls = parse_completion(text_of(tokenizer, run(grammars, tokenizer, spec, seed)), False)["tool_calls"]
    assert calls and (seed % 2 == 0 or len(calls) == 1)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_named_tool_is_the_one_called(grammars, tokenizer):
    for seed in range(2):
        text = text_of(tokenizer, run(grammars, tokenizer, forced_calls([WEATHER["function"], CLOCK["function"]], only="clock"), seed))
        calls = parse_completion(text, False)["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["clock"]


def test_no_calls_never_allows_the_dsml_marker(grammars, tokenizer):
    c = Constraint(grammars.compile(no_calls()), VOCAB)
    for text in ("Sure.\n\n<", "x"):
        for t in tokenizer.encode(text, add_special_tokens=False).ids:
            c.advance(t)
        assert not allowed_tokens(c.bitmask(), VOCAB)[tokenizer.token_to_id(T.DSML)]


def test_thinking_is_free_until_think_end(grammars, tokenizer):
    think_end = tokenizer.token_to_id(T.THINK_END)
    reasoning = tokenizer.encode("hmm { not json", add_special_tokens=False).ids
    c = Constraint(grammars.compile(GrammarSpec.choice(["ok"])), VOCAB, think_end)
    base = Pick()
    for t in reasoning:
        assert c.pick(base) is base  # nothing masked, nothing paid
        c.advance(t)
    c.advance(think_end)
    assert isinstance(c.pick(base), MaskedPick)
    ids = run(grammars, tokenizer, GrammarSpec.choice(["ok"]), 0, think_end, prefix=[*reasoning, think_end])
    assert text_of(tokenizer, ids).endswith(T.THINK_END + "ok")
