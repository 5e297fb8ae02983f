"""
zero.py: data parallelism and ZeRO stages 1, 2 and 3, written from scratch with the raw
torch.distributed collectives, in one file you can read top to bottom.

    torchrun --nproc_per_node=4 zero.py --stage 2     # 4 ranks: gloo on CPU, or NCCL, a GPU each
    python zero.py --stage 3                          # one rank, the same code path
    python zero.py --estimate --params 7.5e9 --world-size 64   # the paper's Figure 1, no training

The problem. Plain data parallelism keeps a full copy of the *model state* on every rank: the
parameters, their gradients and the optimizer's state (Adam's m and v, and in mixed precision an
fp32 master copy of the weights): 16Ψ bytes per rank for Ψ parameters, in the paper's
mixed-precision Adam accounting and in fp32 Adam (4 + 4 + 8) alike. A 7.5B model needs 120 GB
on every rank before a single activation is stored, however many ranks there are.

The idea (ZeRO, Rajbhandari et al., SC'20, arXiv:1910.02054). The N ranks hold N identical
copies: keep 1/N each instead, and communicate to fill in what a rank needs when it needs it.
Shard the optimizer state (stage 1), then the gradients too (stage 2), then the parameters too
(stage 3). Per-rank model state, bytes (paper, mixed precision, K = 12 optimizer bytes/param):

    stage                  params  grads   optimizer  total per rank   Ψ = 7.5e9, N = 64
    0 data parallel        2Ψ      2Ψ      12Ψ        16Ψ                  120 GB
    1 ZeRO-1 (P_os)        2Ψ      2Ψ      12Ψ/N      4Ψ + 12Ψ/N          31.4 GB
    2 ZeRO-2 (P_os+g)      2Ψ      2Ψ/N    12Ψ/N      2Ψ + 14Ψ/N          16.6 GB
    3 ZeRO-3 (P_os+g+p)    2Ψ/N    2Ψ/N    12Ψ/N      16Ψ/N                1.9 GB

What it costs, per rank per optimizer step of one micro-batch, in elements a ring sends:

    stage 0   all_reduce(grads)                                      2Ψ (N-1)/N
    stage 1   reduce_scatter(grads) + all_gather(updated params)     2Ψ (N-1)/N  same as 0
    stage 2   the same, a unit's full gradient freed once reduced    2Ψ (N-1)/N  same as 0
    stage 3   all_gather in forward + in backward + reduce_scatter   3Ψ (N-1)/N  1.5x

Stages 1 and 2 are free in bytes: an all-reduce *is* a reduce-scatter followed by an all-gather,
and ZeRO puts the optimizer step in between. Stage 3 pays 50% more, and latency: every unit
waits for its all-gather before it computes.

How to read this file. Part I is the algorithm, complete: the sharded layout (a Unit), the two
collectives, one class per stage (a subclass of the one before, overriding what it changes) and
wrap(). Stop after ZeRO1 (and _grad_hook, wrap) to know ZeRO-1; at wrap(), all four. Part II is
what every run uses, each piece a section that Part I calls by name. Files of their own hold
the rest: checkpoints.py, memory.py (limits, the memory wall, one step drawn), tradeoffs.py (which
stage when, in time), hybrid.py, meta_init.py (models built on the meta device), mistakes.py (the
classic mistakes), fsdp_demo.py (the same with PyTorch's DDP and FSDP2). One interface for all:

    optimizer = zero.wrap(model, stage=2, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    with optimizer.no_sync():           # optional: micro-batches that only accumulate (as DDP)
        loss_fn(model(x1), y1).backward()
    loss_fn(model(x2), y2).backward()   # gradients accumulate; this one reduces
    optimizer.clip_grad_norm_(1.0)      # optional, global norm over all shards
    optimizer.step(); optimizer.zero_grad()
    with optimizer.gathered():          # optional: full parameters for a moment (evaluation...)
        print(model.head.weight.norm())
    checkpoints.save_checkpoint(optimizer, "ckpt", step)  # loads at any stage and world size

Left out, on purpose: activation memory (ZeRO-R) and CPU offload (ZeRO-Offload/Infinity).
Activations are not model state, and no stage here shards them.
"""
import argparse, contextlib, dataclasses, functools, hashlib, inspect, os
import sys, time, types, warnings, weakref
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

if __name__ in ("__main__", "__mp_main__"):  # run as a script: the files that `import zero`
    sys.modules.setdefault("zero", sys.modules[__name__])  # (checkpoints.py...) get this module

# ===================================== PART I: THE ALGORITHM ==================================
# N ranks (torchrun starts them, wrap() joins them into one process group: setup), Ψ trainable
# parameters. Every rank runs the same code on its equal share of the rows of the global batch:
# the loss a mean over rows, the mean of the N ranks' gradients is the global batch's gradient.

# ----------------------------------------------------------------------------------------------
# The sharded layout. A Unit is a group of parameters communicated as one tensor, like FSDP's
# FlatParameter: its parameters back to back in one flat buffer, padded with zeros to N*S
# elements so that it splits into N equal, contiguous shards of S. Rank r owns shard r.
#
#   flat  [N*S]: | p0 ..........| p1 ......| p2 ...........| 0 0 |   p.data is a view into it
#                |<-shard 0->|<-shard 1->|<-shard 2->|<-shard 3->|   (N = 4, S elements each)
#
# Why one flat buffer, not whole parameters handed round-robin to owners: every rank gets the
# same number of elements (to within the padding), and each collective is a single call.
# Why several units, not one buffer for the whole model: a unit is what stage 2 reduce-scatters
# as soon as backward is done with it, and what stage 3 gathers just before it computes. The
# root unit holds what no other unit holds (units=[]: everything). Default: one unit per block
# (default_units); stages 0-2 may merge or cut them into buckets (bucket_bytes: Part II, speed 2).

