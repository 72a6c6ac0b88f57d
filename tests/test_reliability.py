"""Faults cost a retry, not a session: kill actors mid-generation and get the same tokens."""
import pytest
import ray
import torch

from engramflow.pipeline.engine import Engine

PROMPTS = ["Engram memory lets a model look things up", "The quick brown fox"]
NEW = 8


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    return [g.tokens for g in Engine(tiny_ckpt).generate(PROMPTS, max_new_tokens=NEW)]


@pytest.fixture(scope="module")
def pipe(tiny_pipelines):
    return tiny_pipelines(2)


def _generate_with_kill(pipe, victim: str, kill_at: int) -> list[list[int]]:
    """Greedy lockstep generation by hand, killing `victim` before decode step `kill_at`."""
    names = [pipe.open() for _ in PROMPTS]
    logits = [pipe.prefill(s, pipe.encode(p)) for s, p in zip(names, PROMPTS)]
    out = [[int(l.argmax())] for l in logits]
    for step in range(NEW - 1):
        if step == kill_at:
            ray.kill(pipe.actor(victim), no_restart=True)
        nxt = pipe.decode_step({s: o[-1] for s, o in zip(names, out)})
        for s, o in zip(names, out):
            o.append(int(nxt[s].argmax()))
    for s in names:
        pipe.close(s)
    return out


@pytest.mark.parametrize("victim", ["projection0", "stage1", "stage0", "history"])
def test_killed_actor_mid_generation_gives_the_undisturbed_tokens(pipe, reference, victim):
    before = pipe.recovery.restarts
    assert _generate_with_kill(pipe, victim, kill_at=3) == reference
    assert pipe.recovery.restarts == before + 1
    assert pipe.recovery.events[-1]["dead"] == [victim]


@pytest.mark.parametrize("seed", [20261130])
def test_random_fork_reset_close_under_lockstep_equal_solo_runs(pipe, tiny_ckpt, seed):
    """Seeded random session operations between lockstep steps; every step of every session
    equals that session replayed alone on the in-process engine."""
    import numpy as np

    rng = np.random.default_rng(seed)
    engine = Engine(tiny_ckpt)
    live = [pipe.open() for _ in range(32)]
    for i, s in enumerate(live):
        pipe.prefill(s, rng.integers(3, 120_000, 3 + i % 7).tolist())
    record: dict[str, list] = {}  # session -> (segments so far, logits) after each step
    for step in range(20):
        for _ in range(3):  # a few random session operations between lockstep steps
            op = rng.random()
            if op < 0.35 and len(live) < 32:
                live.append(pipe.fork(live[rng.integers(len(live))]))
            elif op < 0.6:
                s = live[rng.integers(len(live))]
                pipe.reset(s)
                pipe.prefill(s, rng.integers(3, 120_000, 4).tolist())
            elif len(live) > 2:
                s = live.pop(rng.integers(len(live)))
                pipe.close(s)
        out = pipe.decode_step({s: int(rng.integers(3, 120_000)) for s in live})
        for s in live:
            record.setdefault(s, []).append((pipe.segments(s), out[s]))
    # replay each session alone, checking the logits after every recorded step
    checked = 0
    for s, steps in record.items():
        solo, done = engine.open(), []
        for segs, logits in steps:
            keys = [(g.start_pos, g.ids.tobytes()) for g in segs]
            if keys[:len(done)] != done:  # a reset in between: start the solo run over
                engine.reset(solo)
                done = []
            for seg in segs[len(done):]:
                got = engine.prefill(solo, seg.ids.tolist(), start_pos=seg.start_pos)
            done = keys
            assert torch.allclose(got, logits, atol=1e-5), (s, len(segs))
            checked += 1
        engine.close(solo)
    assert checked == sum(len(steps) for steps in record.values())
    for s in live:
        pipe.close(s)
    assert pipe.history_sessions() == 0
    assert all(st == {"live_sessions": 0, "cached_positions": 0} for st in pipe.stage_stats())
