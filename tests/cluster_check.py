"""Run as a script by test_cluster.py: one real multi-node Ray cluster (ray.cluster_utils, one
Ray of its own beside the test session's) for both placement checks, and a JSON report.

1. Two CPU nodes, the head offering `engram_host` (the table host): a 2-stage pipeline, where
   each actor landed and what it generated.
2. Then a node declaring 2 GPUs joins (on a CPU machine the stage actors still compute on the
   CPU): a 2-stage Serve replica reserves one bundle for itself and one GPU bundle per stage,
   and its stage actors hold those GPU bundles."""
import json
import sys
import urllib.request

import ray
from ray import serve
from ray.cluster_utils import Cluster

from engramflow.pipeline.pipeline import Pipeline
from engramflow.serve.deployment import build


def cpu_nodes(ckpt: str, cluster, worker) -> dict:
    pipe = Pipeline.launch(ckpt, stages=2)
    where = pipe.where()
    (g,) = pipe.generate(["The quick brown fox"], max_new_tokens=4)
    pipe.shutdown()
    return {"head": cluster.head_node.node_id, "worker": worker.node_id, "where": where, "tokens": g.tokens}


def gpu_replica(ckpt: str, port: int) -> dict:
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run(build({"checkpoint": ckpt, "stages": 2, "backbone": "reference"}), name="p", route_prefix="/")
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    free = ray.available_resources()
    held = {b: free.get(f"GPU_group_{b}_{g['placement_group_id']}", 0.0) for g in groups for b in g["bundles"]
            if "GPU" in g["bundles"][b]}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(
        {"prompt": [5, 6, 7], "max_tokens": 2}).encode(), {"Content-Type": "application/json"})
    reply = json.loads(urllib.request.urlopen(req, timeout=120).read())
    return {"bundles": sorted([list(g["bundles"].values()) for g in groups], key=len), "free_gpu_bundles": held,
            "groups_on": {len(g["bundles"]): sorted(set(g["bundles_to_node_id"].values())) for g in groups},
            "tokens": reply["usage"]["completion_tokens"]}


def main(ckpt: str, port: int) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"engram_host": 1},
                                                            "include_dashboard": False})
    worker = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        report = {"cpu_nodes": cpu_nodes(ckpt, cluster, worker)}
        cluster.add_node(num_cpus=1, num_gpus=2)
        cluster.wait_for_nodes()
        report["gpu_replica"] = gpu_replica(ckpt, port)
        print(json.dumps(report))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
