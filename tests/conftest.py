"""Shared fixtures: the released config, its layout and the real V4 token map (built once)."""
import os

import numpy as np
import pytest

from engramflow.io.layout import build_layout
from engramflow.io.token_map import TokenMap
from engramflow.io.presets import preset


@pytest.fixture(scope="session")
def v41_config():
    return preset("deepseek-v4.1-flash")


@pytest.fixture(scope="session")
def v41_layout(v41_config):
    return build_layout(v41_config)


@pytest.fixture(scope="session")
def v4_token_map():
    return TokenMap.default()


DEFAULT_SEED = 20240601


@pytest.fixture
def rng():
    """Random inputs from a fixed seed, so a failure reproduces; ENGRAMFLOW_TEST_SEED=<int>
    explores other inputs (ENGRAMFLOW_TEST_SEED=random draws one; it is printed either way)."""
    env = os.environ.get("ENGRAMFLOW_TEST_SEED", "")
    seed = np.random.SeedSequence().entropy if env == "random" else int(env) if env else DEFAULT_SEED
    print(f"rng seed: {seed} (ENGRAMFLOW_TEST_SEED={seed} reproduces it)")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The `tiny` synthetic checkpoint, written once per test session."""
    from engramflow.model.synth import make_checkpoint

    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0, progress=False)


@pytest.fixture(scope="session")
def ray_session():
    """One real local Ray instance for the whole test session (starting Ray costs seconds)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_session):
    """The shared instance's address: a command run with RAY_ADDRESS=<it> (join_env) or
    --address <it> joins it instead of starting a Ray of its own."""
    import ray

    return ray.get_runtime_context().gcs_address


@pytest.fixture(scope="session")
def join_env(ray_address):
    """The environment for a subprocess that should join the shared Ray instance."""
    return os.environ | {"OMP_NUM_THREADS": "1", "RAY_ADDRESS": ray_address}


@pytest.fixture(scope="session")
def serve_http(ray_session):
    """Ray Serve on the shared Ray instance, HTTP on a free loopback port: the base URL.
    Applications come and go on it (serve_server.ServeApp, one route prefix each)."""
    from ray import serve

    from serve_server import _free_port

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory):
    """Tiny-geometry Engram tables with random rows in one file (no backbone): the tier tests'."""
    from test_tiers_fixtures import small_checkpoint

    return small_checkpoint(tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="session")
def v41_small_preset(tmp_path_factory):
    """`make-checkpoint --preset v41-small`, written once per test session (~90 MB, 2 s)."""
    from engramflow.model.synth import make_checkpoint

    return make_checkpoint("v41-small", tmp_path_factory.mktemp("v41-small"), seed=0, progress=False)


@pytest.fixture(scope="session")
def v41_app(serve_http, v41_small_preset, tmp_path_factory):
    """`engramflow serve`'s application on v41-small (1 stage, its vision tower), on the shared
    Ray: one for every test file that needs no serve options of its own (images, structured)."""
    from serve_server import ServeApp

    server = ServeApp(serve_http, v41_small_preset, tmp_path_factory.mktemp("serve-v41"), "v41", stages=1,
                      backbone="v41", model="v41-small")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def serve_server(tiny_ckpt, tmp_path_factory):
    """One real `engramflow serve` process (2 pipeline stages, tiny checkpoint) per test session."""
    from serve_server import Server

    server = Server(tiny_ckpt, tmp_path_factory.mktemp("serve"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def served_v41(v41_small_preset):
    """(an in-process HTTP client of the API app over an Engine on v41-small, its Backend, a
    second Engine as the oracle): the chat path without Ray."""
    from fastapi.testclient import TestClient

    from engramflow.pipeline.engine import Engine
    from engramflow.serve.api import make_api
    from engramflow.serve.backend import Backend, ServeConfig

    cfg = ServeConfig.build(str(v41_small_preset), model="v41-small", in_process=True, prefill_chunk=32)
    backend = Backend(Engine(v41_small_preset, prefill_chunk=32), cfg)
    oracle = Engine(v41_small_preset, prefill_chunk=32)
    yield TestClient(make_api(lambda: backend)), backend, oracle
    backend.close()
    oracle.shutdown()
