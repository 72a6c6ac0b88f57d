"""A replica's pipeline is placed in the replica's placement-group bundles (checked in a Ray
that declares 2 GPUs: the pipeline could reserve no GPUs of its own beside the replica's)."""
import json
import os
import subprocess
import sys
from pathlib import Path

from serve_server import _free_port


def test_stage_actors_hold_the_replicas_gpu_bundles(tiny_ckpt):
    script = Path(__file__).parent / "serve_placement_check.py"
    out = subprocess.run([sys.executable, str(script), str(tiny_ckpt), str(_free_port())], capture_output=True,
                         text=True, timeout=400, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(next(line for line in out.stdout.splitlines() if line.startswith('{"bundles"')))
    assert report["bundles"] == [[{"CPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}]]  # one group: the replica's
    assert list(report["free_gpu_bundles"].values()) == [0.0, 0.0]  # each held by a stage actor
    assert report["tokens"] == 2
