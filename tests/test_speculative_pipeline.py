"""Speculative decoding on the Ray pipeline (1-3 stages): the last stage drafts, each block is
verified in one step through every stage (its Engram rows looked up and projected like any
chunk's), rejected positions are rolled back in the history actor and every stage (the truncate
rides with the next step's calls), and the driver's log holds only accepted tokens. Recovery by
replay works with a draft in flight: an actor killed between drafting and verifying.
"""
import pytest
import ray

from engramflow.pipeline.engine import Engine
from engramflow.pipeline.runner import Runner
from engramflow.pipeline.pipeline import Pipeline
from speculative_cases import PROMPT, injected_draft, long_ckpt, plain_tokens  # noqa: F401 (fixtures)

N_TOKENS = 200  # long enough for many accepts and rejects around both faults


class Injected(Pipeline):
    """Drafts injected by the test: `references[stream]` (the plain continuation, some spoiled)
    when set, else the real draft layers; kills `kill_at[step]` just before that step's block is
    verified (the draft is made, not yet written)."""
    references: dict[int, list[int]] | None = None
    kill_at: dict[int, str] = {}

    drafts = Runner.drafts  # one session at a time, through _draft below

    def _draft(self, session, token, start, n, sampling, stream, step):
        victim = self.kill_at.pop(step, None)
        if victim is not None:
            ray.kill(self.actor(victim), no_restart=True)
        if self.references is None:
            return Pipeline.drafts(self, [(session, token, start, n, sampling, stream, step)])[0]
        return injected_draft(self.references[stream], start, n)


@pytest.fixture(scope="module")
def pipes(ray_session, long_ckpt):
    """The module's speculative pipeline of the stage count asked for, its injection reset for
    each test. One lives at a time: asked for another count, the old one shuts down and the
    session's kept actors (conftest: actor_pool.keep_idle) start the new one, so the 1-, 2- and
    3-stage cases share processes rather than hold 12 at once."""
    made: dict[int, Injected] = {}

    def get(stages: int) -> Injected:
        if stages not in made:
            for old in made.values():
                old.shutdown()
            made.clear()
            made[stages] = Injected.launch(long_ckpt, stages=stages, speculative="dspark:exact")
        pipe = made[stages]
        pipe.references, pipe.kill_at = None, {}
        assert pipe.sessions == []  # the previous test closed what it opened
        return pipe

    yield get
    for pipe in made.values():
        pipe.shutdown()


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_greedy_equals_plain_with_rollbacks_and_a_fault(pipes, plain_tokens, stages):
    pipe = pipes(stages)
    pipe.references = {0: plain_tokens}
    pipe.kill_at = {5: f"stage{stages - 1}", 11: "history"}
    restarts = pipe.recovery.restarts
    (g,) = pipe.generate([PROMPT], max_new_tokens=N_TOKENS, keep_sessions=True)
    stats = pipe.speculative_stats
    assert g.tokens == plain_tokens
    assert pipe.tokens(g.session) == PROMPT + plain_tokens[:-1]  # the log: accepted tokens only
    assert 0 < stats.accepted < stats.drafted
    assert pipe.recovery.restarts - restarts >= 2  # both kills were met and recovered from by replay
    pipe.close(g.session)


def test_real_draft_layers_on_the_last_stage(pipes, plain_tokens):
    pipe = pipes(2)
    (g,) = pipe.generate([PROMPT], max_new_tokens=16)
    assert g.tokens == plain_tokens[:16]
    assert pipe.speculative_stats.drafted > 0


def test_steps_in_flight_compose_with_speculative_steps(pipes, long_ckpt):
    """Three sessions on two stages: one speculative step in flight, then two (different
    sessions' blocks on different stages at once); the same tokens, plain greedy's."""
    prompts = [PROMPT, [7, 8, 9, 10, 11], [400, 3, 200, 1, 50]]
    e = Engine(long_ckpt)
    plain = [g.tokens for g in e.generate(prompts, max_new_tokens=20)]
    e.shutdown()
    pipe = pipes(2)
    pipe.references = dict(enumerate(plain))
    one = [g.tokens for g in pipe.generate(prompts, max_new_tokens=20, in_flight=1)]
    two = [g.tokens for g in pipe.generate(prompts, max_new_tokens=20, in_flight=2)]
    assert one == two == plain
    assert pipe.speculative_stats.accepted > 0
    assert pipe.sessions == []  # every session closed


@pytest.mark.parametrize("spec", ["eagle", "dspark:0", "dspark:two"])
def test_generate_refuses_a_bad_speculative_option_before_ray(long_ckpt, capsys, spec):
    from engramflow.cli.app import main

    code = main(["generate", "--checkpoint", str(long_ckpt), "--prompt", "hi", "--speculative", spec])
    err = capsys.readouterr().err
    assert code == 2 and "speculative" in err and "Traceback" not in err and err.count("\n") == 1
