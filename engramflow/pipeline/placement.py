"""Where actors go on a Ray cluster.

* Projection actors: on a node offering the custom resource `engram_host` (the memory-rich
  table host), else on the driver's node; one actor per NUMA package there, layers dealt
  round-robin, threads pinned to the package's selected cores. The pipeline reserves for each
  what it uses, in a placement group on that node (`reserve`): the CPUs it pins (as many as
  the cluster has free at launch, so a small machine still starts) and its share of
  `engram_host`. The reservation is the pipeline's and goes at its shutdown; the actor itself
  asks for nothing, so a driver that keeps idle actors (pipeline/actor_pool.py) may keep it
  without keeping its CPUs from anyone.
* Stage actors: with GPUs, stage g on GPU g of a placement group (one {"GPU": 1} bundle per
  stage, packed); without GPUs, on a node that is not the table host when there is one
  (the cluster's compute nodes), else the driver's node.
* CPU stages share their node's cores with each other (and, on the table host, with the
  projection actors): those actors run with OMP_WAIT_POLICY=PASSIVE, so a process whose
  parallel region has ended sleeps instead of spinning on cores another actor is computing
  on (measured on 2 cores: 2 CPU stages with 2 steps in flight ran 2.8x faster). A policy the
  user set is kept; a GPU stage and the in-process Engine keep the default.
"""
from __future__ import annotations

import dataclasses
import os

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from engramflow.errors import EngramflowError

ENGRAM_RESOURCE = "engram_host"
NODE_LABEL = "ray.io/node-id"  # the label Ray gives every node: a bundle placed by node


def shared_cores_env() -> dict:
    """Actor options for processes that compute on cores other actors compute on too."""
    if "OMP_WAIT_POLICY" in os.environ:  # the user's choice reaches every worker as it is
        return {}
    return {"runtime_env": {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}}


@dataclasses.dataclass
class Plan:
    engram_node: str
    projection_groups: list[tuple[list[int], list[int] | None]]  # (layer ids, pinned cpus)
    stage_options: list[dict]
    placement_group: object = None  # the stages' GPU reservation, released at shutdown
    engram_share: float = 0.0  # of the table host's `engram_host` resource, per projection actor
    cpu_budget: float = 0.0  # CPUs the projection actors may ask for in all: the table host's,
    # and no more than the cluster has free at planning time
    projection_env: dict = dataclasses.field(default_factory=dict)  # shared_cores_env() or {}

    def projection_options(self, k: int) -> dict:
        """Projection actor k's options: on the table host, asking for nothing (`reservation`)."""
        return {"num_cpus": 0} | self.projection_env | on_node(self.engram_node)

    def reservation(self) -> list[dict]:
        """What the projection actors use, a bundle each (none for one that uses nothing Ray
        counts): the CPUs it pins, within the budget, and its share of `engram_host`."""
        share = self.cpu_budget / len(self.projection_groups)
        bundles = [{"CPU": min(len(cpus) if cpus else 1, share), ENGRAM_RESOURCE: self.engram_share}
                   for _, cpus in self.projection_groups]
        return [b for b in ({k: v for k, v in b.items() if v > 0} for b in bundles) if b]

    def describe(self) -> str:
        hide = ("scheduling_strategy", "runtime_env")
        return (f"projection actors: {self.reservation()}; "
                f"stages: {[{k: v for k, v in o.items() if k not in hide} for o in self.stage_options]}")


def reserve(plan: Plan, timeout_s: float):
    """The placement group holding the projection actors' resources on the table host (None if
    they use none); an EngramflowError if the cluster cannot grant it within `timeout_s`."""
    bundles = plan.reservation()
    if not bundles:
        return None
    pg = placement_group(bundles, strategy="STRICT_PACK",
                         bundle_label_selector=[{NODE_LABEL: plan.engram_node}] * len(bundles))
    if not pg.wait(timeout_seconds=timeout_s):
        ray.util.remove_placement_group(pg)
        raise EngramflowError(f"could not reserve the projection actors' resources within {timeout_s:.0f} s: the "
                              f"cluster lacks what they request ({plan.describe()})")
    return pg


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def _cores_here() -> list[list[int]]:
    from engramflow.actors.topology import packages

    return [list(p.selected) for p in packages()]


