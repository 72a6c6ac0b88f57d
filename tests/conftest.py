"""Shared fixtures: the released config, its layout and the real V4 token map (built once)."""
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from engramflow.io.layout import build_layout
from engramflow.io.token_map import TokenMap
from engramflow.io.presets import preset

# `make test` runs the suite in two pytest-xdist workers (`-n 2`), one per core of the 2-core
# machine it is sized for; each worker has its own session fixtures (its Ray instance, its
# checkpoints). Under a worker:
# * its Ray temp folder is its own (RAY_TMPDIR, inherited by every process it starts), so a
#   `ray.init()` that looks for a running cluster (a fresh `engramflow generate`) never finds the
#   other worker's, and a cluster one worker starts never shows up in the other's;
# * each test file runs whole on one worker (its module fixtures made once), and the files
#   sharing an expensive session fixture run on the same worker (XDIST_GROUPS below), heaviest
#   first (XDIST_WEIGHT_S) so neither worker is left with a long file at the end.
# torch keeps its default threads: official numerics are torch's own products, whose bits depend
# on the thread count (test_v41_golden.py's official numbers were produced with the default).
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:
    _ray_tmp = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / f"ef-{WORKER}"
    _ray_tmp.mkdir(parents=True, exist_ok=True)
    os.environ["RAY_TMPDIR"] = str(_ray_tmp)

# One torch thread per process (ENGRAMFLOW_THREADS, read where a run's config is made, so the
# in-process Engine, every actor and every CLI subprocess): two test workers, their actors and
# servers share 2 cores, and an op split over threads that the OS cannot all run waits for the
# ones it did not schedule (a 4x16 by 16x300 attention product took 7.8 ms at 2 threads on a busy
# core pair, 29 us at 1). Batched numerics are thread-count invariant, so nothing a test compares
# changes. Official numerics are torch's own products, whose bits depend on the thread count and
# were produced at torch's default: a module marked `default_threads` (the golden comparisons)
# runs at the default, its actors and subprocesses too.
DEFAULT_TORCH_THREADS = torch.get_num_threads()
os.environ.setdefault("ENGRAMFLOW_THREADS", "1")
SUITE_THREADS = os.environ["ENGRAMFLOW_THREADS"]

# Ray's and Serve's own polling, slowed for the suite (inherited by every Ray the tests start):
# the suite is CPU-bound, and a sampled run spent ~100 CPU-s in log monitors rescanning each
# Ray's logs folder 10 times a second (hundreds of worker logs by the end) and ~65 in Serve
# controllers reconciling 10 times a second. Nothing a test checks waits on either: the tests'
# Rays do not send worker logs to drivers, and a Serve change now takes effect within 0.5 s.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "5")
os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
# Nor does any test need the workers Ray starts ahead when a driver connects (one per CPU): a
# pipeline makes more actors than there are CPUs, and a worker that never gets work idles at ~1 %
# of a core for its Ray's life (~50 such worker processes in a sampled run, ~1 CPU-s each to start).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")


@pytest.fixture(scope="module", autouse=True)
def _torch_threads(request):
    """Autouse and module-scoped, so it runs before the module's own fixtures build engines."""
    if request.node.get_closest_marker("default_threads"):
        os.environ.pop("ENGRAMFLOW_THREADS", None)
        torch.set_num_threads(DEFAULT_TORCH_THREADS)
        yield
        os.environ["ENGRAMFLOW_THREADS"] = SUITE_THREADS
    else:
        torch.set_num_threads(int(SUITE_THREADS))
        yield


_EARLY_STOP = {}  # session fixture -> how to stop it after its last test (pytest_runtest_teardown)