class Unit:
    def __init__(self, modules, params, rank, N, S=None):
        self.modules, self.params = modules, params  # modules []: the root unit, or a bucket
        numel = sum(p.numel() for p in params)
        self.S = S or -(-numel // N) or 1  # numel / N, rounded up (make_units may ask more)
        self.flat = torch.zeros(N * self.S, dtype=params[0].dtype, device=params[0].device)
        self.offset, o = {}, 0
        for p in params:
            self.flat[o:o + p.numel()].copy_(p.detach().flatten())
            p.data = self.flat[o:o + p.numel()].view_as(p)  # the module computes with the view
            self.offset[p], o = o, o + p.numel()
        self.my_slice = slice(rank * self.S, (rank + 1) * self.S)  # shard r, of rank r
        self.shard = self.flat[self.my_slice]  # [S] this rank's part (stage 0's _shard: all)
        # Set by each stage's _shard (stage 0: all of flat, a full gradient), master by __init__:
        self.stepped = self.my_slice  # the elements this rank's optimizer steps
        self.master = self.shard      # those elements as the optimizer steps them (or an fp32 copy)
        self.grad = None              # [N*S] the gradient buffer (stages 2, 3: in backward only)
        self.grad_shard = None        # the gradient of the elements stepped: the sum over ranks / N
        self.step_grad = None         # ... in the master's dtype, during step() only
        # What backward has done with it so far:
        self.arrived = 0              # its parameters given a gradient in this backward
        self.received = set()         # ... since zero_grad() (step() steps what any rank got)
        self.unreduced = False        # it holds local gradients that no reduction has summed yet
        # p unused on this rank (stages 0, 1): count_unused adds it, and reduces its slice as zeros,
        # so the slice holds the other ranks' mean, which settle_unused then makes p.grad
        self.hidden = set()
        self.index = None             # its place in the model's list of units

    @property
    def gathered(self):  # stage 3 frees the flat buffer's storage while the unit is not used
        return self.flat.untyped_storage().nbytes() > 0

    def view(self, flat, p):  # p's elements in a flat tensor of this unit, in p's shape
        return flat[self.offset[p]:self.offset[p] + p.numel()].view_as(p)


# ----------------------------------------------------------------------------------------------
# The two collectives ZeRO is made of. An all-reduce is one then the other: reduce-scatter
# (rank r receives the sum over ranks of slice r) then all-gather (every rank receives every
# rank's slice). NCCL runs both as rings: each rank sends (N-1)/N of the buffer, no extra memory.
# (every torch's names since 2.6; torch 2.13 prefers *_single and warns: Part II silences it)

def reduce_scatter(out, x, async_op=False, group=None):
    """out [S] = the sum over ranks of x[rank*S:(rank+1)*S], x [N*S]. out may be that slice of x.
    Only out is defined afterwards: the rest of x may have changed. (group: its ranks only.)"""
    if GlooCPU.used_for(x):  # gloo's own is slow on CPU: the same bytes, and a buffer (speed 4)
        return GlooCPU.reduce_scatter(out, x, async_op, group)
    return dist.reduce_scatter_tensor(out, x, async_op=async_op, group=group)


def all_gather(out, shard, async_op=False, group=None):
    """out [N*S] = every rank's shard [S], in rank order. shard may be this rank's slice of out."""
    if GlooCPU.used_for(out):
        return GlooCPU.all_gather(out, shard, async_op, group)
    return dist.all_gather_into_tensor(out, shard, async_op=async_op, group=group)


# ----------------------------------------------------------------------------------------------
# Stage 0: data parallelism, the baseline every stage is measured against. A gradient's path, the
# same at every stage: backward -> _on_grad puts it into its unit's flat gradient -> _reduce_unit
# launches the unit's reduction (_reduce: the sum over ranks) -> it lands (_land) -> / N, the mean
# (stage 0: as it lands; stages 1-3: in _reduce_grads) -> step() hands each optimizer tensor its
# slice -> optimizer.step() -> _gather_params (stages 1 and 2; stage 3 gathers at the next forward).

class DataParallel:
    """Stage 0: every rank holds full parameters, gradients and optimizer state; gradients are
    averaged with all_reduce before the step. Memory 16Ψ per rank; communication 2Ψ (N-1)/N.
    DDP's job, done DDP's way: a unit's all-reduce is launched as soon as backward has produced
    its last gradient (overlap=True, the default), and the end of backward waits for it."""

    stage = 0
    keeps_full_grads = True  # the full [N*S] gradient buffer lives from step to step

    def __init__(self, model, optimizer, **options):
        self.model = model
        # wrap()'s options on self (self.overlap, self.mixed_precision...), the units (default:
        # one per block), the meter, the same on every rank (Part II); self.N, the ranks a unit
        # is cut over, and self.group, theirs (None: the default group of every rank; always so
        # at stage 0, which shards nothing: N is the world size).
        self.units = configure(self, model, options)
        self.in_flight = []  # reductions launched, not landed yet: (work, unit, where it lands)
        for unit in materialize(self):  # (a meta-device model: allocated unit by unit)
            dist.broadcast(unit.flat, src=0)  # rank 0's weights (seeds may differ)
            # Mixed precision: unit.flat becomes a param_dtype copy the model computes with;
            # fp32 is the flat buffer as built, which the fp32 master is cut from
            fp32 = cast(unit, self.param_dtype)
            self._shard(unit)
            unit.master = fp32[unit.stepped].clone() if self.mixed_precision else unit.shard
            for p in unit.params:  # runs once p.grad holds this backward's gradient for p
                p.register_post_accumulate_grad_hook(
                    functools.partial(_grad_hook, weakref.ref(self), unit.index))
        replicate_the_rest(self)  # frozen parameters, buffers: rank 0's, whole (bf16: inputs cast)
        # The optimizer steps this rank's masters cut into flat pieces, views of u.master (small
        # for the cache, speed 3): u.pieces; u.owners[i], the parameters piece i holds. Exact for
        # element-wise optimizers (SGD, Adam...: an element's update reads its own gradient and
        # state only), NOT for LAMB or Adafactor (whole tensors; torch's are refused) nor groups.
        # Mixed precision, stages 0-2: a step pre-hook copies writes to p (clamp_...) into masters.
        self.optimizer = optimizer_of_pieces(self, optimizer)  # (torch's known others refused)
        self._sync, self._end_queued, self._reduced, self.steps = True, False, False, 0
        self.meter.event("start")

    def _shard(self, unit):  # stage 0 shards nothing: this rank steps all, keeps the gradient
        unit.stepped = slice(0, unit.flat.numel())
        unit.shard = unit.flat
        unit.grad = unit.grad_shard = torch.zeros_like(unit.flat)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward calls inside only add up local gradients, as DDP's: one reduction for k
        micro-batches. (Stages 2 and 3 reduce-scatter in every backward regardless: ZeRO2.)"""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _on_grad(self, unit, p):
        check_gradient(self, p)  # not sparse, not after step() without zero_grad() (checks)
        self._queue_end_of_backward()
        # Into the unit's flat gradient: one buffer, one collective per unit. Stages 0 and 1 keep
        # p.grad as a view into it (DDP's gradient_as_bucket_view), where the next backward adds
        # in place. A new tensor (p.grad was None, or create_graph=True) is p's whole gradient.
        view = unit.view(unit.grad, p)
        if p.grad.data_ptr() != view.data_ptr():
            self.meter.beside(p.grad)  # (measurement: autograd's new tensor, held until copied)
            if p in unit.hidden and p not in unit.received:  # unused in an earlier backward:
                view.add_(p.grad.detach())  # its view holds what was reduced; add, as torch
            else:
                view.copy_(p.grad.detach())
        p.grad = view if self.keeps_full_grads else None
        unit.unreduced, unit.arrived = True, unit.arrived + 1
        unit.received.add(p)  # step() steps only what got a gradient on some rank
        if unit.arrived == len(unit.params) and self._reduce_in_backward():  # backward is done
            self._reduce_unit(unit)

    def _reduce_in_backward(self): return self.overlap and self._sync  # stages 0, 1: to overlap

    def _queue_end_of_backward(self):  # _end_of_backward runs once autograd has finished
        if not self._end_queued:       # this whole backward (autograd's queue_callback, as DDP)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_queued = True

    def _end_of_backward(self):
        # Once autograd finishes a backward: units with a parameter unused (no gradient) are
        # reduced here, in unit order (every rank must call the same collectives in one order).
        self._end_queued = False
        for unit in self.units:
            if unit.unreduced and self._reduce_in_backward():
                self._reduce_unit(unit)
            unit.arrived = 0
        self._land_reductions()  # the end of backward is where overlap waits

    def _reduce_unit(self, unit):
        count_unused(self, unit)  # (acts at stages 0, 1) a parameter without a gradient: zeros
        g = unit.grad if self.reduce_dtype is None else unit.grad.to(self.reduce_dtype)
        unit.unreduced = False
        work, result = self._reduce(unit, g)  # launched: it runs while backward goes on
        self.in_flight.append((work, unit, result))
        self.meter.event("reduction launched", unit)  # (measurement: what it holds in flight)
        self._land_reductions(wait=not self.overlap)  # overlap=False: land it now

    def _land_reductions(self, wait=True):
        # Oldest first, the same order as without overlap, so the sums are the same: with wait,
        # every one; else those beyond max_in_flight (no limit for stage 0's in-place all-reduces,
        # which hold no memory of their own; else 1, as each may hold a buffer: stage 2's full
        # gradient, gloo's all-to-all receive buffer, a copy in another dtype) and those complete.
        while self.in_flight and (wait or len(self.in_flight) > self.max_in_flight
                                  or self.in_flight[0][0].is_completed()):
            work, unit, result = self.in_flight.pop(0)
            self.meter.wait(work)  # work.wait(), and how long this rank waited (measurement)
            self._land(unit, result)
            self.meter.event("reduction landed", unit)  # the buffers it used are let go

    def _reduce(self, unit, g):  # -> (the collective's work, where its result lands)
        # meter.sent: the bytes sent (measurement), and a hash of the calls (check_step_agrees)
        self.meter.sent("all_reduce", g, unit)
        return dist.all_reduce(g, async_op=True), g  # [N*S] in place: the sum over all ranks

    def _land(self, unit, g):
        # Every rank holds the sum over ranks: / N, the mean. Accumulating (without no_sync)
        # adds to it, and reducing again is still right: (N·mean + new sum) / N = mean + new mean.
        unit.grad.copy_(g.div_(self.N))  # (g is unit.grad itself unless it is a copy)

    def _reduce_grads(self):
        # clip_grad_norm_() and step() start here: reduce what backward did not, land the rest
        if self._reduced:
            return
        for unit in self.units:
            if unit.unreduced:
                self._reduce_unit(unit)
            else:
                count_unused(self, unit)  # stages 0, 1: zero the slice of a p with no gradient
        self._land_reductions()
        # One or two small all-reduces (checks): every rank reduced the same units; which ones
        # got a gradient on some rank: step() steps those only, as torch skips a parameter whose
        # .grad is None (it also gives those unused here their .grad, and re-cuts the optimizer's
        # pieces, their m and v with them, where a piece holds both kinds).
        self.with_grad = check_step_agrees(self)
        self._reduced = True

    def _sum_of_squares(self):
        # Every rank holds the whole averaged gradient: its squares are the global ones (in fp32
        # at least: bf16 squares overflow and round)
        return sum(torch.linalg.vector_norm(u.grad_shard, dtype=torch.promote_types(
            u.grad_shard.dtype, torch.float32)) ** 2 for u in self.units)

    def clip_grad_norm_(self, max_norm):
        """torch's clip_grad_norm_ on the unsharded model: returns the global norm before."""
        self._reduce_grads()
        norm = self._sum_of_squares().sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # eps added once, to the global norm
        for u in self.units:
            u.grad_shard.mul_(scale.to(u.grad_shard.dtype))
        return norm

    def step(self):
        self._reduce_grads()
        # The hand-off: the optimizer steps pieces of each unit's master (views of it), and a
        # piece's .grad is the same slice of grad_shard, the mean gradient (an fp32 copy in
        # mixed precision); None where no rank gave its parameters one, as torch skips such a
        # tensor (a piece's parameters all have one or none: _reduce_grads re-cut it if not).
        for u in self.units:
            u.step_grad = u.grad_shard.to(u.master.dtype)  # (the same tensor if not mixed)
            grads = u.step_grad.split([t.numel() for t in u.pieces])
            for piece, grad, owners in zip(u.pieces, grads, u.owners):
                piece.grad = grad if self.with_grad.issuperset(owners) else None
        self.optimizer.step()
        after_step(self)  # mixed precision: fp32 masters into the shards; .grad let go
        self.steps += 1
        self._gather_params()

    def _gather_params(self): pass  # stage 0: every rank stepped the whole model, all is here

    def zero_grad(self, set_to_none=True):  # as torch's: .grad None, or zeros (set_to_none=False)
        for u in self.units:
            # As DDP, no pass over the buffer: the next backward's gradients overwrite it, and
            # count_unused zeroes what none does. Zeros (set_to_none=False; stages 2 and 3
            # always) are kept in the buffer or the shard, which backward then adds to.
            if self.keeps_full_grads and set_to_none:
                for p in u.params:
                    p.grad = None
            else:
                (u.grad_shard if u.grad is None else u.grad).zero_()  # (stages 2, 3: no grad)
            u.unreduced, u.hidden = False, set()
            u.received = set() if set_to_none else u.received  # zeros are stepped, as by torch
        self._reduced = False

    # The rest of the interface (gathered(), memory_breakdown(), state_dict()...): Part II


# ----------------------------------------------------------------------------------------------
# Stage 1: shard the optimizer state

class ZeRO1(DataParallel):
    """Changes vs DataParallel: each rank keeps optimizer state for its 1/N of each unit only.
    Gradients are reduce-scattered (each rank receives the sum of its own shard only), the
    optimizer steps that shard, and the updated shards are all-gathered back into every rank's
    full parameters. Memory 4Ψ + 12Ψ/N (paper); communication unchanged, 2Ψ (N-1)/N. (torch's
    ZeroRedundancyOptimizer hands whole parameters to owners instead: that balances badly.)"""

    stage = 1

    def _shard(self, unit):
        super()._shard(unit)                 # full gradient buffer, as in stage 0...
        unit.stepped = unit.my_slice         # ...but the optimizer steps this rank's [S]
        unit.shard = unit.flat[unit.my_slice]
        unit.grad_shard = unit.grad[unit.my_slice]  # and its [S] of the gradient: views, no copy

    def _reduce(self, unit, g):
        # Half the all-reduce (the other half comes after the step, on the parameters), in place:
        # the input is the full [N*S] gradient g (or its reduce_dtype copy), the output g's [S].
        self.meter.sent("reduce_scatter", g, unit)
        mine = g[unit.my_slice]
        return reduce_scatter(mine, g, async_op=True, group=self.group), mine

    def _land(self, unit, summed):
        # This rank's [S] holds the sum over ranks of its slice; the rest of the buffer, values
        # that sum counts (local or partial sums): zero them, so a later backward adds only new
        # ones. Keep the sum, not the mean: the next reduce-scatter adds to it (accumulation), and
        # only this rank holds it there. / N once, in _reduce_grads. (So at stage 1 a p.grad view
        # shows this rank's shard of the sum, of the mean once clipped or stepped, zeros elsewhere.)
        unit.grad_shard.copy_(summed)
        unit.grad[:unit.my_slice.start].zero_()
        unit.grad[unit.my_slice.stop:].zero_()

    def _reduce_grads(self):
        if not self._reduced:
            super()._reduce_grads()
            for unit in self.units:
                unit.grad_shard.div_(self.N)  # the sum over the N ranks -> the mean

    def _sum_of_squares(self):  # each rank holds 1/N of the gradient: add up all ranks' squares
        squares = super()._sum_of_squares()
        work = dist.all_reduce(squares, async_op=True, group=self.group)  # the N shards: the model
        self.meter.wait(work)
        self.meter.sent("all_reduce", squares, ranks=self.N)
        return squares

    def _gather_params(self):
        for unit in self.units:  # in place: this rank's stepped shard is a slice of flat
            work = all_gather(unit.flat, unit.shard, async_op=True, group=self.group)
            self.meter.wait(work)
            self.meter.sent("all_gather", unit.flat, unit)
            self.meter.event("all-gather after the step", unit)


# ----------------------------------------------------------------------------------------------
# Stage 2: shard the gradients

class ZeRO2(ZeRO1):
    """Changes vs ZeRO1: the full gradient no longer lives between steps. As soon as backward has
    produced every gradient of a unit, that unit's gradient is reduce-scattered, this rank adds
    its [S] into a persistent gradient shard, and the full [N*S] buffer is freed (one in flight
    as the next fills: max_in_flight). Memory 2Ψ + 14Ψ/N (paper); communication unchanged, but the
    reduce-scatters must run during backward (stage 1 runs them there only to overlap).

    Timing is the whole point: a "ZeRO-2" that reduce-scatters after backward has finished holds
    every full gradient at the peak and saves nothing. Trade-off: with gradient accumulation
    every backward call now communicates (stages 0 and 1 can defer to the last micro-batch with
    no_sync(); here that would keep the full gradient)."""

    stage = 2
    keeps_full_grads = False  # the [N*S] buffer is freed once reduced: p.grad must not keep it

    def _shard(self, unit):  # as ZeRO1's, but no [N*S] gradient buffer from step to step
        unit.stepped = unit.my_slice
        unit.shard = unit.flat[unit.my_slice]
        unit.grad = None                                # allocated per backward, freed when reduced
        unit.grad_shard = torch.zeros_like(unit.shard)  # [S] accumulates over backward calls

    def _on_grad(self, unit, p):
        if unit.grad is None:
            unit.grad = torch.zeros_like(unit.flat)  # [N*S], lives only until the unit is complete
            self.meter.event("gradient buffer", unit)
        super()._on_grad(unit, p)

    def _reduce_in_backward(self):
        return True  # always, overlap or not, no_sync or not: it is what frees the full gradient

    def _reduce_unit(self, unit):
        super()._reduce_unit(unit)  # the same reduce-scatter as ZeRO1, launched during backward
        unit.grad = None  # dropped; what is reduced ([N*S], or its copy) lives until it lands
        self.meter.event("gradient buffer dropped", unit)  # (freed once the sum has landed)

    def _land(self, unit, summed):
        unit.grad_shard.add_(summed)  # the sum over ranks, added up over backward calls; / N later


# ----------------------------------------------------------------------------------------------
# Stage 3: shard the parameters

class ZeRO3(ZeRO2):
    """Changes vs ZeRO2: each unit keeps only its [S] shard of the parameters. A hook all-gathers
    the unit right before its module computes in forward and frees it right after; it is
    gathered again for the module's backward (a layer's input gradient, grad_out @ W, needs W)
    and freed once its reduce-scatter is launched. Only the unit computing is gathered (with
    overlap, also the next one, prefetched; the root; one whose output has no tensor to hook),
    never the whole model. Memory 16Ψ/N (paper); communication 3Ψ (N-1)/N: a unit is
    all-gathered twice per step, not once. The root unit (what no unit holds: embeddings, final
    norm) once: gathered from the start of forward until its gradient is reduced, as FSDP2's."""

    stage = 3

    def __init__(self, model, optimizer, **options):
        # No buckets: the unit is what a module gathers to compute, so it stays as the user chose.
        super().__init__(model, optimizer, **{**options, "bucket_bytes": 0})
        self.prefetcher = Prefetch(self)  # speed 1: gathers the next unit while one computes
        guard_sharded_parameters(self)  # reading a freed parameter: an error, not a crash
        # The units each module computes with: its own, any it shares a weight with (a head tied
        # to the embedding needs that unit too); the model's own: the root unit (make_units).
        for module, units in self.computes_with.items():
            module.register_forward_pre_hook(functools.partial(self._pre_forward, units))
            module.register_forward_hook(functools.partial(self._post_forward, units))

    def _shard(self, unit):
        super()._shard(unit)
        unit.shard = unit.shard.clone()  # [S] in storage of its own: it survives the free
        unit.users, unit.prefetch = 0, None  # the modules computing with it; an all-gather's work
        self._free(unit)

    def _gather(self, unit, prefetch=False):
        if not unit.gathered:  # new memory, on the compute stream (CUDA streams: Part II)
            unit.flat.untyped_storage().resize_(unit.flat.numel() * unit.flat.element_size())
            unit.prefetch = all_gather(unit.flat, unit.shard, async_op=True, group=self.group)
            self.meter.sent("all_gather", unit.flat, unit)
            self.meter.event("gather", unit)
        if unit.prefetch is not None and not prefetch:  # needed now: wait for its all-gather
            self.meter.wait(unit.prefetch)
            unit.prefetch = None

    def _free(self, unit):
        # Gotcha: `p.data = torch.empty(0)` would not free anything while autograd still holds
        # the parameter for backward. Shrinking the storage itself frees the memory under every
        # view and saved tensor at once; _gather re-allocates it and refills it in place, so what
        # autograd saved sees the gathered values again in backward. (On a GPU this is safe
        # with CUDA streams, with no record_stream: see "Stage 3 on CUDA streams", Part II.)
        if unit.prefetch is not None:
            self.meter.wait(unit.prefetch)
            unit.prefetch = None
        unit.flat.untyped_storage().resize_(0)
        self.meter.event("free", unit)

    def _pre_forward(self, units, module, args):
        if recomputing(self, units):  # activation checkpointing: a forward run again in
            return  # backward; recomputing() gathers the units itself and counts no users
        for u in units:
            u.users += 1
            self._gather(u)
        self.prefetcher.forward_started(units)  # and the units of the module computing next

    def _post_forward(self, units, module, args, output):
        if torch._C._current_graph_task_id() != -1:  # in backward: the end of a recomputation
            return
        call = self.prefetcher.forward_done()  # this module's place in the order of gathers
        training = torch.is_grad_enabled()
        tensors = [t for t in output_tensors(output) if t.requires_grad]  # (Part II, units)
        for u in units:
            u.users -= 1
            # Kept into backward, till reduced: the root, a unit whose output has no tensor to hook
            keep = training and (not u.modules or not tensors)
            if u.users == 0 and not keep:
                self._free(u)
        if training and tensors:  # fires when backward reaches this module's output: gather again
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(self._pre_backward, units, call), mode="any")

    def _pre_backward(self, units, call, grad):
        if not torch.is_grad_enabled():  # (not create_graph, whose next backward reads them)
            self._queue_end_of_backward()  # which frees them even if no parameter gets a gradient
        for u in units:
            self._gather(u)
        self.prefetcher.backward_started(call)  # and those of the module before it

    def _reduce_unit(self, unit):
        super()._reduce_unit(unit)
        if unit.users == 0:
            self._free(unit)  # its gradient is complete, so backward is done with its parameters

    def _end_of_backward(self):
        super()._end_of_backward()
        self._gather_params()  # units gathered for a backward that gave them no gradient: freed

    def _gather_params(self):
        # Nothing to gather after the step: the next forward gathers each unit when it needs it.
        # A unit still gathered (a forward that had no backward) now holds stale values: free it.
        for unit in [u for u in self.units if u.users == 0 and u.gathered]:
            self._free(unit)


