"""One real local Ray instance for the whole test session (starting Ray costs seconds).

Use it with `from ray_fixture import ray_session  # noqa: F401` and a `ray_session` argument.
"""
import pytest


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield
    ray.shutdown()
