"""`engramflow doctor`: which native kernels, threads, CPU topology and Ray resources are in use.

Prints one JSON report. Fast (no Ray) unless --address is given; then it connects to that
existing cluster (never starts one) and adds its resources.
"""
from __future__ import annotations

import json
import os
import sys


def _topology() -> dict:
    from engramflow.actors import topology

    try:
        pkgs = topology.packages()
    except Exception as e:  # unreadable sysfs: report it, the rest of the report still helps
        return {"error": str(e)}
    return {
        "allowed_cpus": len(topology.allowed_cpus()),
        "numa_nodes": [{"node": p.node, "packages": list(p.package_ids), "cpus": len(p.cpus),
                        "cores": len(p.cores), "selected_cores": list(p.selected)} for p in pkgs],
    }


def _torch() -> dict:
    import torch

    from engramflow.kernels.projection import cpu_has_native_bf16

    return {
        "version": torch.__version__,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "cuda": torch.cuda.is_available(),
        "native_bf16": cpu_has_native_bf16(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }


def _ray(address: str | None) -> dict:
    if not address:
        return {"connected": False, "note": "pass --address auto (or host:port) to query a running cluster"}
    try:
        import ray

        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        try:
            return {"connected": True, "address": address, "nodes": sum(1 for n in ray.nodes() if n.get("Alive")),
                    "cluster_resources": ray.cluster_resources(), "available_resources": ray.available_resources()}
        finally:
            ray.shutdown()
    except Exception as e:  # no cluster there: a finding, not a crash
        return {"connected": False, "address": address, "error": f"{type(e).__name__}: {e}".splitlines()[0]}


def report(address: str | None = None) -> dict:
    import warnings

    from engramflow.kernels import native

    with warnings.catch_warnings():  # the fallback warning repeats what the report says
        warnings.simplefilter("ignore")
        kernels = native.info()
    return {
        "python": sys.version.split()[0],
        "native_kernels": kernels,
        "torch": _torch(),
        "topology": _topology(),
        "ray": _ray(address),
    }


def cmd_doctor(args) -> int:
    print(json.dumps(report(args.address), indent=2, default=str))
    return 0


def register(sub) -> None:
    p = sub.add_parser("doctor", help="print which native kernels, threads, CPU topology and Ray resources are in use")
    p.add_argument("--address", help="also query the Ray cluster at this address ('auto' = the local one); "
                                     "never starts one")
    p.set_defaults(func=cmd_doctor)
