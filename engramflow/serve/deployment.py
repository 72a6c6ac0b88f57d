"""The Ray Serve application: each replica owns one runner (a Pipeline of stage actors, or the
in-process Engine) and serves the OpenAI API from it; more replicas mean more pipelines.

`build(args)` is an application builder, so a `serve run` config can name it:

    applications:
      - name: engramflow
        import_path: engramflow.serve.deployment:build
        args: {checkpoint: /data/v41, stages: 4, replicas: 1, max_sessions: 64}

The args are ServeConfig.build's keywords (serve/config.py), checked here, before any replica.

A replica is the driver of its pipeline. With GPUs it declares placement-group bundles (one for
itself, one GPU per stage) and the pipeline puts its stage actors in them; the actors go when
the replica stops. Without them, under `engramflow serve`, the application's keeper owns the
pipeline's actors (serve/keeper.py): a replica that is killed leaves them to its replacement,
which adopts them in a known, empty state instead of starting a pipeline again.
"""
from __future__ import annotations

from ray import serve

from engramflow.serve.api import make_api
from engramflow.serve.backend import current_backend
from engramflow.serve.config import ServeConfig
from engramflow.validate import check_int

API = make_api(current_backend)


@serve.deployment(name="engramflow", ray_actor_options={"num_cpus": 0})
@serve.ingress(API)
class EngramflowServer:
    def __init__(self, config: ServeConfig):
        # imported here: Serve ships this class by value, and the backend must live in a module
        # the routes import by reference
        from concurrent.futures import ThreadPoolExecutor

        from engramflow.serve import backend
        from engramflow.serve.keeper import replica_pipeline
        from engramflow.serve.loopback import keep_replica_grpc_on_loopback
        from engramflow.serve.metrics import ServeMetrics

        keep_replica_grpc_on_loopback()  # before Serve opens the replica's own gRPC port
        with ThreadPoolExecutor(1) as pool:  # the tokenizer builds while the pipeline starts
            text = pool.submit(backend.CheckpointText.load, config.checkpoint)
            self.kept = replica_pipeline(config)  # a dead replica's pipeline, adopted, when it can
            runner = self.kept.runner if self.kept is not None else backend.launch_runner(config)
            backend.set_backend(backend.Backend(runner, config, ServeMetrics(), text.result()))

    def check_health(self):
        """Ray Serve calls this every few seconds; raising makes it replace the replica."""
        from engramflow.serve import backend

        backend.current_backend().check_health()

    def __del__(self):
        from engramflow.serve import backend

        old = backend.set_backend(None)
        if old is not None:
            old.close()
        if getattr(self, "kept", None) is not None:  # a graceful stop: nobody will adopt it
            self.kept.release()


HEALTH_CHECK_PERIOD_S = 2.0  # a spent pipeline is replaced within a few seconds


def build(args: dict) -> serve.Application:
    """The application for `serve run` / `serve.run`: ServeConfig.build's keywords, plus `replicas`."""
    args = dict(args)
    replicas = args.pop("replicas", 1)
    return application(ServeConfig.build(**args), replicas)


def application(cfg: ServeConfig, replicas: int = 1) -> serve.Application:
    check_int("replicas", replicas, 1, 1024)
    ongoing = cfg.max_sessions + cfg.max_queue + 16  # past this, requests wait in Serve's own queue
    return EngramflowServer.options(num_replicas=replicas, max_ongoing_requests=ongoing,
                                    health_check_period_s=HEALTH_CHECK_PERIOD_S,
                                    **replica_bundles(cfg)).bind(cfg)


def replica_bundles(cfg: ServeConfig) -> dict:
    """With GPUs, each replica reserves its pipeline's: a bundle for itself, one GPU bundle per
    stage (packed), as Ray Serve LLM does for vLLM's workers; its stage actors are placed in
    them (pipeline placement uses the caller's GPU bundles). Without GPUs: no reservation."""
    import ray

    stages = cfg.pipeline.stages
    if cfg.in_process or not ray.is_initialized() or ray.cluster_resources().get("GPU", 0) < stages:
        return {}
    return {"placement_group_bundles": [{"CPU": 1}] + [{"GPU": 1}] * stages, "placement_group_strategy": "PACK"}
