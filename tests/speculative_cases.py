"""What the speculative-decoding tests share: the small official model with room for 200 new
tokens, a prompt, the plain greedy continuation (a test module's N_TOKENS of it), and an
injected drafter that knows it. A test module imports the fixtures by name."""
import json
from pathlib import Path

import pytest
import torch

from engramflow.model.speculative import Draft
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.runner import Runner
from v41_golden import V41_SMALL

PROMPT = [5, 17, 300, 41, 9]


def long_checkpoint(d: Path) -> Path:
    """The committed small model (weights and token map linked) with max_seq_len 320."""
    for name in ("model.safetensors", "engram_token_map.bin"):
        (d / name).symlink_to(V41_SMALL / name)
    cfg = json.loads((V41_SMALL / "config.json").read_text()) | {"max_seq_len": 320}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory):
    return long_checkpoint(tmp_path_factory.mktemp("v41-small-long"))


@pytest.fixture(scope="module")
def plain_tokens(long_ckpt, request):
    """Plain greedy decoding's first N_TOKENS (the test module's) after PROMPT."""
    e = Engine(long_ckpt)
    tokens = e.generate([PROMPT], max_new_tokens=request.module.N_TOKENS)[0].tokens
    e.shutdown()
    return tokens


def injected_draft(reference: list[int], length: int, n: int) -> Draft:
    """Draft i after the token at `length` is the plain continuation, spoiled when (3j + i) % 4 == 0
    (j = that token's index in `reference`): steps keep 0, 1 or all of their drafts."""
    j = length - len(PROMPT)
    tokens = [reference[j + 1 + i] if j + 1 + i < len(reference) and (3 * j + i) % 4 else (reference[j] + 1 + i) % 512
              for i in range(n)]
    return Draft(tokens, torch.zeros(n, 512), torch.zeros(n))


class KnownDrafts(Engine):
    """An Engine whose drafter knows each planted prompt's plain greedy continuation and drafts
    it right, except where `spoil(j, i)` says (j: the index of the token drafted after, i: the
    draft's index in the block), with a confidence logit of +4 when right, -4 when spoiled (the
    adaptive gate's input). The prompt is found from the session's own tokens."""

    def __init__(self, *args, spoil=lambda j, i: False, **kw):
        super().__init__(*args, **kw)
        self.planted: list[tuple[list[int], list[int]]] = []
        self.spoil = spoil

    def plant(self, prompt: list[int], continuation: list[int]) -> None:
        self.planted.append((list(prompt), list(continuation)))

    drafts = Runner.drafts  # one session at a time, through _draft below

    def _draft(self, session, token, start, n, sampling, stream, step):
        have = self.tokens(session)
        prompt, ref = next((p, r) for p, r in self.planted if have[:len(p)] == p)
        j = start - len(prompt)  # `token` is ref[j]
        right = [j + 1 + i < len(ref) and not self.spoil(j, i) for i in range(n)]
        tokens = [ref[j + 1 + i] if ok else (token + 1 + i) % 512 for i, ok in enumerate(right)]
        return Draft(tokens, torch.zeros(n, 512), torch.tensor([4.0 if ok else -4.0 for ok in right]))