def _grad_hook(zero_ref, i, p):
    # Gotcha: a parameter keeps its hooks in C++, out of sight of Python's garbage collector: a
    # hook holding the ZeRO object (or a unit) would keep the whole model state alive for ever.
    # The hook holds a weak reference and a unit number.
    self = zero_ref()
    if self is not None:
        self._on_grad(self.units[i], p)


STAGES = [DataParallel, ZeRO1, ZeRO2, ZeRO3]


def wrap(model, stage, optimizer, **options):
    """Shard `model` in place (as FSDP2's fully_shard) for ZeRO `stage` over the default group
    (setup() makes one if there is none; import zero before init_process_group: see setup());
    return the optimizer that trains it. optimizer: makes a torch optimizer of tensors, e.g.
    partial(torch.optim.AdamW, lr=1e-3); options: Options."""
    if type(stage) is not int or stage not in range(len(STAGES)):  # (not 2.0, nor True)
        raise ValueError(f"zero: stage must be 0, 1, 2 or 3, not {stage!r}")
    return STAGES[stage](model, optimizer, **options)

# =================================== PART II: THE ENGINEERING =================================
# Each section serves Part I through the calls named there; then the demo, its loop, its report.

# ----------------------------------------------------------------------------------------------
# Distributed set-up: torchrun puts RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR... in the environment

# Imported before any process group: torch.distributed.nn's functions default to group.WORLD,
# evaluated at import (torch imports it lazily); after init_process_group, that keeps gloo alive
# into the interpreter's exit, aborting a run that succeeded ("terminate called without...").
import torch.distributed.nn, torch.utils._pytree  # noqa: F401,E402 (the latter: ShardedParameter)

def setup(backend=None, device=None, timeout_s=600):
    """Join torchrun's process group, or one that is up, or make a group of one."""
    if dist.is_initialized():
        if backend not in (None, dist.get_backend()):
            raise UsageError(f"--backend {backend}, but the process group is {dist.get_backend()}")
        here = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else choose_device("gloo", device)[1]  # (NCCL: its ranks' GPUs are chosen already)
        return dist.get_rank(), dist.get_world_size(), here
    backend, dev = choose_device(backend, device)
    if backend == "nccl":  # a failed collective raises in wait(), as gloo's (no watchdog abort)
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    timeout = timedelta(seconds=timeout_s)  # a dead rank fails the others' next collective
    # torchrun's store (_attempt_store); without RANK (even given a WORLD_SIZE): a group of one,
    store, rank, world = _attempt_store(timeout) if "RANK" in os.environ else (
        dist.HashStore(), 0, 1)  # (plain `python zero.py`: the same code path)
    dist.init_process_group(backend, store=store, timeout=timeout, rank=rank, world_size=world)
    return dist.get_rank(), dist.get_world_size(), dev


def gpu_each(local_world):
    """Whether each of local_world ranks has a GPU of its own (or CUDA_VISIBLE_DEVICES=3)."""
    shown, gpus = os.environ.get("CUDA_VISIBLE_DEVICES", ""), torch.cuda.device_count()
    return 0 < local_world <= gpus or gpus == 1 and shown != "" and "," not in shown


