"""Keep a Serve replica's own listening port on loopback when its Ray node is.

Ray Serve's replica opens an inter-deployment gRPC server on `[::]:0` whatever the node's
address (ray/serve/_private/replica.py, Ray 2.60). On a local instance that engramflow bound to
127.0.0.1 that one port would still answer on every interface; the replica calls this from its
constructor, which runs before Serve opens that server. Clients reach it at the node address,
so loopback is where they look. A node with a routable address (a cluster) is left alone.
"""
from __future__ import annotations

LOOPBACK = "127.0.0.1"


def keep_replica_grpc_on_loopback() -> bool:
    """True when the replica's gRPC server will bind loopback."""
    import ray

    try:
        from ray.serve._private import replica
    except ImportError:  # a Ray without that module: nothing to adjust
        return False
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None or ray.util.get_node_ip_address() != LOOPBACK:
        return False

    def on_loopback(server, address: str):
        return original(server, f"{LOOPBACK}:0" if address == "[::]:0" else address)

    replica.add_port_to_grpc_server = on_loopback
    return True