# files that share a session fixture costing tens of seconds: one worker starts it
XDIST_GROUPS = {
    # the session's server process (test_readme.py's client block asks for it by getfixturevalue)
    "test_serve.py": "serve_server", "test_serve_hostile.py": "serve_server", "test_readme.py": "serve_server",
    # Ray Serve on the worker's Ray (serve_http; the v41-small app, v41_app, for the first two)
    "test_serve_images_live.py": "serve_http", "test_serve_structured.py": "serve_http",
    "test_serve_prefix_cache.py": "serve_http", "test_serve_speculative.py": "serve_http",
    "test_serve_tool_calls_live.py": "serve_http",
    "test_serve_host_wide.py": "wide_server", "test_serve_recovery.py": "wide_server",  # a second server process
    # the tiny checkpoint's 1-3 stage pipelines (tiny_pipelines)
    "test_pipeline.py": "tiny_pipelines", "test_in_flight.py": "tiny_pipelines", "test_reliability.py": "tiny_pipelines",
}
XDIST_WEIGHT_S = {  # every file of 3 s or more (two two-worker runs' mean, in s): heaviest first, so that
    # the last units are short and both workers end together (unlisted files run last, in collection order)
    "test_serve_prefix_cache.py": 95, "test_readme.py": 90, "test_cli_quiet.py": 75, "test_serve_structured.py": 65,
    "test_cluster.py": 60, "test_speculative_pipeline.py": 50, "test_hardening_recovery.py": 45,
    "test_serve_host_wide.py": 40, "test_speculative.py": 40, "test_prefill_job.py": 40, "test_v41_sessions.py": 35,
    "test_v41_vision_pipeline.py": 35, "test_batched_forward.py": 35, "test_serve_images_live.py": 35,
    "test_in_flight.py": 30, "test_serve_keeper.py": 30, "test_hardening_jobs.py": 30, "test_v41_inspect.py": 30,
    "test_serve_recovery.py": 30, "test_serve_hostile.py": 30, "test_hardening_checkpoints.py": 25,
    "test_serve_speculative.py": 25, "test_actor_pool.py": 25, "test_reliability.py": 25, "test_serve.py": 25,
    "test_v41_golden.py": 25, "test_projection_placement_pipeline.py": 25, "test_cluster_yaml.py": 25,
    "test_serve_tool_calls_live.py": 25, "test_v41_small_preset.py": 20, "test_hardening_cli.py": 20,
    "test_profiling.py": 20, "test_access_stats.py": 20, "test_hardening_server.py": 15,
    "test_serve_speculative_scheduler.py": 15, "test_block_scaled.py": 15, "test_native_build.py": 10,
    "test_v41_vision_inputs.py": 10, "test_serve_prompt_tokens.py": 10, "test_pipeline.py": 5,
    "test_pipeline_infra.py": 5, "test_table_server.py": 5, "test_profile_speculative.py": 5,
    "test_v41_vision_units.py": 5, "test_v41_dspark.py": 5, "test_plots.py": 5, "test_projection.py": 5,
    "test_prefill_share_prefix.py": 5, "test_cli_addressing.py": 5, "test_v41_batch_invariance.py": 5,
    "test_tiers.py": 5, "test_structured.py": 5, "test_run_config.py": 5, "test_v41_vision_golden.py": 5,
    "test_serve_scheduler.py": 5, "test_structured_speculative.py": 5, "test_serve_budgets.py": 5,
}


def _group(path: str) -> str:
    name = path.split("::", 1)[0].rsplit("/", 1)[-1]
    return XDIST_GROUPS.get(name, name)