def choose_device(backend, device):
    """(backend, device), by default NCCL if each local rank has a GPU of its own, else gloo."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus, own = torch.cuda.device_count(), gpu_each(local_world)
    if device is None:
        device = "cuda" if backend != "gloo" and own else "cpu"
        if gpus and backend is None and not own and local_rank == 0:
            say(f"note: {local_world} local ranks, {gpus} GPU(s): gloo on CPU tensors "
                "(--backend gloo --device cuda shares the GPUs)")
    backend = backend or ("nccl" if device == "cuda" and own else "gloo")
    if device not in ("cpu", "cuda") or device == "cuda" and gpus == 0:
        raise UsageError(f"--device {device}: " + ("no CUDA GPU is visible" if device == "cuda"
                                                   else "zero.py computes on cpu or cuda"))
    if backend == "nccl" and (device != "cuda" or not own):
        raise UsageError(f"NCCL needs one CUDA GPU per local rank: {local_world} local rank(s), "
                         f"{gpus} GPU(s); use --backend gloo (add --device cuda to share GPUs)")
    if device == "cpu":
        return backend, torch.device("cpu")
    torch.cuda.set_device(local_rank % gpus)
    return backend, torch.device("cuda", local_rank % gpus)


def _attempt_store(timeout):
    """(torchrun's store, rank, world size), the store's keys prefixed by the restart attempt:
    after --max-restarts it still holds the dead ranks' addresses, which a rank would wait on."""
    env = {k: os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    port, world, rank = (int(v) if v.isdigit() else -1 for v in list(env.values())[1:])
    if not env["MASTER_ADDR"] or not (0 < port < 65536 and 0 <= rank < world):
        raise UsageError(f"RANK is set, but torchrun's environment is incomplete or out of range: "
                         f"{env}; launch with torchrun, or unset RANK for a group of one")
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts the store
    store = dist.TCPStore(env["MASTER_ADDR"], port, world, timeout=timeout, is_master=not agent
                          and rank == 0)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store), \
        rank, world


# ----------------------------------------------------------------------------------------------
# wrap()'s options. The torch optimizer over the pieces is `.optimizer`: LR schedulers attach there

@dataclasses.dataclass(frozen=True)
class Options:
    units: list = None         # the modules communicated as one (default: default_units(model))
    param_dtype: torch.dtype = None   # e.g. torch.bfloat16: compute in it, keep fp32 masters
    reduce_dtype: torch.dtype = None  # of the gradient reductions (default fp32 with param_dtype)
    overlap: bool = True       # reduce during backward, prefetch in stage 3 (speed 1)
    bucket_bytes: int = 0      # stages 0-2: buckets of this many bytes (speed 2; 0: one per unit)
    check_steps: bool = True   # 16 bytes a step: stop ranks that communicated different units
    shard_size: int = None     # G, hybrid: stages 1-3 shard over G consecutive ranks (hybrid.py)
    buffers: str = "none"      # each rank's own, as FSDP; "broadcast": rank 0's, as DDP
    init: object = None        # a meta-device model: init(module) for each, unit by unit, on
    device: object = None      # device (default: this rank's GPU under NCCL, else the CPU)


AGREED = ("param_dtype", "reduce_dtype", "overlap", "bucket_bytes", "check_steps", "N", "buffers")


def configure(zero, model, options):
    """wrap()'s set-up that is not the algorithm: options, units, device, Ψ, meter, checks."""
    o = Options(**options)  # (an unknown option: a TypeError that names it, as any call's)
    if not dist.is_initialized():  # a group for this model's device: torchrun's, or of one
        built = {p.device.type for p in model.parameters()} - {"meta"}
        setup(device=built.pop() if len(built) == 1 else o.device and torch.device(o.device).type)
    vars(zero).update(vars(o))
    zero.rank, zero.world = dist.get_rank(), dist.get_world_size()
    zero.N = zero.world if zero.shard_size is None else zero.shard_size  # hybrid: G (groups below)
    zero.group = zero.replica_group = None
    zero.mixed_precision = zero.param_dtype is not None
    zero.reduce_dtype = zero.reduce_dtype or (torch.float32 if zero.mixed_precision else None)
    zero.units = make_units(zero, model, o.units)
    zero.device = build_device(zero)  # the model's, or where a meta-device model is built
    zero.psi = sum(p.numel() for u in zero.units for p in u.params)  # Ψ: trainable params
    zero.meter = Meter(zero)
    # Speed 1, reductions in flight: stage 0 all, in place as DDP; else one (each holds a buffer)
    zero.max_in_flight = 1 if zero.stage > 0 or any(zero.reduce_dtype not in (
        None, zero.param_dtype or u.flat.dtype) for u in zero.units) else len(zero.units)
    # The model's forwards running now, for gathered() (the second hook runs even if it raises)
    running = zero.forwards = [0]
    model.register_forward_pre_hook(lambda *_: running.__setitem__(0, running[0] + 1))
    model.register_forward_hook(lambda *_: running.__setitem__(0, running[0] - 1), always_call=True)
    # Ranks that disagree would hang or exchange garbage: the first collective is a small one
    layout_hash = hashlib.sha256(repr(layout(zero)).encode()).hexdigest()[:16]
    same_on_every_rank({"stage": zero.stage, "Ψ": zero.psi, **{"shard_size" if k == "N" else k:
        getattr(zero, k) for k in AGREED}, "layout hash": layout_hash}, zero.device, "zero: ")
    if zero.N < zero.world:  # hybrid sharding (hybrid.py, a file of its own)
        _hybrid().make_hybrid(zero)
    guard_conversions(model)  # model.to(), .float(), .half(): refused where they would convert
    return zero.units


# ----------------------------------------------------------------------------------------------
# Units: which modules, by default, and the parameters each one holds

def default_units(model):
    """The repeated blocks (ModuleList, Sequential: 2+ of one class) at any depth, else children."""
    units, taken = [], set()
    for name, m in model.named_modules():
        members = list(m) if isinstance(m, (nn.ModuleList, nn.Sequential)) else []
        if not any(name.startswith(t + ".") for t in taken) and len(members) >= 2 and len(
                {type(b) for b in members}) == 1 and not no_forward(members[0]) and all(any(
                p.requires_grad for p in b.parameters()) for b in members):
            units += members
            taken.add(name)
    return units or _trainable_children(model)


def _trainable_children(module):  # a child with no forward (ModuleList...) is not one: its own
    return [u for child in module.children() for u in (  # children are (its parameters: root's)
        [] if isinstance(child, (nn.ParameterList, nn.ParameterDict)) else
        _trainable_children(child) if no_forward(child) else
        [child] * any(p.requires_grad for p in child.parameters()))]


def no_forward(module):  # a container (ModuleList...): its forward is nn.Module's, which raises
    return getattr(module.forward, "__func__", None) is nn.Module.forward  # (one set on it: not)


def make_units(zero, model, modules):
    """Each trainable parameter in the unit of the first of `modules` holding it, else the root."""
    real = [(n, p) for n, p in model.named_parameters() if not p.is_meta]
    spans = sorted((p.data_ptr(), p.data_ptr() + p.element_size() * (1 + sum(  # bytes it spans
        (k - 1) * st for k, st in zip(p.shape, p.stride()))), n, p.nbytes)
        for n, p in real if p.requires_grad and p.numel())  # sorted: an overlap is neighbours'
    alias = next((n for (lo, hi, n, size), (after, *_) in zip(spans, spans[1:] + [(float("inf"),)])
                  if hi - lo < size or after < hi), None)
    modules = default_units(model) if modules is None else list(dict.fromkeys(modules))
    inside = {id(m) for m in model.modules() if m is not model}
    sparse = [(n, type(m).__name__) for name, m in model.named_modules()
              if getattr(m, "sparse", False) is True
              for n, p in m.named_parameters(prefix=name, recurse=False) if p.requires_grad]
    renorm = [name or "the model" for name, m in model.named_modules()  # (frozen ones too)
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None]
    shells = [f"{n} ({type(m).__name__})" for n, m in model.named_modules() if zero.stage == 3
              and no_forward(m) and any(m is u for u in modules)]
    for bad, message in [
            (zero.buffers not in ("broadcast", "none"),
             f"buffers must be 'broadcast' or 'none', not {zero.buffers!r}"),
            (not (type(zero.bucket_bytes) is int and zero.bucket_bytes >= 0),
             f"bucket_bytes must be a whole number of bytes, 0 or more, not {zero.bucket_bytes!r}"),
            *[(not (d is None or isinstance(d, torch.dtype) and d.is_floating_point),
               f"{k} must be a floating-point torch dtype, not {d!r}") for k, d in (
                ("param_dtype", zero.param_dtype), ("reduce_dtype", zero.reduce_dtype))],
            (any(hasattr(p, "_zero_unit") for p in model.parameters()), "this model is wrapped "
             "already (wrap() changes it in place): build a new model to wrap it again"),
            (not (type(zero.N) is int and zero.N > 0 and zero.world % zero.N == 0),
             f"shard_size must be an int dividing the world size {zero.world}, not {zero.N!r}"),
            (zero.stage == 0 and zero.N != zero.world,
             "shard_size is for stages 1-3 (hybrid sharding); stage 0 shards nothing"),
            (real and len(real) < len(list(model.parameters())),  # (then materialize)
             real and f"some parameters are on the meta device and {real[0][0]} is on "
             f"{real[0][1].device}: build the whole model under torch.device('meta')"),
            (any(id(m) not in inside for m in modules),
             "every unit must be a submodule of the model (not the model itself)"),
            (shells, f"unit {shells[0] if shells else ''} has no forward: stage 3 gathers a unit "
             "as its forward starts; give its members as units"),
            (sparse, sparse and f"{sparse[0][0]} would get sparse gradients ({sparse[0][1]}, "
             "sparse=True): zero.py reduces dense ones in flat buffers; use sparse=False"),
            (renorm, renorm and f"{renorm[0]} has max_norm: each rank's forward rewrites the rows "
             "it looks up, so the ranks' weights drift apart; build it without max_norm"),
            (alias, f"{alias} shares elements with another parameter or itself (a view, expand()):"
             " wrap() would copy them apart into its units, untied; use one Parameter, or two")]:
        if bad:
            raise ValueError(f"zero: {message}")
    zero.unit_modules = modules  # a module holding only tied weights of other units stays listed
    zero.frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    seen, groups = set(), []
    for module in modules + [None]:
        params = [p for p in (module or model).parameters() if p.requires_grad and p not in seen]
        seen.update(params)
        groups += [([module] if module else [], params)] * bool(params)
    if not groups:
        raise ValueError("zero: the model has no trainable parameters")
    if zero.bucket_bytes:  # several units in one, or one in several
        groups = buckets(groups, zero.bucket_bytes)
    name = {p: n for n, p in model.named_parameters()}
    for p, q in [(p, ps[0]) for _, ps in groups for p in ps if (p.dtype, p.device) != (
            ps[0].dtype, ps[0].device)][:1]:  # (one flat buffer a unit)
        raise ValueError(f"zero: the parameters of one unit must share dtype and device: "
                         f"{name[p]} is {p.dtype} on {p.device}, {name[q]} {q.dtype} on {q.device}")
    # Hybrid: a unit padded to a multiple of the world size (a checkpoint's parts), R per shard
    R = zero.world // zero.N
    units = [Unit(mods, params, zero.rank % zero.N, zero.N,
                  S=-(-sum(p.numel() for p in params) // zero.world) * R if R > 1 else None)
             for mods, params in groups]
    for i, unit in enumerate(units):
        unit.index = i
        for p in unit.params:  # wrapped: its unit (at stage 3, where its values live), its name
            p._zero_unit, p._zero_name = weakref.ref(unit), name[p]
    zero.computes_with = {m: units_of for m in [model] + modules if (units_of := list(dict.fromkeys(
        p._zero_unit() for p in own_parameters(m, modules) if hasattr(p, "_zero_unit"))))}
    return units


def own_parameters(module, unit_modules):
    """What a module computes with itself: its parameters, less those of unit modules inside."""
    nested, out, todo = {id(m) for m in unit_modules if m is not module}, [], [module]
    while todo:
        m = todo.pop()
        out += list(m.parameters(recurse=False))
        todo += [c for c in m.children() if id(c) not in nested]
    return out


def output_tensors(x, seen=None):
    """The tensors in a module's output at any depth, each container once (it may hold itself)."""
    seen = set() if seen is None else seen
    if torch.is_tensor(x):
        return [x]
    if id(x) in seen or isinstance(x, (str, bytes, type, nn.Module, types.ModuleType)):
        return []
    seen.add(id(x))
    items = (x.values() if isinstance(x, dict) else
             x if isinstance(x, (list, tuple, set, frozenset)) else
             [getattr(x, f.name, None) for f in dataclasses.fields(x)]
             if dataclasses.is_dataclass(x) else getattr(x, "__dict__", {}).values())
    return [t for item in items for t in output_tensors(item, seen)]


def replicated(model):
    """Parameters frozen at wrap() and buffers: every rank holds them whole."""
    return [(n, p) for n, p in model.named_parameters() if not hasattr(p, "_zero_unit")] + list(
        model.named_buffers())


def replicate_the_rest(zero):
    """Rank 0's frozen parameters, buffers on every rank; param_dtype: frozen weights and inputs."""
    for _, t in replicated(zero.model):
        dist.broadcast(t.data, src=0)
    dtype = zero.param_dtype
    if zero.mixed_precision:
        for _, p in zero.frozen:
            p.data = p.data.to(dtype)
        def cast_in(a): return a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a
        for m in [zero.model] + zero.unit_modules:  # (inputs given by keyword too, as HF passes)
            m.register_forward_pre_hook(lambda module, args, kwargs: (tuple(map(cast_in, args)), {
                k: cast_in(v) for k, v in kwargs.items()}), with_kwargs=True)
    if zero.buffers == "broadcast":
        zero.model.register_forward_pre_hook(functools.partial(_broadcast_buffers,
                                                               weakref.ref(zero)))


def _broadcast_buffers(zero_ref, model, args):
    # With gradients on only, as DDP: an evaluation rank 0 runs alone must not wait
    zero = zero_ref()
    if zero is None or not torch.is_grad_enabled():
        return
    works = [dist.broadcast(b, src=0, async_op=True) for b in model.buffers()]
    for b, work in zip(model.buffers(), works):
        zero.meter.sent("broadcast", b)
        zero.meter.wait(work)


def build_device(zero):
    """The model's device, or where a meta-device model is built (init=, device=: only then)."""
    here = zero.units[0].flat.device
    if here.type == "meta":
        return _meta_init().build_device(zero.device)
    if zero.init is not None:
        raise ValueError("zero: init is for a model built on the meta device, not a built one")
    if zero.device is not None and torch.device(zero.device) != here:
        raise ValueError(f"zero: device= is for a meta-device model, not one on {here}")
    return here


def materialize(zero):
    """The units, each ready to be sharded; a meta-device model's each built as handed out."""
    zero.meter.event("building")
    return _meta_init().materialize(zero, zero.init) if zero.units[0].flat.is_meta else zero.units


# ----------------------------------------------------------------------------------------------
# Speed 1, overlap: an async_op=True collective runs while autograd computes (--no-overlap: not).
# Stage 3 on CUDA streams needs no record_stream: an all-gather runs after the kernels queued
# before it, its wait() makes the compute stream wait, and freed memory goes to later work there.

class Prefetch:
    """Gather the units of the module that computes next (backward: the one before)."""

    def __init__(self, zero):
        self.zero, self.order, self.calls, self.open = zero, None, [], []
        zero.model.register_forward_pre_hook(self._start_forward)

    def _start_forward(self, model, args):
        self.order, self.calls = self.order or self.calls or None, []  # the first forward's

    def forward_started(self, units):
        self.open.append(len(self.calls))  # this module's place in the order of gathers
        self.calls.append(units)
        self._gather(self.open[-1] + 1)

    def forward_done(self): return self.open.pop()

    def backward_started(self, call): self._gather(call - 1)

    def _gather(self, call):  # (not a unit whose gradient is complete: backward is done with it)
        if self.zero.overlap and self.order and 0 <= call < len(self.order):
            for u in [u for u in self.order[call] if u.arrived < len(u.params)]:
                self.zero._gather(u, prefetch=True)


def buckets(groups, bucket_bytes):
    # Speed 2, buckets: a collective has a fixed cost (latency, a sync), so many small units reduce
    # slowly; one huge unit waits for all of backward. Cut in reverse (backward's order) at
    # bucket_bytes or a dtype or device change, as DDP's 25 MB. Stage 2 holds a bucket's grad.
    out, held = [[]], 0
    for p in reversed([p for _, ps in groups for p in ps]):
        if out[-1] and (p.dtype, p.device) != (out[-1][-1].dtype, out[-1][-1].device):
            out, held = out + [[]], 0
        out[-1].append(p)
        held += p.numel() * p.element_size()
        if held >= bucket_bytes:
            out, held = out + [[]], 0
    return [([], b[::-1]) for b in reversed(out) if b]  # in model order, as units are


# Speed 3, optimizer pieces of at most PIECE elements: CPU Adam's ten passes over a 128K piece
# (2 MB with gradient, m, v) stay in L2 cache. The price: per-tensor work and a step counter each.
PIECE = {"cpu": 1 << 17, "cuda": 1 << 22}
# torch's optimizers that read more than an element (a tensor's RMS, a matrix, a line search)
NOT_ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "Adafactor", "LBFGS", "Muon", "SparseAdam") if hasattr(torch.optim, name))


def optimizer_of_pieces(zero, make):
    """make(pieces), the torch optimizer of each unit's master cut into pieces (views); u.owners:
    the parameters each holds elements of (cut where parameters start only when needed).
    Checked: one group holding exactly the pieces, element-wise (not Adafactor, LBFGS, Muon,
    SparseAdam: on pieces they would step something else), the same type and lr... on every rank."""
    zero.piece = PIECE.get(zero.units[0].flat.device.type, PIECE["cuda"])
    for u in zero.units:
        u.pieces, u.owners, u.per_parameter = *cut_pieces(zero, u, per_parameter=False), False
    pieces = [piece for u in zero.units for piece in u.pieces]
    kind = getattr(make, "func", make)  # a class (a partial's too): refused before it sees pieces
    if kind not in NOT_ELEMENTWISE:
        opt = make(pieces) if callable(make) and not (
            isinstance(make, type) and not issubclass(make, torch.optim.Optimizer)) else make
        if opt is make or not isinstance(opt, torch.optim.Optimizer):
            raise ValueError("zero: optimizer is a torch optimizer class, or a function of the "
                             "parameters that makes one (partial(AdamW, lr=1e-3)), not "
                             + getattr(make, "__name__", f"an instance of {type(make).__name__}"))
        kind = type(opt)
    if issubclass(kind, NOT_ELEMENTWISE):
        raise ValueError(f"zero: optimizer {kind.__name__} is not element-wise on dense "
                         "tensors (SGD, Adam... are); each rank steps flat pieces of its shard")
    if [set(map(id, g["params"])) for g in opt.param_groups] != [set(map(id, pieces))]:
        raise ValueError(f"zero: optimizer {type(opt).__name__} must step the parameters it is "
                         "given, in one group: each rank steps flat pieces of its shard")
    hyper = {k: v for k, v in opt.param_groups[0].items() if isinstance(v, (float, int, tuple))}
    same_on_every_rank({"optimizer": type(opt).__name__, **hyper}, zero.device, "zero: ")
    opt.register_step_pre_hook(functools.partial(refuse_silent_steps, weakref.proxy(zero)))
    if zero.mixed_precision and zero.stage < 3:  # (stage 3 refuses writes outside gathered())
        opt.register_step_pre_hook(functools.partial(keep_writes, weakref.proxy(zero)))
    return opt


def refuse_silent_steps(zero, *_):
    """Before the torch optimizer steps, refused: a step of its own (its tensors get their .grad
    in opt.step() only: it would step nothing) or of a group added after wrap() (each rank's own
    gradients); a p.grad set by hand since backward (p.grad = g: step() steps what backward put
    in the units, which stages 0, 1 show as p.grad views)."""
    if all(u.step_grad is None for u in zero.units) or len(zero.optimizer.param_groups) > 1:
        raise RuntimeError("zero: step the wrapped optimizer, opt.step(), over what wrap() gave "
                           "it (not opt.optimizer.step(), nor a group added since)")
    for u, p in [(u, p) for u in zero.units for p in u.params if p.grad is not None]:
        if not zero.keeps_full_grads or p.grad._base is not u.grad:  # (not a view of u.grad)
            raise RuntimeError(f"zero: {p._zero_name}.grad was set by hand since backward: "
                               "step() steps the gradient backward gave it (at stages 0, 1, "
                               "change p.grad in place)")


def cut_pieces(zero, u, per_parameter):
    """(pieces, owners) of u: every PIECE elements and (per_parameter) where parameters start."""
    lo, hi = u.stepped.start, u.stepped.stop
    cuts = sorted(set(range(lo, hi, zero.piece)) | {hi} | (
        {u.offset[p] for p in u.params if lo < u.offset[p] < hi} if per_parameter else set()))
    owners = [tuple(p for p in u.params if u.offset[p] < b and u.offset[p] + p.numel() > a)
              or (u.params[-1],) for a, b in zip(cuts, cuts[1:])]  # (the padding: the last's)
    return [u.master[a - lo:b - lo] for a, b in zip(cuts, cuts[1:])], owners


def split_pieces(zero, units):
    """Cut `units`' pieces where parameters start, in the optimizer: tensors, state (m, v)."""
    units, state = [u for u in units if not u.per_parameter], zero.optimizer.state
    for u in units:
        old = [(piece, piece.storage_offset()) for piece in u.pieces]
        u.pieces, u.owners, u.per_parameter = *cut_pieces(zero, u, per_parameter=True), True
        for piece in u.pieces:
            start = piece.storage_offset()
            whole, at = next((w, o) for w, o in old if o <= start < o + w.numel())
            if whole in state:
                state[piece] = {k: v[start - at:start - at + piece.numel()].clone()
                                if torch.is_tensor(v) and v.shape == whole.shape else
                                v.clone() if torch.is_tensor(v) else v
                                for k, v in state[whole].items()}
        for whole, _ in old:
            state.pop(whole, None)
    if units:
        zero.optimizer.param_groups[0]["params"] = [p for u in zero.units for p in u.pieces]


# Speed 4: gloo's reduce_scatter_tensor and all_gather_into_tensor on CPU are slower than its
# all-reduce (fsdp_demo.py --bench). So (DIRECT) reduce-scatter = an all_to_all + a local sum (the
# price: its receive buffer, as large as the input), all-gather = N broadcasts: a ring's bytes.
# (N gloo reduces would need no buffer, but each sends about its whole slice.) Else: torch's own.
DIRECT = True
# torch 2.13 warns on the names every torch >= 2.6 has (and every tutorial uses): silenced.
RENAMED = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
warnings.filterwarnings("ignore", message=RENAMED, category=FutureWarning)


class _Pending:
    """Like torch's Work, for several calls, then finish(). early: may land once they complete."""

    def __init__(self, works, finish=None, buffers=(), early=True):
        self.works, self.finish, self.buffers, self.early = works, finish, buffers, early

    def is_completed(self): return self.early and all(w.is_completed() for w in self.works)

    def wait(self):
        for w in self.works:
            w.wait()
        if self.finish is not None:
            self.finish()
        self.works, self.finish, self.buffers = [], None, ()


class GlooCPU:
    """Part I's reduce_scatter and all_gather on gloo with CPU tensors (DIRECT)."""

    @staticmethod
    def used_for(x): return DIRECT and x.device.type == "cpu" and dist.get_backend() == "gloo"

    @staticmethod
    def reduce_scatter(out, x, async_op, group=None):
        received = torch.empty_like(x)  # row j: rank j's slice for this rank
        rows = received.view(dist.get_world_size(group), out.numel())
        work = dist.all_to_all_single(received, x, async_op=True, group=group)
        pending = _Pending([work], lambda: torch.sum(rows, 0, out=out), [received])
        return pending if async_op else pending.wait()

    @staticmethod
    def all_gather(out, shard, async_op, group=None):
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        S, rank = shard.numel(), ranks.index(dist.get_rank())
        if shard.data_ptr() != out[rank * S:].data_ptr():
            out[rank * S:(rank + 1) * S].copy_(shard)
        pending = _Pending([dist.broadcast(out[j * S:(j + 1) * S], src=ranks[j], async_op=True,
                                           group=group) for j in range(len(ranks))])
        return pending if async_op else pending.wait()


# ----------------------------------------------------------------------------------------------
# Mixed precision (--bf16), the paper's: compute, gradients, gathers in param_dtype, reductions in
# fp32 (a sum over N ranks in bf16 loses bits), fp32 masters of the shard: K = 4 + 8 = 12 (Adam).

def cast(unit, dtype):
    """Compute with a copy of the unit in `dtype` (None: no copy); returns the original buffer."""
    full = unit.flat
    if dtype is not None:
        unit.flat = unit.flat.to(dtype, copy=True)  # (a copy even in the dtype it has)
        for p in unit.params:
            p.data = unit.view(unit.flat, p)
    return full


def keep_writes(zero, *_, units=None):
    """The masters take the elements written to the parameters (p.data.clamp_(), nn.init, in
    gathered(writeback=True)): those unlike their masters rounded. Before each step, stages 0-2."""
    for u in zero.units if units is None else units:
        for lo in range(0, u.master.numel(), zero.piece):
            new, master = u.shard[lo:lo + zero.piece], u.master[lo:lo + zero.piece]
            changed = new != master.to(new.dtype)
            master[changed] = new[changed].to(master.dtype)


def after_step(zero):
    """Masters rounded into the compute copy; gradients let go (measured before: a transient)."""
    zero.meter.event("optimizer step")
    for u in zero.units:
        if zero.mixed_precision:
            u.shard.copy_(u.master)
        for piece in u.pieces:
            piece.grad = None
        u.step_grad = None
    if zero.mixed_precision:
        zero.meter.event("fp32 gradients dropped")


# ----------------------------------------------------------------------------------------------
# Measurement: the bytes each rank holds, at every change, and the bytes it sends, per call

def _nbytes(tensors):
    """Bytes of the distinct storages behind these tensors: a view counted once, a freed one 0."""
    storages = {s.data_ptr(): s.nbytes() for s in (t.untyped_storage() for t in tensors)}
    return sum(n for ptr, n in storages.items() if ptr)


KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_reduce across groups", "broadcast")


class Meter:
    """Bytes sent (zero.comm) and held at the most (zero.peak); waited(): seconds of waiting."""

    def __init__(self, zero):
        self.zero, self.now, self.held, self.trace, self.timeline = zero, Counter(), {}, 0, None
        zero.comm, zero.peak, zero.build_peak = Counter(), Counter(), Counter()
        self.seconds, self.events, self.cuda = 0.0, [], zero.device.type == "cuda"

    def wait(self, work):
        """work.wait(), timed: what overlap did not hide. CPU: this thread's time inside wait()
        (gloo's local sum after an all-to-all included); CUDA: the stream's stall, by events."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work.wait()
            end.record()
            return self.events.append((start, end))
        start = time.perf_counter()
        work.wait()
        self.seconds += time.perf_counter() - start

    def waited(self):
        """Seconds waited in wait() so far (CUDA: synchronized)."""
        if self.events:
            self.events[-1][1].synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self.events) / 1e3
            self.events = []
        return self.seconds

    def sent(self, kind, full, unit=None, ranks=None):
        """Count a ring's bytes (all_reduce 2(N-1)/N M, others (N-1)/N M); fold into the trace."""
        z, code = self.zero, KINDS.index(kind)  # (not hash(kind): it differs between processes)
        self.trace = hash((self.trace, code, full.numel(), unit.index if unit else -1))
        n = ranks or (z.N if kind in ("reduce_scatter", "all_gather") else z.world)  # the ring
        times = 2 if kind.startswith("all_reduce") else 1  # (a broadcast: (N-1)/N M, pipelined)
        z.comm[kind] += times * (n - 1) * full.numel() * full.element_size() / n

    def beside(self, t):  # in the peak, not in what is held: autograd's new p.grad till copied
        self.zero.peak["grads"] = max(self.zero.peak["grads"], self.now["grads"] + _nbytes([t]))

    def breakdown(self):
        """Bytes of model state this rank holds now, allocated (not frozen parameters, buffers)."""
        held = sum((self.unit_bytes(u) for u in self.zero.units), Counter())
        return dict(params=held["params"], grads=held["grads"], optimizer=self.optimizer_bytes())

    def unit_bytes(self, unit):
        # No two units share a storage: a rank holds the sum over units (in flight included).
        flying = [t for w, u, mine in self.zero.in_flight if u is unit
                  for t in (mine, *getattr(w, "buffers", ()))]
        grads = [g for g in (unit.grad, unit.grad_shard, unit.step_grad) if g is not None]
        return Counter(params=_nbytes([unit.flat, unit.shard]), grads=_nbytes(grads + flying))

    def optimizer_bytes(self):
        z = self.zero
        if not hasattr(z, "optimizer"):  # wrap() is still building the units
            return 0
        state = [v for s in z.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return _nbytes(state + ([u.master for u in z.units] if z.mixed_precision else []))

    def event(self, what, unit=None):
        # unit None measures all; else only the unit that changed: the same cost for 5 units or 500
        for u in self.zero.units if unit is None else [unit]:
            old, self.held[u] = self.held.get(u, Counter()), self.unit_bytes(u)
            self.now.update(self.held[u])
            self.now.subtract(old)
        if unit is None:
            self.now["optimizer"] = self.optimizer_bytes()
        for kind, n in self.now.items():
            self.zero.peak[kind] = max(self.zero.peak[kind], n)
        if what == "start":  # wrap() is done: what building held at the most, kept apart
            self.zero.build_peak, self.zero.peak = self.zero.peak, Counter(self.now)
        if self.timeline is not None:  # --timeline: memory.py records this moment
            self.timeline.record(self.zero, what, unit)


# The formulas (the paper's Figure 1 and Section 7), printed next to what is measured

STAGE_NAMES = ["data parallel: nothing sharded", "ZeRO-1: optimizer state sharded",
               "ZeRO-2: optimizer state + gradients sharded",
               "ZeRO-3: optimizer state + gradients + parameters sharded"]


def memory_formula(stage, psi, world, param_bytes=4, grad_bytes=4, optim_bytes=8, shard_size=None):
    """Model-state bytes per rank, sharded over N (or G) ranks; fp32 AdamW's by default."""
    # each kind sharded over N (or G) from the stage given with it
    return {kind: b * psi / ((shard_size or world) if stage >= s else 1) for kind, b, s in (
        ("params", param_bytes, 3), ("grads", grad_bytes, 2), ("optimizer", optim_bytes, 1))}


def formula_symbols(stage, n, pb, gb, ob):  # memory_formula's, as text: {"params": "4Ψ/N"...}
    return {kind: f"{b}Ψ" + f"/{n}" * (stage >= s) for kind, b, s in
            (("params", pb, 3), ("grads", gb, 2), ("optimizer", ob, 1))}


def comm_formula(stage, psi, world, gather_bytes=4, reduce_bytes=4, micro_batches=1,
                 shard_size=None):
    """Bytes one rank sends per step (rings), by collective, with k micro-batches; hybrid (G < N):
    among G ranks, plus an all-reduce of each 1/G across the R = N/G groups."""
    G, k, R = shard_size or world, micro_batches, world // (shard_size or world)
    ring = (G - 1) / G * psi if stage else (world - 1) / world * psi
    g, r = ring * gather_bytes, ring * reduce_bytes
    out = [{"all_reduce": 2 * r}, {"reduce_scatter": r, "all_gather": g},
           {"reduce_scatter": k * r, "all_gather": g},
           {"reduce_scatter": k * r, "all_gather": 2 * k * g}][stage]
    if stage and R > 1:
        out["all_reduce across groups"] = (1 if stage == 1 else k) * 2 * (R - 1) / R * psi / G \
            * reduce_bytes
    return out


# ----------------------------------------------------------------------------------------------
# Checks: bad input is a clear error, ranks that disagree fail fast instead of hanging

def _all_ranks(row, device, dtype=torch.int64):
    """Every rank's `row` (as many numbers on each), in rank order: one small all-gather."""
    every = torch.empty(dist.get_world_size() * len(row), dtype=dtype, device=device)
    all_gather(every, torch.tensor(row, dtype=dtype, device=device))
    return every.view(dist.get_world_size(), len(row)).tolist()


class ShardedParameter(nn.Parameter):
    """A stage-3 parameter: reading its values while freed is a clear error (metadata works)."""

    METADATA = {"numel", "dim", "size", "stride", "storage_offset", "untyped_storage", "data_ptr",
                "element_size", "is_contiguous", "register_post_accumulate_grad_hook",
                "register_hook", "requires_grad_", "retain_grad", "__hash__", "grad", "backward",
                "is_floating_point", "is_complex", "is_signed", "get_device", "__len__"}
    VALUES = {"data", "T", "mT", "H", "mH", "real", "imag"}  # properties that are views

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):  # a property: getting .data, .T... hands out values
            reads = name == "__get__" and getattr(func.__self__, "__name__", "") in cls.VALUES
        else:  # x.view_as(p) asks p for its shape only
            reads = name not in cls.METADATA and (name != "view_as" or type(args[0]) is cls)
        leaves = torch.utils._pytree.tree_leaves((args, kwargs)) if reads else ()  # cat([p]) too
        for u, a in [(a._zero_unit(), a) for a in leaves if type(a) is cls]:
            if not u.gathered or u.prefetch is not None:  # (prefetched: its values on the way)
                raise RuntimeError(f"zero: {a._zero_name} is sharded at stage 3 and not gathered "
                                   "now: a module computing with it belongs in its unit; between "
                                   "steps, read it in `with opt.gathered():` on every rank, or "
                                   "opt.full_state_dict(); hooks: docs/api.md")
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})


