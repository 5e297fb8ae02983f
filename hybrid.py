"""
hybrid.py: hybrid sharding, zero.py's stages 1-3 sharded over groups of G ranks and replicated
across the N/G groups (wrap(shard_size=G), --shard-size G), as FSDP2 with a 2-D device mesh
(HSDP) and DeepSpeed's hpZ and MiCS do.

Beyond one node, stage 3's all-gathers and reduce-scatter would cross the slow links between
nodes twice per step and more; with G = the GPUs of a node they stay inside it, and all that
crosses is an all-reduce of each rank's [S] gradient sum with the ranks holding the same shard
in the other groups. The price: what is sharded costs 1/G of it per rank, not 1/N.

  N = 4, G = 2:  shard groups   {0, 1} {2, 3}   consecutive ranks, as a node's GPUs are
                 replica groups {0, 2} {1, 3}   the ranks that hold the same shard

A step: reduce-scatter within the shard group, all-reduce of the shard across the replica
group, the optimizer on the shard, all-gather within the shard group.

What it uses of zero.py: the stage classes, their _reduce, self.group (the group every
collective of Part I runs over: here this rank's shard group) and the Meter. zero.configure()
calls make_hybrid() when shard_size G < N, which makes the object's class a subclass of its
stage and Hybrid, whose one override, _reduce, adds the all-reduce across groups.
"""
import weakref

import torch.distributed as dist

from zero import _Pending


class Hybrid:
    """A stage with hybrid sharding: Part I's N is G, the ranks of a shard group."""

    def _reduce(self, unit, g):
        # After the reduce-scatter within the shard group, when its work is waited for, the
        # all-reduce of this rank's [S] sum across its replica group: the sum over all N ranks,
        # of which each of the R = N/G ranks holding this shard keeps 1/R, so step() divides by
        # G. Why not the sum itself: at stage 1 it stays in the gradient buffer, which a later
        # backward (accumulating without no_sync) reduces again, and the R replicas would then
        # add it up R times; their R parts add up to it once.
        work, mine = super()._reduce(unit, g)
        R = self.world // self.N
        self.meter.sent("all_reduce across groups", mine, unit, ranks=R)

        def finish():
            dist.all_reduce(mine, group=self.replica_group)
            mine.div_(R)
        # Never landed early, only where Part I waits: landing starts a blocking all-reduce
        # across groups, and every rank must start those at the same point of its program, or
        # two groups wait on each other for ever.
        # (buffers: gloo's all-to-all receive buffer, which the Meter counts while in flight)
        return _Pending([work], finish, getattr(work, "buffers", ()), early=False), mine


def make_hybrid(zero):
    """configure(), with shard_size G < N: this rank's shard group and replica group, and the
    stage's class with Hybrid's override."""
    zero.group, zero.replica_group = hybrid_groups(zero.world, zero.N)
    # (configure() runs once, in __init__: the object's class is its stage's, never Hybrid yet)
    zero.__class__ = _HYBRID.setdefault(type(zero), type(
        f"Hybrid{type(zero).__name__}", (Hybrid, type(zero)), {}))


_HYBRID = {}  # a stage's class -> its hybrid class
# The default group -> {G: (this rank's shard group, its replica group)}, held weakly: a group
# destroyed and let go must not live on here (and its gloo threads into the interpreter's exit)
_GROUPS = weakref.WeakKeyDictionary()


def hybrid_groups(N, G):
    """(this rank's shard group, its replica group). Every rank makes every group, in the same
    order (new_group is a collective), once per default group: a process that destroys its
    group and makes a new one (a test pool, the CUDA runs) makes them again."""
    made = _GROUPS.setdefault(dist.distributed_c10d._get_default_group(), {})
    if G not in made:  # torch's: every group made, this rank's returned (and the list of all)
        made[G] = (dist.new_subgroups(G)[0],  # consecutive ranks
                   dist.new_subgroups_by_enumeration([list(range(i, N, G)) for i in range(G)])[0])
    return made[G]
