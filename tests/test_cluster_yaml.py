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


def test_setup_installs_this_repository_and_the_warmup_runs_real_code():
    c = load()
    mount = next(remote for remote, local in c["file_mounts"].items() if local == ".")
    assert any(mount in cmd and cmd.startswith("pip install") for cmd in c["setup_commands"])
    (warm,) = c["head_setup_commands"]
    code = shlex.split(warm)[2]
    compile(code, "warmup", "exec")
    from engramflow.memory.tables import EngramTables
    assert callable(EngramTables.warmup) and "EngramTables(" in code and ".warmup()" in code