def guard_sharded_parameters(zero):
    for p in [p for u in zero.units for p in u.params]:
        p.__class__ = ShardedParameter


def same_on_every_rank(fields, device, prefix=""):
    """Raise on every rank unless all have the same {name: value}, naming rank 0's and another's
    (one all-gather of a hash and the ends of each): ValueError given a prefix, else UsageError."""
    texts = [repr(v).encode() for v in fields.values()]  # each shown by its ends, in 40 bytes
    rows = _all_ranks([b for t in texts for b in hashlib.sha256(t).digest()[:8] + (
        t if len(t) <= 40 else t[:20] + b"..." + t[-17:]).ljust(40)], device, torch.uint8)
    for r, row in enumerate(rows):
        for i, name in enumerate(fields):
            a, b = (bytes(x[48 * i:48 * i + 48]) for x in (rows[0], row))
            if a[:8] != b[:8]:
                a, b = (x[8:].decode(errors="replace").strip() for x in (a, b))
                raise (ValueError if prefix else UsageError)(
                    f"{prefix}ranks disagree: rank 0 has {name} {a}; rank {r} has {name} {b}")


def check_step_agrees(zero):
    """The parameters some rank gave a gradient since zero_grad(), which step() steps. Refused: a
    parameter frozen at wrap() and trainable now, a unit still used by a forward (it would go
    stale), ranks that communicated different units."""
    # Ranks that computed with other units of the same size pair the wrong buffers silently. So a
    # 16-byte MAX all-reduce compares fingerprints (Meter.sent), even, +1 if a parameter got no
    # gradient here: max(trace + bit) + max(-trace) is 0 or 1 if they agree; 1: a second says which
    # (frozen after wrap(): step() leaves it, as torch)
    for name in [name for name, p in zero.frozen if p.requires_grad]:
        raise RuntimeError(f"zero: {name} was frozen at wrap() and requires grad now: wrap() "
                           "steps those trainable then; build it trainable and wrap it again")
    for u in [u for u in zero.units if getattr(u, "users", 0)]:
        raise RuntimeError(f"zero: unit {u.index} is still gathered by a forward that did not "
                           "finish (or a gathered() block): step() would leave it stale")
    params = [p for u in zero.units for p in u.params]
    got = [p in u.received for u in zero.units for p in u.params]
    device, missing = zero.units[0].flat.device, not all(got)

    def max_over_ranks(t):  # in place, waited and counted as the algorithm's collectives
        zero.meter.wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True))
        zero.meter.sent("all_reduce", t)
        return t
    if zero.world > 1 and zero.check_steps:
        trace = zero.meter.trace // 4 * 2  # even, and its negative fits in 64 bits
        t = max_over_ranks(torch.tensor([trace + missing, -trace], device=device))
        if t.sum() > 1:
            raise RuntimeError("zero: ranks communicated different units or orders (parameters "
                               "used on some ranks only? docs/api.md): the step is not applied")
        missing = t.sum() == 1
    if zero.world > 1 and (missing or not zero.check_steps):
        got = max_over_ranks(torch.tensor(got, dtype=torch.uint8, device=device)).tolist()
    zero.meter.trace = 0
    return settle_unused(zero, {p for p, g in zip(params, got) if g})