_package_cores = ray.remote(num_cpus=0)(_cores_here)


_PACKAGES: dict[str, list] = {}  # node id -> its packages' cores (a node's topology outlives its pipelines)


def node_packages(node_id: str) -> list:
    """The cores of each CPU package of the node, asked once per node and process: the task
    costs a worker process (an import of Ray) on every launch otherwise. A Ray worker of that
    node (a Serve replica) sees what the task would (the CPUs the node's raylet gave its
    workers) and looks itself; a driver may run on other CPUs (taskset) and asks."""
    if node_id not in _PACKAGES:
        here = ray.get_runtime_context()
        if here.worker.mode == ray.WORKER_MODE and here.get_node_id() == node_id:
            _PACKAGES[node_id] = _cores_here() or [None]
        else:
            _PACKAGES[node_id] = ray.get(_package_cores.options(**on_node(node_id)).remote()) or [None]
    return _PACKAGES[node_id]


def on_node(node_id: str) -> dict:
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def _callers_gpu_bundles(stages: int) -> list[int] | None:
    """The GPU bundles of the placement group the caller runs in (a Ray Serve replica declares
    one per stage), when it has one per stage; else None."""
    pg = ray.util.get_current_placement_group()
    if pg is None:
        return None
    bundles = [i for i, b in enumerate(pg.bundle_specs) if b.get("GPU", 0) >= 1]
    return bundles[:stages] if len(bundles) >= stages else None


def plan(layer_ids: list[int], stages: int) -> Plan:
    nodes = _alive_nodes()
    driver = ray.get_runtime_context().get_node_id()
    hosts = [n["NodeID"] for n in nodes if n["Resources"].get(ENGRAM_RESOURCE, 0) > 0]
    engram_node = hosts[0] if hosts else driver

    packages = node_packages(engram_node)
    n_actors = min(len(packages), len(layer_ids))
    groups = [([l for i, l in enumerate(layer_ids) if i % n_actors == k], packages[k]) for k in range(n_actors)]

    gpus = sum(n["Resources"].get("GPU", 0) for n in nodes)
    host_bundles = _callers_gpu_bundles(stages)
    if host_bundles is not None:  # a Ray Serve replica's reservation: its stages go there
        pg = None  # the caller's, not the pipeline's to release
        options = [{"num_gpus": 1, "num_cpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            ray.util.get_current_placement_group(), b)} for b in host_bundles]
    elif gpus >= stages:
        pg = placement_group([{"GPU": 1}] * stages, strategy="PACK")
        if not pg.wait(timeout_seconds=60):
            ray.util.remove_placement_group(pg)
            raise EngramflowError(f"could not reserve {stages} GPUs for the stage actors within 60 s")
        options = [{"num_gpus": 1, "num_cpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, g)}
                   for g in range(stages)]
    elif gpus:
        raise EngramflowError(f"{stages} stages need {stages} GPUs but the cluster has {int(gpus)}")
    else:
        pg = None
        compute = [n["NodeID"] for n in nodes if n["NodeID"] not in hosts]
        node = compute[0] if compute and hosts else driver
        options = [{"num_cpus": 0} | shared_cores_env() | on_node(node) for _ in range(stages)]
    host = next(n for n in nodes if n["NodeID"] == engram_node)
    share = host["Resources"][ENGRAM_RESOURCE] / n_actors if hosts else 0.0
    budget = min(host["Resources"].get("CPU", 0.0), ray.available_resources().get("CPU", 0.0))
    cpu_stages_here = "num_gpus" not in options[0] and options[0]["scheduling_strategy"].node_id == engram_node
    return Plan(engram_node, groups, options, pg, share, budget, shared_cores_env() if cpu_stages_here else {})
