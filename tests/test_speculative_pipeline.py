"""Speculative decoding on the Ray pipeline (1-3 stages): the last stage drafts, each block is
verified in one step through every stage (its Engram rows looked up and projected like any
chunk's), rejected positions are rolled back in the history actor and every stage (the truncate
rides with the next step's calls), and the driver's log holds only accepted tokens. Recovery by
replay works with a draft in flight: an actor killed between drafting and verifying.
"""
import pytest
import ray

from engramflow.pipeline.engine import Engine
from engramflow.pipeline.pipeline import Pipeline
from speculative_cases import PROMPT, injected_draft, long_ckpt, plain_tokens  # noqa: F401 (fixtures)

N_TOKENS = 200  # long enough for many accepts and rejects around both faults


class InjectedPipeline(Pipeline):
    """Injected drafts (the plain continuation, some spoiled); kills `kill_at[step]` just before
    that step's block is verified (the draft is made, not yet written)."""
    reference: list[int] = []
    kill_at: dict[int, str] = {}

    def _draft(self, session, token, start, n, sampling, stream, step):
        victim = self.kill_at.pop(step, None)
        if victim is not None:
            ray.kill(self.actor(victim), no_restart=True)
        return injected_draft(self.reference, start, n)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_greedy_equals_plain_with_rollbacks_and_a_fault(ray_session, long_ckpt, plain_tokens, stages):
    pipe = InjectedPipeline.launch(long_ckpt, stages=stages, speculative="dspark:exact")
    pipe.reference = plain_tokens
    pipe.kill_at = {5: f"stage{stages - 1}", 11: "history"}
    try:
        (g,) = pipe.generate([PROMPT], max_new_tokens=N_TOKENS, keep_sessions=True)
        stats = pipe.speculative_stats
        assert g.tokens == plain_tokens
        assert pipe.tokens(g.session) == PROMPT + plain_tokens[:-1]  # the log: accepted tokens only
        assert 0 < stats.accepted < stats.drafted
        assert pipe.recovery.restarts >= 2  # both kills were met and recovered from by replay
    finally:
        pipe.shutdown()


def test_real_draft_layers_on_the_last_stage(ray_session, long_ckpt, plain_tokens):
    pipe = Pipeline.launch(long_ckpt, stages=2, speculative="dspark:exact")
    try:
        (g,) = pipe.generate([PROMPT], max_new_tokens=16)
        assert g.tokens == plain_tokens[:16]
        assert pipe.speculative_stats.drafted > 0
    finally:
        pipe.shutdown()


class InjectedPerStream(Pipeline):
    references: dict[int, list[int]] = {}

    def _draft(self, session, token, start, n, sampling, stream, step):
        return injected_draft(self.references[stream], start, n)


def test_steps_in_flight_compose_with_speculative_steps(ray_session, long_ckpt):
    """Three sessions on two stages: one speculative step in flight, then two (different
    sessions' blocks on different stages at once); the same tokens, plain greedy's."""
    prompts = [PROMPT, [7, 8, 9, 10, 11], [400, 3, 200, 1, 50]]
    e = Engine(long_ckpt)
    plain = [g.tokens for g in e.generate(prompts, max_new_tokens=20)]
    e.shutdown()
    pipe = InjectedPerStream.launch(long_ckpt, stages=2, speculative="dspark:exact")
    pipe.references = dict(enumerate(plain))
    try:
        one = [g.tokens for g in pipe.generate(prompts, max_new_tokens=20, in_flight=1)]
        two = [g.tokens for g in pipe.generate(prompts, max_new_tokens=20, in_flight=2)]
        assert one == two == plain
        assert pipe.speculative_stats.accepted > 0
        assert pipe.sessions == []  # every session closed
    finally:
        pipe.shutdown()


@pytest.mark.parametrize("spec", ["eagle", "dspark:0", "dspark:two"])
def test_generate_refuses_a_bad_speculative_option_before_ray(long_ckpt, capsys, spec):
    from engramflow.cli.app import main

    code = main(["generate", "--checkpoint", str(long_ckpt), "--prompt", "hi", "--speculative", spec])
    err = capsys.readouterr().err
    assert code == 2 and "speculative" in err and "Traceback" not in err and err.count("\n") == 1