def check_gradient(zero, p):
    """Refused: a gradient after step() without zero_grad(), a sparse one, a new p.data's."""
    if zero._reduced:
        raise RuntimeError("zero: backward() after step() or clip_grad_norm_(): call the "
                           "wrapped optimizer's zero_grad() first (not the model's)")
    moved = p.untyped_storage().data_ptr() != p._zero_unit().flat.untyped_storage().data_ptr()
    if moved or p.grad.layout != torch.strided:  # nn.Embedding(sparse=True), a sparse custom grad
        raise RuntimeError(f"zero: {p._zero_name} " + (
            "has new .data since wrap() (resized?): change the model, then wrap it" if moved else
            f"got a sparse gradient ({p.grad.layout}): zero.py reduces dense ones; sparse=False"))


def recomputing(zero, units):
    """Whether a forward runs inside a backward (activation checkpointing), whose forward hook may
    never run (non-reentrant checkpointing stops once it has what it needs): the units are
    gathered here, no users counted, until their gradient is reduced."""
    if torch._C._current_graph_task_id() == -1:
        return False
    zero._queue_end_of_backward()  # on this backward, not on a nested one (reentrant)
    for u in units:
        zero._gather(u)
    return True


def count_unused(zero, unit):
    """Stages 0, 1: a parameter unused here is reduced as zeros, its .grad None; its slice then
    holds the others' mean, which step() shows as p.grad if some rank used p, as DDP. (Zeros
    kept by zero_grad(set_to_none=False) are a gradient.)"""
    for p in unit.params if zero.keeps_full_grads else []:
        if p.grad is None and p not in unit.hidden:
            unit.view(unit.grad, p).zero_()
            unit.hidden.add(p)
            unit.received.discard(p)  # (a .grad of zeros kept by zero_grad, set to None since)


def settle_unused(zero, with_grad):
    """p.grad of each p unused here: the mean in its slice, or None if unused on every rank."""
    for u in zero.units:
        for p in u.hidden & with_grad:
            p.grad = u.view(u.grad, p)
            u.received.add(p)  # (it has a .grad: zero_grad(set_to_none=False) keeps it)
        u.hidden.clear()
    split_pieces(zero, [u for u in zero.units if any(
        not with_grad.isdisjoint(o) and not with_grad.issuperset(o) for o in u.owners)])
    return with_grad


def guard_conversions(model):
    """model.to(), .float(), .cuda()... would give the units' parameters converted copies, not
    views: silently wrong training. Refused; the rest converts."""
    for module in model.modules():
        module._apply = functools.partial(_convert, module, module._apply)


def _convert(module, apply, fn, recurse=True):
    for p in module.parameters(recurse=recurse):  # what this conversion would reach
        probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))  # what p would become
        if hasattr(p, "_zero_unit") and (probe.dtype, probe.device) != (p.dtype, p.device):
            raise RuntimeError(f"zero: converting the wrapped model would make {p._zero_name} "
                               f"{probe.dtype} on {probe.device}, outside its unit: build it so "
                               "before wrap() (mixed precision: wrap(param_dtype=...))")
    with torch._C.DisableTorchFunctionSubclass():  # (stage 3: p itself, not its values)
        return apply(lambda t: t if hasattr(t, "_zero_unit") else fn(t), recurse)


# ----------------------------------------------------------------------------------------------
# Full parameters for a moment, as FSDP1's summon_full_params, DeepSpeed's GatheredParameters

@contextlib.contextmanager
def gathered(zero, modules=None, writeback=False):
    """`with optimizer.gathered(modules=None, writeback=False):` the modules' parameters hold their
    full values (evaluation, generation, an EMA). Every rank enters, between steps. writeback=True:
    rank 0's writes land on every rank, shards and masters too; else stage 3 drops writes, and
    stages 0-2 keep them as any write between steps: each rank's, in what it steps (as FSDP1)."""
    if zero.forwards[0] or torch._C._current_graph_task_id() != -1:
        raise RuntimeError("zero: optimizer.gathered() inside a forward or backward: a module "
                           "computes with its units gathered already; enter it between steps")
    modules = [zero.model] if modules is None else \
        [modules] if isinstance(modules, nn.Module) else list(modules)
    wanted = dict.fromkeys(p for m in modules for p in m.parameters())  # (in order: broadcasts)
    units = [u for u in zero.units if any(p in wanted for p in u.params)]
    kept = {u for u in units if u.gathered}  # (stage 3: the root, between forward and backward)
    for u in units if zero.stage == 3 else []:
        zero._gather(u)
        u.users += 1  # not freed by a forward inside the block
    try:
        yield
        for u in units if writeback else []:
            dist.broadcast(u.flat, src=0)  # rank 0's values, on every rank
            zero.meter.sent("broadcast", u.flat)
            if zero.stage == 3:
                u.shard.copy_(u.flat[u.my_slice])  # the shard lives in storage of its own
        if writeback and zero.mixed_precision:  # only the fp32 master of an element written
            keep_writes(zero, units=units)
        for p in [p for p in wanted if writeback and not hasattr(p, "_zero_unit")]:  # frozen
            dist.broadcast(p.data, src=0)
    finally:
        for u in units if zero.stage == 3 else []:
            u.users -= 1
            if u.users == 0 and u not in kept:
                zero._free(u)


# ----------------------------------------------------------------------------------------------
# The rest of the interface: gathered() (above), the bytes held, checkpoints (checkpoints.py)

DataParallel.gathered = gathered
DataParallel.memory_breakdown = lambda self: self.meter.breakdown()  # {params, grads, optimizer}
DataParallel.state_dict = lambda self: _checkpoints().checkpoint_part(self)  # this rank's part
DataParallel.load_state_dict = lambda self, state: _checkpoints().load_own_part(self, state)
DataParallel.full_state_dict = lambda self: _checkpoints().full_state_dict(self)  # unsharded
DataParallel.load_full_state_dict = lambda self, s: _checkpoints().load_full_state_dict(self, s)


def layout(zero):
    """The names and shapes of each unit's parameters, and what else a reader needs."""
    u0 = zero.units[0]
    return {"stage": zero.stage, "world_size": zero.world, "shard_size": zero.N, "psi": zero.psi,
            "dtype": {"compute": str(u0.flat.dtype),  # the masters': float32, or float64 kept
                      "master": str(torch.promote_types(u0.master.dtype, torch.float32))},
            "units": [[[p._zero_name, list(p.shape)] for p in u.params] for u in zero.units],
            "replicated": {n: list(t.shape) for n, t in replicated(zero.model)}}


# ----------------------------------------------------------------------------------------------
# The demo: a byte-level GPT on text made here; its loss falls from ln(256) within a minute on CPU

SUBJECTS = ["every rank", "rank 0", "the last rank", "each shard", "the optimizer", "the unit"]
VERBS = ["holds", "gathers", "reduces", "steps", "frees", "sends", "keeps", "scatters"]
OBJECTS = ["its own shard", "the full gradient", "one unit", "the fp32 master", "every block",
           "the sum over ranks", "the mean", "a slice of the buffer", "the parameters"]
ENDINGS = [" before the step", " during backward", " after the forward", " at once", ""]


@functools.lru_cache(maxsize=None)  # (bytes: each call's the same object, never changed)
def corpus(size=1 << 17):
    """`size` bytes of sentences from a fixed LCG: the same text on any torch or Python."""
    x, text = 12345, ""
    while len(text) < size:  # (ASCII: a character a byte)
        words = []
        for choices in (SUBJECTS, VERBS, OBJECTS, ENDINGS):
            x = (x * 1103515245 + 12345) % 2**31
            words.append(choices[(x >> 16) % len(choices)])
        text += f"{words[0]} {words[1]} {words[2]}{words[3]}.\n"
    return text.encode()[:size]


def demo_data(path=None):
    """The bytes the demo trains on, uint8: the file at `path` (--data), or corpus()."""
    raw = corpus() if path is None else open(path, "rb").read()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # (a row: int64 in get_batch)


class Block(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head, self.ln1, self.ln2 = n_head, nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.fc, self.out = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x):  # x: [B, T, d]
        B, T, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, T, 3, self.n_head, d // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, T, d/heads]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Byte-level GPT: blocks as units; the root holds the (tied) embeddings and the final norm."""

    def __init__(self, seq_len=64, d_model=64, n_layer=4, n_head=4, vocab=256):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d_model), nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.apply(self.init_weights)  # (built on the meta device, this draws nothing: wrap(init=))

    @staticmethod
    def init_weights(m):
        """GPT-2's init of a module's own tensors (first loss ~ln(256)); wrap(init=) calls it."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, nn.LayerNorm):
            m.reset_parameters()

    def forward(self, idx):  # idx: [B, T] byte values -> logits [B, T, vocab]
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def get_batch(data, step, micro, rank, world, batch_size, seq_len, seed):
    """Rank r's rows of the N*B windows drawn for (step, micro): one global batch for any N."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + micro)
    starts = torch.randint(len(data) - seq_len - 1, (world * batch_size,), generator=g)
    mine = starts[rank * batch_size:(rank + 1) * batch_size]
    rows = torch.stack([data[s:s + seq_len + 1] for s in mine]).long()
    return rows[:, :-1], rows[:, 1:]  # inputs [B, T], targets [B, T]: the next byte


# ----------------------------------------------------------------------------------------------
# Training and the report: a line per step, then what each rank held and sent, next to the formula

def box(rows):
    width = max(len(k) for k, _ in rows), max(len(str(v)) for _, v in rows)
    line = f"+-{'-' * width[0]}-+-{'-' * width[1]}-+"
    return "\n".join([line, *(f"| {k:<{width[0]}} | {v!s:<{width[1]}} |" for k, v in rows), line])


def adamw(args): return functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.1)


def log0(*a, **k):
    if dist.get_rank() == 0:  # one voice: rank 0 prints, the others stay quiet
        print(*a, **k, flush=True)


class Diverged(Exception):
    """The loss or gradient norm is not finite: stopped before that step (one line, exit code 3)."""


class OutOfMemory(Exception):
    """A rank ran out of memory (under --max-memory, or a real one): one line, exit code 4."""


UNITS = {  # --units: what a unit is (the lists of modules wrap(units=...) takes)
    "block": lambda model: model.blocks,  # one per transformer block, the root the rest
    "model": lambda model: [],  # the whole model, one unit: the root
    "layer": lambda model: [m for m in model.modules() if m is not model and any(  # each module
        p.requires_grad for p in m.parameters(recurse=False))]}  # with parameters of its own


