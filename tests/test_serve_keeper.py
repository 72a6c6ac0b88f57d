"""A replica's pipeline outlives the replica through the keeper (serve/keeper.py), on real Ray.

A holder actor stands in for the Serve replica (the keeper needs only an actor to watch): it
launches its pipeline through the keeper, leaves a session open and is killed. The next holder
adopts the same actors (same actor ids: nothing started again), which hold no session of the
dead one, and the reservation of the projection actor's CPUs (the keeper made it too), and
generates what the dead one generated. A holder for other options does not
adopt it (the keeper ends that pipeline); a graceful release leaves nothing behind.
The live server's replica kill is in tests/test_serve_hostile.py.
"""
import uuid

import pytest
import ray

from actor_gone import gone
from engramflow.model.sampling import Sampling
from engramflow.serve.keeper import start_keeper

PROMPT, OTHER = [5, 6, 7, 8], [300, 301, 302, 303, 304]


@ray.remote(num_cpus=0)
class Holder:
    def __init__(self, keeper, ckpt: str, options: str):
        from engramflow.pipeline.pipeline import Pipeline
        from engramflow.serve.keeper import kept_pipeline

        self.kept = kept_pipeline(keeper, options, lambda owner: Pipeline.launch(
            ckpt, stages=1, backbone="reference", prefill_chunk=16, owner=owner))

    def adopted(self) -> bool:
        return self.kept.adopted

    def generate(self, ids: list[int]) -> list[int]:
        return self.kept.runner.generate([ids], max_new_tokens=6, sampling=Sampling(temperature=0.0))[0].tokens

    def leave_open(self, ids: list[int]) -> str:
        pipe = self.kept.runner
        session = pipe.open()
        pipe.prefill(session, ids)
        return session

    def actors(self) -> dict:
        """slot -> (actor id, the sessions it holds, or None for a stateless one), and the handles."""
        slots = self.kept.runner.slots
        return {name: (s.actor._actor_id.hex(), ray.get(s.actor.sessions.remote()) if s.stateful else None)
                for name, s in slots.items()}, [s.actor for s in slots.values()]

    def release(self) -> None:
        self.kept.release()

    def groups(self) -> list[str]:
        """The pipeline's placement groups (the projection actors' CPUs, made by the keeper)."""
        return [pg.id.hex() for pg in self.kept.runner.placement_groups if pg is not None]


def _state(group: str) -> str:
    return ray.util.placement_group_table()[group]["state"]


def test_a_dead_holders_pipeline_is_adopted_empty_and_generates_the_same(ray_session, tiny_ckpt):
    keeper = start_keeper(f"test-{uuid.uuid4().hex[:8]}")
    free = ray.available_resources().get("CPU", 0.0)
    first = Holder.remote(keeper, str(tiny_ckpt), "a")
    reserved = ray.get(first.groups.remote())
    assert bool(reserved) == (free > 0)  # the projection actor's CPUs, when there were any to reserve
    want = ray.get(first.generate.remote(PROMPT))
    session = ray.get(first.leave_open.remote(OTHER))
    before, _ = ray.get(first.actors.remote())
    assert any(held == [session] for _, held in before.values())  # state the next holder must not see
    assert not ray.get(first.adopted.remote())
    ray.kill(first, no_restart=True)  # no graceful stop: as a SIGKILLed replica
    assert gone(first)  # known dead before its successor starts, as Serve knows it

    second = Holder.remote(keeper, str(tiny_ckpt), "a")
    assert ray.get(second.adopted.remote())
    after, handles = ray.get(second.actors.remote())
    print(f"adopted: {sorted(after)}; sessions before {[h for _, h in before.values()]}, after {[h for _, h in after.values()]}")
    assert {k: v[0] for k, v in after.items()} == {k: v[0] for k, v in before.items()}  # the same actors
    assert all(held in (None, []) for _, held in after.values())
    assert ray.get(second.groups.remote()) == reserved and all(_state(g) == "CREATED" for g in reserved)  # the keeper's
    assert ray.get(second.generate.remote(PROMPT)) == want
    third = Holder.remote(keeper, str(tiny_ckpt), "a")  # the second lives: its pipeline is not handed out
    assert not ray.get(third.adopted.remote())
    theirs, mine = ray.get(third.actors.remote())
    assert not {v[0] for v in theirs.values()} & {v[0] for v in after.values()}

    ray.kill(second, no_restart=True)
    assert gone(second)
    assert ray.get(keeper.adopt.remote(third, "b")) is None  # other options: not adopted but ended
    assert all(gone(a) for a in handles) and all(_state(g) == "REMOVED" for g in reserved)
    assert ray.get(keeper.count.remote()) == 1
    ray.get(third.release.remote())  # a graceful stop: nothing left
    assert ray.get(keeper.count.remote()) == 0 and all(gone(a) for a in mine)
    ray.kill(keeper)


def test_a_second_keeper_for_the_same_application_is_refused(ray_session):
    """Two `engramflow serve` on one cluster would share the application: the second is told so."""
    from engramflow.errors import EngramflowError

    app = f"test-{uuid.uuid4().hex[:8]}"
    keeper = start_keeper(app)
    with pytest.raises(EngramflowError, match="already runs the application"):
        start_keeper(app)
    ray.kill(keeper)
