"""`serve --prefix-cache-mb`: a negative, non-numeric or absurd budget is refused before Ray
starts, in one line naming the value (the CLI's main() in process: any path to Ray fails the
test); the default budget is sized from what a cached token costs the stages."""
import pytest

from cli_run import engramflow_here as engramflow, one_line_error
from engramflow.errors import EngramflowError
from engramflow.serve.prefix_budget import MAX_MB, check_prefix_cache_mb, prefix_cache_bytes


@pytest.mark.parametrize("value", ["-1", "nan", "inf", str(MAX_MB * 2)])
def test_a_bad_budget_is_refused_before_ray(tiny_ckpt, value):
    line = one_line_error(engramflow("serve", "--checkpoint", tiny_ckpt, "--prefix-cache-mb", value))
    assert "--prefix-cache-mb" in line and value in line


def test_checks():
    assert check_prefix_cache_mb(None) is None and check_prefix_cache_mb(0) == 0.0 and check_prefix_cache_mb(1.5) == 1.5
    for bad in (-0.5, True, "3", float("nan")):
        with pytest.raises(EngramflowError, match="--prefix-cache-mb"):
            check_prefix_cache_mb(bad)


def test_budget_in_bytes_and_the_default():
    assert prefix_cache_bytes(2.0, [100], 4096) == 2 << 20
    # default: 8 full contexts, unless that passes 1 GiB on the costliest stage
    assert prefix_cache_bytes(None, [100, 50], 4096) == 8 * 4096 * (150 + 16)
    per_stage = 1 << 20  # 1 MiB a position: 1024 positions fit the cap
    assert prefix_cache_bytes(None, [per_stage], 1 << 20) == 1024 * (per_stage + 16)