def zero_build(args):
    """build() for train(): zero.wrap with the command line's settings, then --init-from's."""
    def build(model, device):
        state = _checkpoints().read_state_dict(args.init_from, device) if args.init_from else None
        opt = wrap(model, args.stage, adamw(args), units=UNITS[args.units](model),
                   param_dtype=torch.bfloat16 if args.bf16 else None, overlap=not args.no_overlap,
                   bucket_bytes=int(args.bucket_mb * 2**20), check_steps=not args.no_step_check,
                   shard_size=args.shard_size, init=GPT.init_weights, device=device)
        if state is not None:
            try:
                opt.load_full_state_dict(state)
            except ValueError as e:
                raise UsageError(f"--init-from {args.init_from}: {e.args[0][6:]}") from None
        return model, opt, f"zero.py stage {args.stage} ({STAGE_NAMES[args.stage]})"
    return build


def bytes_per_parameter(args): return (2, 2, 12) if args.bf16 else (4, 4, 8)  # params, grads, opt


def train(args, build=None, keep_params=False, quiet=False):
    """Train the demo model; return what every rank measured. build(model, device) -> (model,
    optimizer, label) parallelizes the meta-device model (zero_build; fsdp_demo.py: PyTorch's)."""
    rank, world, device = setup(args.backend, args.device, args.timeout)
    # The same flags and data on every rank (nodes launched apart may differ): else stop, naming it
    same_on_every_rank({**vars(args), "data (sha256)": hashlib.sha256(
        demo_data(args.data).numpy()).hexdigest()}, device)
    _memory().check_fits(args, world, device)  # a model this machine cannot hold: refused
    # where the rank is, for an out-of-memory line (--max-memory on CPU: Watch, the data size too)
    progress = (_memory().Watch if args.max_memory and device.type == "cpu" else
                _memory().Progress)()
    with torch.device("meta"):  # shapes only, no memory: no rank ever holds the whole model
        model = GPT(args.seq_len, args.d_model, args.n_layer, args.n_head)
    ckpt = args.ckpt_dir and _checkpoints().ckpt_dir_lock(args.ckpt_dir, device)
    with ckpt or contextlib.nullcontext():
        try:
            return _train(args, build, keep_params, quiet, world, device, model, progress)
        except (RuntimeError, MemoryError) as e:  # out of memory: OutOfMemory's line instead
            _memory().raise_if_out_of_memory(e, args, model, progress)
            raise


def _train(args, build, keep_params, quiet, world, device, model, progress):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # this run's peak only
    # runtime: what a rank held before --max-memory's limit (-1: no limit)
    runtime = _memory().limit_memory(args.max_memory, device, progress) if args.max_memory else -1
    torch.manual_seed(args.seed)  # the weights: wrap(init=...) draws them, unit by unit
    net, opt, label = (build or zero_build(args))(model, device)
    progress.track(model)
    data, log = demo_data(args.data), (lambda *a, **k: None) if quiet else log0
    log(box([("run", label),
             ("world size", f"{world} ({dist.get_backend()}, device {device.type})"),
             ("Ψ", f"{opt.psi:,} trainable parameters"),
             ("model", f"GPT, {args.n_layer} layers, d_model {args.d_model}, {args.n_head} heads, "
                       f"bytes of {os.path.basename(args.data) if args.data else 'corpus()'}"),
             ("dtype, optimizer", "bfloat16 compute, float32 master weights and reductions, AdamW"
              if args.bf16 else "float32, AdamW (state m, v: 8 bytes per parameter)"),
             ("global batch", f"{world} rank(s) x {args.batch_size} rows x {args.seq_len} bytes x "
                              f"{args.grad_accum} micro-batch(es)")]))
    ck = _checkpoints() if args.ckpt_dir or args.resume_from else None
    first, last_good = ck.resume(opt, args, world, device, log) if ck else (1, None)
    meter = getattr(opt, "meter", None)  # zero.py's times its waits (PyTorch's runs: unknown)
    times, waits, losses, sent, timeline, skipped = [], [], [], [], None, 0  # waits: Meter.wait's
    start = Counter(opt.comm)
    if first > args.steps:
        return log(f"nothing left to train: checkpoint at step {first - 1}, --steps {args.steps}")
    for step in range(first, args.steps + 1):
        progress.step = step
        progress.note("the forward")
        t0, sent0, waited0 = time.perf_counter(), sum(opt.comm.values()), meter and meter.waited()
        if step == args.record_step:
            _memory().start_timeline(opt)  # --timeline: this step's events
        loss_sum = torch.zeros((), device=device)
        # fsdp_demo.py's PyTorch runs count their calls in this context (zero.py's: Meter.sent):
        # one per step, entered twice: the check between is not counted
        counted = getattr(opt, "counting", contextlib.nullcontext)()
        with counted:
            for micro in range(args.grad_accum):
                x, y = get_batch(data, step, micro, dist.get_rank(), world, args.batch_size,
                                 args.seq_len, args.seed)
                with opt.no_sync() if micro < args.grad_accum - 1 else contextlib.nullcontext():
                    loss = F.cross_entropy(net(x.to(device)).float().flatten(0, 1),
                                           y.to(device).flatten()) / args.grad_accum
                    progress.note("the backward")
                    loss.backward()
                loss_sum += loss.detach()
            progress.note("the gradient reductions and norm")
            norm = opt.clip_grad_norm_(args.clip if args.clip > 0 else float("inf"))
        # Not finite (the global batch's loss: every rank decides the same): never applied or saved
        dist.all_reduce(loss_sum)  # (not in the meter's waiting: the loop's, not ZeRO's)
        loss, norm = loss_sum.item() / world, norm.item()
        bad = " and ".join(f"the {name} is {value:g}" for name, value in (("loss", loss), (
            "gradient norm", norm)) if not abs(value) < float("inf"))  # (nan too)
        if bad and not args.skip_nonfinite:
            saved = last_good or ("none written" if args.ckpt_dir else "none (no --ckpt-dir)")
            raise Diverged(f"step {step}: {bad}; stopped before this step was applied. Last good "
                           f"checkpoint: {saved} (try a lower --lr, or --skip-nonfinite)")
        if not bad:
            progress.note("the optimizer step")
            with counted:
                opt.step()
        timeline = _memory().stop_timeline(opt) if step == args.record_step else timeline
        skipped += bool(bad)
        progress.note("after the optimizer step")
        mem = opt.memory_breakdown()  # after the step, before zero_grad: every kind of state held
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        waits.append(meter and meter.waited() - waited0)
        sent.append(sum(opt.comm.values()) - sent0)
        losses.append(loss)
        log(f"step {step:4d} | loss {loss:.6f} | {times[-1] * 1e3:8.1f} ms"
            + (f", {waits[-1] * 1e3:6.1f} waiting" if meter else "") + " | "
            f"sent {sent[-1] / 1e6:8.4f} MB" + (f" | grad norm {norm:.4f}" if args.clip > 0 else "")
            + (" | not finite: skipped, the weights are unchanged" if bad else ""))
        if args.ckpt_dir and (step == args.steps or args.ckpt_every and not step % args.ckpt_every):
            progress.note("writing the checkpoint")
            last_good = ck.save(opt, args, step, world)
    if skipped:
        log(f"{skipped} step(s) of {len(times)} skipped: loss or gradient norm not finite")
    # Every rank's measurements, the largest over the ranks (-1: not measured)
    cuda_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else -1
    held = {"mem": mem, **{kind: getattr(opt, kind, {}) for kind in ("peak", "build_peak")}}
    mine = {**{(kind, k): d.get(k, -1) for kind, d in held.items() for k in mem},
            "cuda_peak": cuda_peak, "runtime": runtime,
            "used": progress.used() if device.type == "cpu" else  # (what
            torch.cuda.max_memory_reserved(device),  # set_per_process_memory_fraction limits)
            "per_block": progress.per_block()}
    ranks = [dict(zip(mine, row)) for row in _all_ranks(list(mine.values()), device)]
    most = {key: max(r[key] for r in ranks) for key in mine}
    res = {"label": label, "stage": args.stage, "psi": opt.psi, "world": world, "first": first,
           "losses": losses, "times": times, "sent": sent, "timeline": timeline,
           "waits": waits if meter else None,
           "units": [(u.flat.numel(), not u.modules) for u in opt.units] if meter else None,
           "comm": {k: (v - start[k]) / len(times) for k, v in opt.comm.items()},
           "cuda_peak": [r["cuda_peak"] for r in ranks] if cuda_peak >= 0 else None,
           "full": opt.full_state_dict() if keep_params else None,
           **{key: most[key] for key in ("runtime", "used", "per_block")},
           **{kind: {k: most[kind, k] for k in mem} for kind in held}}
    res["peak"] = res["peak"] if res["peak"]["params"] >= 0 else None
    return res


def median_step(times, first=0):
    """The index of the median of times[first:] (the upper one of two): one step, whole."""
    return sorted(range(first, len(times)), key=times.__getitem__)[(len(times) - first) // 2]


def report(res, args):
    psi, stage, world, k = res["psi"], res["stage"], res["world"], args.grad_accum
    G = args.shard_size or world  # hybrid sharding: what is sharded is 1/G
    n, (pb, gb, ob) = "N" if G == world else "G", bytes_per_parameter(args)
    formula = memory_formula(stage, psi, world, pb, gb, ob, shard_size=G)
    labels = formula_symbols(stage, n, pb, gb, ob)
    labels["total"] = [f"{pb + gb + ob}Ψ", f"{pb + gb}Ψ + {ob}Ψ/{n}", f"{pb}Ψ + {gb + ob}Ψ/{n}",
                       f"{pb + gb + ob}Ψ/{n}"][stage]
    peak, ours = res["peak"] or {}, res["label"].startswith("zero.py")  # notes on zero.py only
    log0(f"\nmodel state per rank, bytes (measured: largest over the {world} ranks, after the step;"
         f"\n  formula: {'mixed-precision' if args.bf16 else 'fp32'} AdamW)\n"
         f"  {'':<10} {'measured':>12}   {'formula':<10} {'':>12}   {'peak during a step':>18}")
    for kind in ("params", "grads", "optimizer", "total"):
        got, want = (sum(d.values()) if kind == "total" else d[kind] for d in (res["mem"], formula))
        at_peak = format(peak[kind], ",") if peak and kind in peak else "not measured"
        log0(f"  {kind:<10} {got:>12,}   {labels[kind]:<10} {want:>12,.0f}"
             + f"   {at_peak:>18}" * (kind != "total"))
    log0("  (measured includes padding and Adam's step counters; 'peak' adds what a step holds "
         "for a moment:\n   full-unit gradients, receive buffers, gathered units: docs/memory.md)")
    if ours and res["build_peak"]["params"] >= 0:  # the model came built on the meta device
        built = sum(res["build_peak"].values())  # model state held while wrap() built it
        log0(f"  building it (from the meta device, a unit at a time): at most {built:,} bytes a "
             f"rank;\n   the whole model's parameters (fp32): {4 * psi:,}")
    log0(f"\ncommunication per rank per step, bytes (ring cost of the calls made; gathers in {pb} "
         f"bytes,\n  reductions in 4; N = {world}, k = {k} micro-batches"
         + (f", G = {G}: hybrid)" if G < world else ")"))
    expected, comm, across = comm_formula(stage, psi, world, pb, 4, k, G), res["comm"], \
        "all_reduce across groups"
    ring = f"Ψ({n}-1)/{n}" if stage else "Ψ(N-1)/N"
    names = {"all_reduce": f"8{ring}" if stage == 0 else "-",  # in bytes, as memory's column
             "reduce_scatter": f"{k}·4{ring}" if stage >= 2 else f"4{ring}",
             "all_gather": f"{2 * k}·{pb}{ring}" if stage == 3 else f"{pb}{ring}",
             across: f"{1 if stage == 1 else k}·8Ψ/G (R-1)/R", "total": ""}
    for kind in [*sorted(set(comm) | set(expected)), "total"]:
        got, want = (sum(d.values()) if kind == "total" else d.get(kind, 0)
                     for d in (comm, expected))
        log0(f"  {kind:<{24 if G < world else 15}} {got:>14,.0f}   {names.get(kind, '-'):<15} "
             f"{want:>14,.0f}")
    gloo = ours and stage and world > 1 and dist.get_backend() == "gloo"  # (N = 1: nothing sent)
    on_cuda = bool(res["cuda_peak"])
    notes = [  # what the measured bytes count that the formula does not, or otherwise
        (G < world, f"inside a group of G = {G}, the check's all-reduce over all N included: "
                    f"{sum(comm.values()) - comm.get(across, 0):,.0f} measured, "
                    f"{sum(expected.values()) - expected.get(across, 0):,.0f} formula"),
        (stage == 3 and ours, "stage 3: a root unit stays gathered from forward into backward, "
                              "one all-gather fewer; a tied unit is gathered by each module"),
        (gloo and DIRECT and not on_cuda, "gloo on CPU: reduce_scatter is an all_to_all + local "
         "sum, all_gather N broadcasts:\n   a ring's bytes, in less time (GlooCPU in zero.py)"),
        (gloo and (on_cuda or not DIRECT), "gloo's own reduce_scatter_tensor all-reduces a copy "
         "of the whole input" + ",\n   through host memory" * on_cuda + ": an all-reduce's bytes, "
         "twice a ring's" + ";\n   on the GPU, a full-unit gradient more per reduction in flight, "
         "not in 'peak'" * on_cuda),
        (ours and comm.get("all_reduce") and world > 1, "all_reduce" + " includes" * (stage == 0)
         + ": a 16-byte check a step that ranks agree" + " and the gradient norm" * (stage > 0)),
        (world > 1, "not counted: the training loop's all-reduce of the loss, 4 bytes a step")]
    for note in [note for shown, note in notes if shown]:
        log0(f"  ({note})")
    i = median_step(res["times"])  # (of an even number: the upper of the middle two, one step)
    log0(f"\nmedian step time of rank 0: {res['times'][i] * 1e3:.1f} ms over "
         f"{len(res['times'])} steps")
    if res["waits"]:  # that step's split
        t, w = res["times"][i] * 1e3, res["waits"][i] * 1e3
        log0(f"step {res['first'] + i}, {t:.1f} ms: {w:.1f} ms waiting on collectives (the "
             f"communication overlap did not hide,\n  timed in their wait()) + {t - w:.1f} ms "
             "the rest (compute, optimizer, Python, the loss's all-reduce)")
    if on_cuda:
        log0("torch.cuda.max_memory_allocated per rank: " +
             ", ".join(f"{b / 1e6:.1f} MB" for b in res["cuda_peak"]))
    if args.max_memory and res["used"] >= 0:
        _memory().report_limit(res, args)


# ----------------------------------------------------------------------------------------------
# Command line: bad input is one line on stderr and exit code 2, never a traceback

class UsageError(Exception):
    """Bad input from the command line or the environment: printed as one line, exit code 2."""


class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):  # --help: every option's default
    def _get_help_string(self, action):  # (its value, or what the help says None means)
        return action.help if "(default" in str(action.help) else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    def error(self, message): raise UsageError(message)


