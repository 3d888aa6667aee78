"""Hierarchical all-reduce: inside each node first, then across nodes, then back.

    node 0: r0 r1 r2 r3        node 1: r4 r5 r6 r7
      1. reduce to the node's first rank      (fast links: shared memory / NVLink)
      2. all-reduce among the nodes' first ranks    (the network: one rank per node)
      3. broadcast inside each node

Only one rank per node talks to the network, with the node's whole sum, so the
inter-node traffic is that of a job with one rank per node. Nodes come from
`MPI_Comm_split_type(COMM_TYPE_SHARED)` on the world communicator, or, for tests
and experiments on one machine, from MPI_TP_FAKE_NODES=k, which cuts the world
ranks into k consecutive blocks ("emulated nodes").
"""
from __future__ import annotations

import os

from mpi4py import MPI

from mpi_tp.core.errors import UserError
from mpi_tp.parallel.collectives import Group


def node_of_world_rank(world=MPI.COMM_WORLD) -> int:
    """An id of this rank's node: its block under MPI_TP_FAKE_NODES, else the node's lowest world rank."""
    fake = os.environ.get("MPI_TP_FAKE_NODES")
    if fake:
        k = int(fake)
        if k < 1:
            raise UserError(f"MPI_TP_FAKE_NODES={fake}: give a positive number of emulated nodes")
        return world.Get_rank() * k // world.Get_size()
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        return local.allreduce(world.Get_rank(), op=MPI.MIN)    # set-up only
    finally:
        local.Free()


class HierarchicalAllReduce:
    """All-reduce over `group` done node by node (see the module docstring)."""

    def __init__(self, group: Group, world=MPI.COMM_WORLD):
        self.group = group
        node = world.allgather(node_of_world_rank(world)) if group.size > 1 else None   # set-up only
        me = node[world.Get_rank()] if node else 0
        local = group.comm.Split(color=me, key=group.rank)
        self.local = Group(local, f"{group.name}_intra", group.stats)
        lead = group.comm.Split(color=0 if local.Get_rank() == 0 else MPI.UNDEFINED, key=group.rank)
        self.leaders = Group(lead, f"{group.name}_inter", group.stats) if lead != MPI.COMM_NULL else None
        self.nodes = group.comm.allreduce(1 if self.leaders is not None else 0)      # set-up only

    def all_reduce(self, x):
        """x = sum over the group, in place; returns x."""
        if self.group.size == 1:
            return x
        self.local.reduce_to_root(x)                 # 1. inside the node
        if self.leaders is not None:
            self.leaders.all_reduce(x)               # 2. across nodes, one rank each
        self.local.broadcast(x)                      # 3. back inside the node
        return x

    def free(self) -> None:
        self.local.comm.Free()
        if self.leaders is not None:
            self.leaders.comm.Free()
