"""Placement on a real two-node Ray cluster (ray.cluster_utils.Cluster, in a subprocess so the
session's shared Ray instance is untouched)."""
import json
import subprocess
import sys
from pathlib import Path

from engramflow.pipeline.engine import Engine


def test_projections_on_the_table_host_and_stages_elsewhere(tiny_ckpt):
    script = Path(__file__).with_name("cluster_check.py")
    done = subprocess.run([sys.executable, str(script), str(tiny_ckpt)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    assert doc["head"] != doc["worker"]
    assert [p["node_id"] for p in doc["where"]["projections"]] == [doc["head"]]
    assert [s["node_id"] for s in doc["where"]["stages"]] == [doc["worker"]] * 2
    (ref,) = Engine(tiny_ckpt).generate(["The quick brown fox"], max_new_tokens=4)
    assert doc["tokens"] == ref.tokens
