"""Which worker, and so which node, serves a key: to tell a run's cross-node hits from local ones.

Placement is rendezvous hashing over the live workers (`kvpool.core.cluster.rank`); with the member
list the client sees, the first owner of a key is the worker that answers its get.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..client import PoolClient
from ..cluster import rank

__all__ = ["Owners"]


class Owners:
    """The member list of a cluster client, refreshed on demand, and each key's serving node."""

    def __init__(self, client: PoolClient, node_id: str) -> None:
        self.client, self.node_id = client, node_id
        self.nodes: dict[str, str] = {}
        self.refresh()

    def refresh(self) -> None:
        self.nodes = {w: info.node_id for w, info in self.client.members().items()}

    def cross_node(self, keys: Sequence[str]) -> int:
        """How many of `keys` are served by a worker on another node than this client's."""
        ids = list(self.nodes)
        if not ids:
            return 0
        return sum(1 for k in keys if self.nodes[rank(k.encode(), ids)[0]] != self.node_id)