def positive(kind):
    def parse(text):  # (not a number: argparse says "invalid positive int value: '2.5'")
        if not 0 < (value := kind(text)) < float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} must be positive and finite")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def training_parser(description):
    p = Parser(description=description, formatter_class=_ShowDefaults)
    add = p.add_argument
    add("--stage", type=int, default=3, choices=range(4), help="0 data parallel, 1-3 ZeRO")
    for flag, kind, default, text in [
            ("--steps", int, 30, "optimizer steps to train"), ("--n-layer", int, 4, "blocks"),
            ("--d-model", int, 64, "width"), ("--n-head", int, 4, "attention heads"),
            ("--seq-len", int, 64, "bytes per row"),
            ("--batch-size", int, 8, "rows per rank per micro-batch"),
            ("--grad-accum", int, 1, "micro-batches (backward calls) per step"),
            ("--lr", float, 2e-3, "AdamW's learning rate; applied also when resuming"),
            ("--timeout", float, 600, f"seconds a hung call waits, {TIMEOUTS[0]}-{TIMEOUTS[1]:g}")]:
        add(flag, type=positive(kind), default=default, help=text)
    add("--seed", type=int, default=0, help=f"seeds the weights and the batches, 0 to {SEEDS - 1}")
    add("--data", metavar="FILE", help="train on this file's bytes (default: zero.py's corpus())")
    add("--clip", type=float, default=1.0, help="global gradient-norm clip; 0 turns it off")
    add("--backend", choices=["nccl", "gloo"], help="(default: nccl, a GPU per rank, or gloo)")
    add("--device", choices=["cpu", "cuda"], help="(default: cuda if nccl, else cpu)")
    for flag, text in [
            ("--skip-nonfinite", "skip a step whose loss or gradient norm is inf or nan, not stop"),
            ("--bf16", "mixed precision: bf16 compute, fp32 master weights and reductions"),
            ("--no-overlap", "reduce in step() (stages 0, 1), wait for each call, no prefetch"),
            ("--no-step-check", "skip the check that ranks sent the same units (16 bytes)")]:
        add(flag, action="store_true", help=text)
    add("--bucket-mb", type=float, default=0, help="stages 0-2: buckets of this many MiB (DDP: 25)")
    add("--shard-size", type=positive(int), help="hybrid: shard over G ranks (default: N, all)")
    add("--init-from", metavar="FILE", help="start from a state_dict file (default: a fresh model)")
    add("--resume-from", metavar="DIR", help="continue a checkpoint of any stage and world size, "
        "zero.py's or FSDP2's: DIR or the newest in DIR (default: none; --ckpt-dir's first)")
    add("--ckpt-dir", help="save and resume here; one job a directory (default: no checkpoints)")
    add("--ckpt-every", type=positive(int), help="steps between checkpoints (default: at the end)")
    add("--units", choices=list(UNITS), default="block", help="a unit: each block, the model, "
        "or each module with parameters of its own")
    add("--max-memory", type=lambda text: _memory().memory_size(text), metavar="SIZE", help="each "
        "rank allocates at most SIZE (400MB, 2GiB) beyond its runtime (default: no limit)")
    p.set_defaults(record_step=None)  # --timeline: the step whose events are recorded
    return p


SEEDS = 2**32  # --seed: 0 to 2**32 - 1 (get_batch multiplies it into a 64-bit generator seed)
TIMEOUTS = (1, 1e7)  # --timeout, seconds: below 1 s set-up fails; timedelta and c10d overflow
# (the default, 600 s as NCCL's, outlasts the longest wait: rank 0 writing a checkpoint's manifest)


def check_args(args):
    size = len(corpus()) if args.data is None else \
        os.path.getsize(args.data) if os.path.isfile(args.data) else None
    for bad, message in [
            (args.d_model % args.n_head, f"--d-model {args.d_model} % --n-head {args.n_head} != 0"),
            (args.lr > torch.finfo(torch.float32).max,  # the optimizer's fp32 arithmetic
             f"--lr {args.lr:g} is beyond float32's range"),
            (not 0 <= args.clip < float("inf"), f"--clip must be 0 or positive, not {args.clip}"),
            (not 0 <= args.bucket_mb * 2**20 < float("inf"), "--bucket-mb must be 0 or a finite "
             f"positive number, not {args.bucket_mb}"),
            (args.init_from and args.resume_from, "--init-from and --resume-from: not both"),
            (not 0 <= args.seed < SEEDS, f"--seed must be from 0 to {SEEDS - 1}, not {args.seed}"),
            (not TIMEOUTS[0] <= args.timeout <= TIMEOUTS[1], "--timeout must be from "
             f"{TIMEOUTS[0]:g} to {TIMEOUTS[1]:g} seconds, not {args.timeout:g}"),
            (args.data is not None and (size is None or not os.access(args.data, os.R_OK)),
             f"--data {args.data}: not a file that can be read"),
            (args.ckpt_every and not args.ckpt_dir, "--ckpt-every needs --ckpt-dir")]:
        if bad:
            raise UsageError(message)
    for flag in [k for k, v in vars(args).items() if v == "" and k != "cluster"]:  # (--cluster
        raise UsageError(f"--{flag.replace('_', '-')} '': an empty name")       # '': defaults)
    if args.seq_len > size - 2 and not vars(args).get("estimate"):  # a row: seq_len + 1 bytes
        raise UsageError(f"--data {args.data} has {size} bytes: too few for a row" if size < 3
                         else f"--seq-len {args.seq_len} is longer than the data allows: at "
                         f"most {size - 2} ({args.data or 'corpus()'} has {size} bytes)")
    return args


def main(argv=None):
    p = training_parser("Data parallel and ZeRO-1/2/3 from raw torch.distributed collectives.")
    add = p.add_argument
    add("--estimate", action="store_true", help="print the per-rank memory formula and exit")
    add("--params", type=positive(float), help="Ψ for --estimate, e.g. 7.5e9 (default: none)")
    add("--world-size", type=positive(int), help="N: --estimate, --largest-model (default: none)")
    add("--largest-model", action="store_true", help="find the most blocks each stage trains "
        "within --max-memory on --world-size ranks (trials of its own)")
    add("--consolidate", metavar="DIR", help="write DIR's newest checkpoint as one state_dict "
        "(--out) and exit (default: train)")
    add("--out", metavar="FILE", help="--consolidate: .pt, .safetensors or .dcp (default: none)")
    add("--timeline", metavar="FILE.svg", help="draw the last step's bytes held (default: none)")
    add("--timeline-all", metavar="FILE.svg", help="every stage's timeline (default: none)")
    add("--cluster", nargs="?", const="", metavar="KEY=VALUE,...", help="--estimate: a step's "
        "time on this cluster too (keys: tradeoffs.py; none: the defaults)")
    add("--tradeoffs", action="store_true", help="train every stage here; print memory, bytes, "
        "time, waiting, tokens/s, and the time model's")
    add("--unit-sizes", action="store_true", help="--tradeoffs: also with --units model, layer")
    args = check_args(p.parse_args(argv))
    runs = [f"--{k}".replace("_", "-") for k in ("estimate", "tradeoffs", "consolidate",
            "largest_model", "timeline", "timeline_all") if vars(args)[k]]  # each a run of its own
    if len(runs) > 1:
        raise UsageError(f"{runs[0]} and {runs[1]}: choose one")
    if args.timeline or args.timeline_all:
        _memory().check_timeline_args(args)
    if args.world_size and args.shard_size and args.world_size % args.shard_size:
        raise UsageError(f"--shard-size {args.shard_size} does not divide --world-size "
                         f"{args.world_size}")
    if args.largest_model:
        _memory().check_largest_model_args(args)
    elif args.world_size is not None and not args.estimate:
        raise UsageError("--world-size is for --estimate and --largest-model")
    for flag, only in (("params", "estimate"), ("out", "consolidate"), ("cluster", "estimate"),
                       ("unit_sizes", "tradeoffs")):
        if getattr(args, flag) not in (None, False) and not getattr(args, only):
            raise UsageError(f"--{flag.replace('_', '-')} is for --{only}")
    if args.estimate or args.tradeoffs:
        _tradeoffs().command(args, sys.argv[1:] if argv is None else argv)
    elif args.consolidate:
        _checkpoints().consolidate_command(args)
    elif args.largest_model:
        _memory().largest_model(args)  # (a SIGTERM ends it through its finally blocks)
    elif args.timeline_all:
        _memory().train_every_stage(args)
    else:
        res = train(args)
        if res is not None:
            report(res, args)
            if args.timeline:
                _memory().show_timeline([_memory().timeline_panel(res, args)], args.timeline)


def run(main, argv=None):
    """Run main() or main(argv): bad input, divergence, out of memory: one line, exit 2, 3, 4."""
    code, line, prog = 0, "", os.path.basename(sys.argv[0])
    rank0 = os.environ.get("LOCAL_RANK", "0") == "0" or "RANK" not in os.environ  # one a node
    try:
        main(argv) if inspect.signature(main).parameters else main()
    except (UsageError, Diverged) as e:
        code, line = (2 if isinstance(e, UsageError) else 3), f"error: {e}" * rank0
    except (ValueError, RuntimeError) as e:
        if str(e).startswith("zero: "):  # zero.py's own checks: a model or use it refuses
            code, line = 2, f"error: {str(e)[len('zero: '):]}" * rank0
        elif isinstance(e, ValueError) or not isinstance(e, dist.DistError) and not any(
                m in str(e).lower() for m in ("gloo/transport", "connection reset", "nccl",
                "connection closed", "timed out", "timeout", "pair closure")):
            raise  # (anything else: a bug)
        else:  # another rank died or a collective waited past --timeout: one line
            code, line = 1, (f"error: rank {os.environ.get('RANK', 0)}: a collective failed, "
                             "another rank is gone or the group's timeout (--timeout) passed "
                             f"({str(e).strip().splitlines()[0][:200]})")
    except (OutOfMemory, OSError) as e:  # this rank's own line: out of memory (the others fail
        # in their next collective), or a file it cannot write or read (a full disk...)
        code, line = (4 if isinstance(e, OutOfMemory) else 1), f"error: {e}"
    except KeyboardInterrupt:  # Ctrl-C (torchrun passes it to every rank): one line, rank 0's
        ckpt = any(a.startswith("--ckpt-d") for a in argv or sys.argv)  # (abbreviated too)
        code, line = 130, ("interrupted" + "; the checkpoints written so far are intact" *
                           ckpt) * rank0
    if line:
        say(f"{prog}: {line}")
    if dist.is_initialized() and code not in (1, 4, 130):
        time.sleep(0.05)  # torch 2.6: a gloo thread letting go of a tensor waits for the GIL,
        dist.destroy_process_group()  # which this holds while it joins them: let them finish
    sys.stdout.flush()  # (stderr is line-buffered: flushed at each newline)
    if code in (1, 4, 130):  # the group is not destroyed (a rank is gone): no teardown, which
        os._exit(code)       # would join gloo's threads, stuck in the last collective
    sys.exit(code)


# checkpoints.py, memory.py, hybrid.py, meta_init.py and tradeoffs.py: imported when needed
_checkpoints, _memory, _hybrid, _meta_init, _tradeoffs = (functools.partial(__import__, name)
    for name in ("checkpoints", "memory", "hybrid", "meta_init", "tradeoffs"))


def say(line):
    """One line on stderr in one write: the ranks share it; print() writes the newline apart."""
    sys.stderr.write(line + "\n")  # (stderr is line-buffered: flushed at the newline)


if __name__ == "__main__":
    run(main)
