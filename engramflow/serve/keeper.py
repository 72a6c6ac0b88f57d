"""The actor that owns a server's pipelines, so that a replica's pipeline outlives the replica.

Ray ends the actors a process made when that process dies: a Serve replica that made its own
pipeline takes it along when it is killed, and its replacement starts every actor again
(worker processes, torch imports, checkpoint loads: 10-15 s of the ~16-20 s a replacement
took). So `engramflow serve` starts one keeper, owned by its own driver process (the keeper
and every pipeline end with the server, even when the driver is killed: nothing is
detached, nothing leaks onto a cluster). A replica has the keeper make its pipeline's actors
(at launch and when recovery replaces one) and records the pipeline here; a new replica adopts
the pipeline of a replica that died (pipeline/adopt.py: no session survives, dead actors are
made again) and starts in about the time of its own process.

Not used when the replica holds a placement group (GPU stages in Serve's per-replica bundles):
Serve removes that group with the replica, and the stages with it. There, and without a keeper
(an application run from a Serve config), a replica launches its pipeline as before.
"""
from __future__ import annotations

import itertools
import logging

import ray
from ray.util.placement_group import PlacementGroup

NAMESPACE = "engramflow"
HOLDER_PING_S = 2.0  # a holder that answers nothing but is not known dead keeps its pipeline
log = logging.getLogger("engramflow.serve")


@ray.remote(num_cpus=0)
class PipelineKeeper:
    """Calls run one at a time (a plain actor): two replicas never adopt the same pipeline."""

    def __init__(self):
        self.ids = itertools.count()
        self.pipelines: dict[int, dict] = {}  # id -> holder (a replica's handle), recipe, actors by slot

    def begin(self, holder, config: str) -> int:
        pid = next(self.ids)
        self.pipelines[pid] = {"holder": holder, "config": config, "recipe": None, "actors": {}}
        return pid

    def make(self, pid: int, slot: str, make):
        """Make one actor here (this process owns it); the handle kept here keeps it alive. The
        "reservation" slot is the projection actors' placement group, made here for the same reason."""
        actor = make()
        if pid in self.pipelines:
            self.pipelines[pid]["actors"][slot] = actor
        return [actor]  # in a list: the caller borrows the handle, this process stays its owner

    def store(self, pid: int, recipe: dict) -> None:
        self.pipelines[pid]["recipe"] = recipe

    def adopt(self, holder, config: str) -> tuple[int, dict, dict] | None:
        """(id, recipe, actors) of a pipeline launched for the same `config` whose holder died,
        now held by `holder`; None if none. A dead holder's pipeline that cannot be adopted (it
        died while launching it, or the application was redeployed otherwise) ends here."""
        for pid, p in list(self.pipelines.items()):
            if not self._dead(p["holder"]):
                continue
            if p["recipe"] is None or p["config"] != config:
                self.forget(pid, kill=True)
                continue
            p["holder"] = holder
            return pid, p["recipe"], dict(p["actors"])
        return None

    def forget(self, pid: int, kill: bool = False) -> None:
        p = self.pipelines.pop(pid, None)
        for handle in (p or {}).get("actors", {}).values() if kill else ():
            if isinstance(handle, PlacementGroup):
                ray.util.remove_placement_group(handle)
            elif handle is not None:
                ray.kill(handle, no_restart=True)

    def count(self) -> int:
        return len(self.pipelines)

    @staticmethod
    def _dead(holder) -> bool:
        try:
            ray.get(holder.__ray_ready__.remote(), timeout=HOLDER_PING_S)
            return False
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            return False


def keeper_name(app: str) -> str:
    return f"keeper:{app}"


def start_keeper(app: str):
    """The keeper of application `app`, owned by the calling process (`engramflow serve`)."""
    from engramflow.errors import EngramflowError

    try:
        return PipelineKeeper.options(name=keeper_name(app), namespace=NAMESPACE).remote()
    except ValueError:  # the name is taken, and a keeper lives only as long as its server
        raise EngramflowError(f"another `engramflow serve` already runs the application {app!r} on this Ray "
                              f"cluster") from None


def _owned_by(keeper, pid: int):
    """Launch's `owner` hook: each slot's actor made in the keeper's process."""
    def wrap(slot: str, make):
        return lambda: ray.get(keeper.make.remote(pid, slot, make))[0]
    return wrap


class KeptPipeline:
    """A replica's hold on its pipeline through the keeper: launched or adopted; `release`
    on a graceful stop ends the actors and the keeper's record."""

    def __init__(self, keeper, pid: int, runner, adopted: bool):
        self.keeper, self.pid, self.runner, self.adopted = keeper, pid, runner, adopted

    def release(self) -> None:
        self.runner.shutdown()
        try:
            ray.get(self.keeper.forget.remote(self.pid), timeout=10)
        except ray.exceptions.RayError:  # the keeper is gone: so are the actors it owned
            pass


def find_keeper(app: str):
    try:
        return ray.get_actor(keeper_name(app), namespace=NAMESPACE)
    except ValueError:
        return None


def kept_pipeline(keeper, config: str, launch) -> KeptPipeline:
    """This replica's pipeline: a dead replica's launched for the same `config` (a canonical
    string of the replica's options), adopted, or one `launch(owner=...)` starts."""
    from engramflow.pipeline.adopt import adopt, recipe
    from engramflow.pipeline.pipeline import Pipeline

    me = ray.get_runtime_context().current_actor
    found = ray.get(keeper.adopt.remote(me, config))
    if found is not None:
        pid, r, actors = found
        try:
            pipe = adopt(Pipeline, r, actors)
            log.warning("adopted pipeline %d of a replica that died (made again: %s)", pid, pipe.adopted or "none")
            return KeptPipeline(keeper, pid, pipe, True)
        except Exception as e:  # noqa: BLE001 - whatever broke it, a fresh pipeline is the answer
            log.warning("could not adopt pipeline %d (%s); launching a new one", pid, e)
            ray.get(keeper.forget.remote(pid, kill=True))
    pid = ray.get(keeper.begin.remote(me, config))
    pipe = launch(owner=_owned_by(keeper, pid))
    ray.get(keeper.store.remote(pid, recipe(pipe)))
    return KeptPipeline(keeper, pid, pipe, False)


def replica_pipeline(config) -> KeptPipeline | None:
    """A Serve replica's pipeline through its application's keeper, or None where there is
    none to use: no keeper (an application from a Serve config), the in-process Engine, or
    GPU stages in this replica's own placement group (see above)."""
    import dataclasses
    import json

    from ray import serve

    from engramflow.serve import backend

    if config.in_process or ray.util.get_current_placement_group() is not None:
        return None
    keeper = find_keeper(serve.get_replica_context().app_name)
    if keeper is None:
        return None
    options = json.dumps(dataclasses.asdict(config), sort_keys=True, default=repr)
    return kept_pipeline(keeper, options, lambda owner: backend.launch_runner(config, owner))
