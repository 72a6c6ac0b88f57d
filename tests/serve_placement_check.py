"""Run as a script by test_serve_placement.py, in a Ray of its own that declares 2 GPUs (on a
CPU machine the stage actors still compute on the CPU): a 2-stage replica reserves one bundle
for itself and one GPU bundle per stage, and its stage actors hold those GPU bundles."""
import json
import sys
import urllib.request

import ray
from ray import serve

from engramflow.serve.deployment import build


def main(ckpt: str, port: int) -> None:
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build({"checkpoint": ckpt, "stages": 2, "backbone": "reference"}), name="p", route_prefix="/")
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        free = ray.available_resources()
        held = {b: free.get(f"GPU_group_{b}_{g['placement_group_id']}", 0.0) for g in groups for b in g["bundles"]
                if "GPU" in g["bundles"][b]}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(
            {"prompt": [5, 6, 7], "max_tokens": 2}).encode(), {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=120).read())
        print(json.dumps({"bundles": [list(g["bundles"].values()) for g in groups], "free_gpu_bundles": held,
                          "tokens": reply["usage"]["completion_tokens"]}))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