@pytest.hookimpl(optionalhook=True)  # plain `pytest -p no:xdist` runs too
def pytest_xdist_make_scheduler(config, log):
    """A work unit per file, or per group of files sharing a session fixture (XDIST_GROUPS), in
    the workers' collection order (heaviest first, pytest_collection_modifyitems below). Not
    `--dist loadgroup`: with pytest 9.2 its marks no longer change a test's id."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    config.option.loadscopereorder = False
    return FileGroups(config, log)


def pytest_collection_modifyitems(config, items):
    if WORKER:  # heaviest work units first; a file's tests keep their order (a stable sort)
        weight = {g: sum(w for f, w in XDIST_WEIGHT_S.items() if _group(f) == g) for g in map(_group, XDIST_WEIGHT_S)}
        items.sort(key=lambda item: -weight.get(_group(item.nodeid), 0.0))


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


KEPT_ACTORS = 12  # tiny_pipelines' 1-, 2- and 3-stage pipelines: their stages, history and projection actors


@pytest.fixture(scope="session")
def ray_session():
    """One real local Ray instance for the whole test session (starting Ray costs seconds).
    A shut-down pipeline's stage and history actors are kept for the next launch in this
    worker (pipeline/actor_pool.py): up to KEPT_ACTORS, parked (~0.2 % of a core each, their
    state dropped; the pool's gate ~1 %), against 2-4 CPU-s to start each anew."""
    import ray

    from engramflow.pipeline import actor_pool

    ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    actor_pool.keep_idle(KEPT_ACTORS)
    yield
    actor_pool.keep_idle(0)
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_pipelines(ray_session, tiny_ckpt):
    """stages -> a pipeline on the tiny checkpoint with the default options, launched when first
    asked for and shared by the files that use it (XDIST_GROUPS puts them on one worker): a
    launch starts 3-5 actor processes, each paying seconds to import torch. Every test leaves
    it as it found it, no session open; a kill test's recovery leaves it whole."""
    from engramflow.pipeline.pipeline import Pipeline

    made = {}

    def get(stages: int):
        if stages not in made:
            made[stages] = Pipeline.launch(tiny_ckpt, stages=stages)
        assert made[stages].sessions == [], "a test before this one left sessions open"
        return made[stages]

    def stop():
        for pipe in made.values():
            pipe.shutdown()
        made.clear()

    _EARLY_STOP["tiny_pipelines"] = stop
    yield get
    stop()


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
    """Ray Serve on the shared Ray instance, HTTP on a free loopback port (serve_server.free_port): the base URL.
    Applications come and go on it (serve_server.ServeApp, one route prefix each)."""
    from ray import serve

    from serve_server import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
    _EARLY_STOP["serve_http"] = serve.shutdown
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
    _EARLY_STOP["v41_app"] = server.stop
    yield server
    server.stop()


@pytest.fixture(scope="session")
def serve_server(tiny_ckpt, tmp_path_factory):
    """One real `engramflow serve` process (2 pipeline stages, tiny checkpoint) per test session."""
    from serve_server import Server

    server = Server(tiny_ckpt, tmp_path_factory.mktemp("serve"))
    _EARLY_STOP["serve_server"] = server.stop
    yield server
    server.stop()


@pytest.fixture(scope="session")
def wide_server(v41_small_preset, tmp_path_factory):
    """A second `engramflow serve` process (v41-small, 1 stage) for the options the session's
    server keeps at their defaults: `--host 0.0.0.0 --allow-remote-images` (test_serve_host_wide.py)
    and `--max-restarts 0` (test_serve_recovery.py, which spends its replica, so it runs after).
    Stopped after the last test that uses it (pytest_runtest_teardown), not at the session's end."""
    from serve_server import Server

    server = Server(v41_small_preset, tmp_path_factory.mktemp("serve-wide"), stages=1, backbone="v41",
                    model="v41-small", extra=("--host", "0.0.0.0", "--allow-remote-images", "--max-restarts", "0"))
    _EARLY_STOP["wide_server"] = server.stop
    yield server
    server.stop()


@pytest.hookimpl(trylast=True)  # after the finished module's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    """Session fixtures that hold a server or the session Ray's CPUs stop after the last test
    that uses them, not at the session's end: an idle server and its Ray would share the cores
    with every later test, and a Serve app's pipeline would hold CPUs a later Ray Data job
    (prefill-job, access-stats) waits for. Under `make test` a worker runs its files heaviest
    first, so later files can be any."""
    for name in ("tiny_pipelines", "wide_server", "serve_server", "v41_app", "serve_http"):  # an app before its Serve
        if name in _EARLY_STOP and _uses(item, name):
            if item is [i for i in item.session.items if _uses(i, name)][-1]:
                _EARLY_STOP.pop(name)()


def _uses(item, fixture: str) -> bool:
    """The session server is asked for by name inside a test (getfixturevalue), so every test of
    its group counts as a user; the other fixtures are declared."""
    return _group(item.nodeid) == "serve_server" if fixture == "serve_server" else fixture in item.fixturenames


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
