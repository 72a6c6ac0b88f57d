"""A constrained request under DSpark speculative decoding (in process, the small official model,
no Ray): each block's target rows are masked as the grammar stands after the drafts before
them, so a draft the grammar refuses is rejected and the token after the kept drafts is
allowed; the tokens equal plain constrained greedy decoding's, with drafts kept, spoiled and
refused, and with the real draft layers."""
import json

import jsonschema
import pytest

from engramflow.io.tokenizer_file import load_checkpoint_tokenizer
from engramflow.model.sampling import Sampling
from engramflow.pipeline.engine import Engine
from engramflow.scheduling import Request, Scheduler
from engramflow.serve.picking import pick_factory
from engramflow.structured.constraint import Constraint
from engramflow.structured.grammars import Grammars, GrammarSpec
from speculative_cases import PROMPT, KnownDrafts, long_ckpt  # noqa: F401 (fixture)
from test_serve_speculative_scheduler import Collect

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
N = 40
VOCAB = 512  # the small official model's


@pytest.fixture(scope="module")
def grammar(long_ckpt):
    return Grammars(load_checkpoint_tokenizer(long_ckpt), VOCAB).compile(GrammarSpec.json_schema(SCHEMA))


def run(engine, grammar) -> tuple[list[int], Scheduler]:
    sched = Scheduler(engine)
    req = sched.add(Request(list(PROMPT), pick_factory(Sampling()), Collect(N), eos_ids=frozenset({1}), max_tokens=N,
                            constraint=Constraint(grammar, VOCAB)))
    while not req.sink.done.is_set():
        sched.step()
    assert req.sink.reason == "stop"  # EOS: the grammar was complete
    return req.sink.tokens, sched


@pytest.fixture(scope="module")
def plain(long_ckpt, grammar):
    e = Engine(long_ckpt, prefill_chunk=16)
    tokens, _ = run(e, grammar)
    e.shutdown()
    tok = load_checkpoint_tokenizer(long_ckpt)
    jsonschema.validate(json.loads(tok.decode(tokens)), SCHEMA)
    return tokens


def test_known_drafts_kept_spoiled_and_refused_give_plain_tokens(long_ckpt, grammar, plain):
    """Planted drafts are the plain constrained tokens, spoiled at every third place with another
    token (one the grammar mostly refuses there: then the mask, not the model, rejects it)."""
    e = KnownDrafts(long_ckpt, prefill_chunk=16, speculative="dspark:exact", spoil=lambda j, i: (j + i) % 3 == 2)
    e.plant(PROMPT, plain)
    tokens, sched = run(e, grammar)
    stats = sched.speculative_stats
    assert tokens == plain[:len(tokens)] and len(tokens) == len(plain)
    assert 0 < stats.accepted < stats.drafted
    e.shutdown()


def test_real_draft_layers_give_plain_tokens(long_ckpt, grammar, plain):
    e = Engine(long_ckpt, prefill_chunk=16, speculative="dspark:exact")
    tokens, sched = run(e, grammar)
    assert tokens == plain and sched.speculative_stats.drafted > 0
    e.shutdown()
