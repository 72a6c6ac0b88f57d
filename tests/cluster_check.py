"""Run as a script: a two-node Ray cluster (the table host offers `engram_host`), a 2-stage
pipeline on it, and a JSON report of where each actor landed and what it generated."""
import json
import sys

import ray
from ray.cluster_utils import Cluster

from engramflow.pipeline.pipeline import Pipeline


def main(ckpt: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"engram_host": 1},
                                                            "include_dashboard": False})
    worker = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        pipe = Pipeline.launch(ckpt, stages=2)
        where = pipe.where()
        (g,) = pipe.generate(["The quick brown fox"], max_new_tokens=4)
        pipe.shutdown()
        print(json.dumps({"head": cluster.head_node.node_id, "worker": worker.node_id, "where": where,
                          "tokens": g.tokens}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
