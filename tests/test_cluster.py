"""Placement on a real multi-node Ray cluster (ray.cluster_utils.Cluster, in a subprocess so the
session's shared Ray instance is untouched; cluster_check.py runs both checks on one cluster):
the table host's projections and the other node's stages, then a Serve replica's pipeline in
the replica's placement-group bundles (a node declaring 2 GPUs: the pipeline could reserve no
GPUs of its own beside the replica's; it reserves its projection actor's CPU on the table host)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engramflow.pipeline.engine import Engine
from serve_server import free_port


@pytest.fixture(scope="module")
def report(tiny_ckpt):
    script = Path(__file__).with_name("cluster_check.py")
    done = subprocess.run([sys.executable, str(script), str(tiny_ckpt), str(free_port())], capture_output=True,
                          text=True, timeout=500, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    # the report's line (Ray may print its own lines to stdout while shutting down, after it)
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"cpu_nodes"')))


def test_projections_on_the_table_host_and_stages_elsewhere(report, tiny_ckpt):
    doc = report["cpu_nodes"]
    assert doc["head"] != doc["worker"]
    assert [p["node_id"] for p in doc["where"]["projections"]] == [doc["head"]]
    assert [s["node_id"] for s in doc["where"]["stages"]] == [doc["worker"]] * 2
    (ref,) = Engine(tiny_ckpt).generate(["The quick brown fox"], max_new_tokens=4)
    assert doc["tokens"] == ref.tokens


def test_stage_actors_hold_the_replicas_gpu_bundles(report):
    doc = report["gpu_replica"]
    # the projection actor's CPU and table host share (the pipeline's), the replica's own group
    assert doc["bundles"] == [[{"CPU": 1.0, "engram_host": 1.0}], [{"CPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}]]
    assert doc["groups_on"]["1"] == [report["cpu_nodes"]["head"]]
    assert list(doc["free_gpu_bundles"].values()) == [0.0, 0.0]  # each held by a stage actor
    assert doc["tokens"] == 2
