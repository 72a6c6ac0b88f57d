"""cluster.yaml passes Ray's own launcher validation, and its steps do what their comments say."""
import re
import shlex
from pathlib import Path

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parent.parent


def load() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_ray_accepts_it():
    config = prepare_config(load())  # what `ray up` does before validating
    validate_config(config)


def test_roles_and_resources():
    c = load()
    types = c["available_node_types"]
    head = types[c["head_node_type"]]
    assert head["resources"]["engram_host"] == 1  # where Pipeline.launch puts the projection actors
    assert all(isinstance(cmd, str) for key in c if key.endswith("commands") for cmd in c[key])
    gpu = [t for name, t in types.items() if name != c["head_node_type"]]
    assert gpu and all(t["node_config"]["ImageId"] == "latest_dlami" for t in gpu)  # NVIDIA driver on the host
    assert c["docker"]["worker_image"].endswith("-gpu")
    ray_version = re.search(r"rayproject/ray:([\d.]+)", c["docker"]["worker_image"]).group(1)
    import ray
    assert ray_version == ray.__version__ or ray.__version__.startswith(".".join(ray_version.split(".")[:2]))


def test_setup_installs_this_repository():
    c = load()
    mount = next(remote for remote, local in c["file_mounts"].items() if local == ".")
    assert any(mount in cmd and cmd.startswith("pip install") for cmd in c["setup_commands"])


# --- every engramflow command and Python snippet of the file, run for real -----------------
# On a small local checkpoint in place of /data/ckpt, against the test session's Ray instead of
# the cluster's (`--address auto` resolves RAY_ADDRESS, as on a node of the cluster), 2 stages
# instead of 8 (a 2-core test machine); lines that need the network or a cloud account (pip install from the mount, the checkpoint download,
# `ray start`) are checked for their shape above and not run.
import os
import re
import subprocess
import sys

import pytest

LOCAL = [("/data/ckpt", "{ckpt}"), ("--stages 8", "--stages 2")]


def commands() -> list[str]:
    """Every command of the file: the launcher's command lists and the ones its comments give."""
    c = load()
    listed = [cmd for key in c if key.endswith("commands") for cmd in c[key]]
    commented = re.findall(r"^#\s+(engramflow .+)$", (ROOT / "cluster.yaml").read_text(), flags=re.M)
    return listed + commented


def runnable() -> list[str]:
    return [cmd for cmd in commands() if cmd.startswith(("engramflow ", "python -c"))]


def test_the_runnable_commands_are_the_ones_that_matter():
    cmds = runnable()
    assert any(c.startswith("python -c") and "warmup()" in c for c in cmds)
    assert any(c.startswith("engramflow inspect") for c in cmds)
    assert any(c.startswith("engramflow generate") for c in cmds)
    rest = [c for c in commands() if c not in cmds]
    assert all(c.split()[0] in ("pip", "test", "sudo", "ray") for c in rest), rest  # shapes checked above


@pytest.mark.slow  # generate starts Ray
@pytest.mark.parametrize("cmd", runnable(), ids=lambda c: c.split(" --")[0][:40])
def test_command_runs_against_the_installed_package(cmd, tiny_ckpt, join_env):
    local = cmd
    for old, new in LOCAL:
        local = local.replace(old, new.format(ckpt=tiny_ckpt))
    argv = shlex.split(local)
    exe = {"python": sys.executable, "engramflow": str(Path(sys.executable).with_name("engramflow"))}[argv[0]]
    done = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=600,
                          env=join_env)  # RAY_ADDRESS: the session's Ray
    assert done.returncode == 0, f"{local}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
