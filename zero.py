"""
zero.py: data parallelism and ZeRO stages 1, 2 and 3, written from scratch with the raw
torch.distributed collectives, in one file you can read top to bottom.

    torchrun --nproc_per_node=4 zero.py --stage 2      # 4 ranks: gloo on CPU, or NCCL, one GPU each
    python zero.py --stage 3                           # one rank, the same code path
    python zero.py --estimate --params 7.5e9 --world-size 64   # the paper's Figure 1, no training
    torchrun --nproc_per_node=4 --max-restarts=3 zero.py --ckpt-dir ckpt --ckpt-every 10
                                                       # survives a killed rank; resumes at any N, any stage
    python zero.py --consolidate ckpt --out model.pt   # one plain state_dict from the shards

The problem. Plain data parallelism keeps a full copy of the *model state* on every rank:
the parameters, their gradients and the optimizer's state (Adam's m and v, and in mixed precision
an fp32 master copy of the weights). With Ψ parameters that is 16Ψ bytes per rank in the
paper's mixed-precision Adam accounting, the same for fp32 Adam here (4 + 4 + 8 bytes per
parameter). A 7.5B model needs 120 GB on every rank before a single activation is stored, and
adding ranks does not help: each one holds the same 120 GB.

The idea (ZeRO, Rajbhandari et al., SC'20, arXiv:1910.02054). The N ranks hold N identical
copies: keep 1/N each instead, and communicate to fill in what a rank needs at the moment it
needs it. Shard the optimizer state (stage 1), then the gradients too (stage 2), then the
parameters too (stage 3). Per-rank model state, bytes (paper, mixed precision, K = 12):

    stage                  params  grads   optimizer  total per rank   Ψ = 7.5e9, N = 64
    0 data parallel        2Ψ      2Ψ      12Ψ        16Ψ                  120 GB
    1 ZeRO-1 (P_os)        2Ψ      2Ψ      12Ψ/N      4Ψ + 12Ψ/N          31.4 GB
    2 ZeRO-2 (P_os+g)      2Ψ      2Ψ/N    12Ψ/N      2Ψ + 14Ψ/N          16.6 GB
    3 ZeRO-3 (P_os+g+p)    2Ψ/N    2Ψ/N    12Ψ/N      16Ψ/N                1.9 GB

What it costs, per rank per optimizer step, counted as elements sent by a ring algorithm
(all-reduce = reduce-scatter + all-gather, so it sends twice what either half sends):

    stage 0   all_reduce(grads)                                      2Ψ (N-1)/N
    stage 1   reduce_scatter(grads) + all_gather(updated params)     2Ψ (N-1)/N  same as 0
    stage 2   the same, the reduce-scatter issued during backward    2Ψ (N-1)/N  same as 0
    stage 3   all_gather in forward + in backward + reduce_scatter   3Ψ (N-1)/N  1.5x

So stages 1 and 2 are free in communication: an all-reduce *is* a reduce-scatter followed by an
all-gather, and ZeRO just puts the optimizer step in between. (Free in bytes; in time only where
the backend's reduce-scatter and all-gather are as fast as its all-reduce, as NCCL's rings are.
gloo's own are not, so on gloo zero.py does them its own way: see reduce_scatter() below, and
fsdp_demo.py --bench, which times both.) Stage 3 pays 50% more, and latency: every unit waits
for its all-gather before it can compute.

How to read this file. The sections below run in the order the code does: set-up, the sharded
layout (a Unit), the two collectives, then one class per stage, each a small diff on the one
before it (stop reading after ZeRO1 and you know ZeRO-1), then the checkpoint files, the demo
model and data, then the measurements and the command line. The classes share one interface,
the one the tests and users call:

    optimizer = zero.wrap(model, stage=2, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    with optimizer.no_sync():           # optional: micro-batches that only accumulate (DDP's idiom)
        loss_fn(model(x1), y1).backward()
    loss_fn(model(x2), y2).backward()   # gradients accumulate; this one reduces
    optimizer.clip_grad_norm_(1.0)      # optional, global norm over all shards
    optimizer.step(); optimizer.zero_grad()
    zero.save_checkpoint(optimizer, "ckpt", step)   # sharded; loads at any stage and world size

The speed-ups are switches, each confined to one place, so the plain path still reads plainly:
mixed precision (param_dtype, --bf16: bf16 compute and gathers, fp32 reductions and an fp32
master shard, in DataParallel.__init__ and step), overlap (overlap=False, --no-overlap: each
unit's reduction launched asynchronously during backward, in DataParallel._reduce_unit and
_land_reduced; stage 3's prefetch in ZeRO3._prefetch), buckets (bucket_bytes, --bucket-mb:
stages 0-2 cut the parameters into buckets of that size, in DataParallel._buckets), and on gloo
with CPU tensors a faster reduce-scatter and all-gather than gloo's own (DIRECT, in
reduce_scatter and all_gather).

Checkpoints (DataParallel.state_dict, then the section "Checkpoint files") are written by every
rank in parallel, in model coordinates (parameter names, element ranges), so a checkpoint of N
ranks at one stage loads at M ranks at another, exactly.

What is left out, on purpose: activation memory (ZeRO-R: activation checkpointing and
partitioning) and CPU offload (ZeRO-Offload/Infinity). Activations are not model state and no
stage here shards them.
"""
import argparse
import contextlib
import functools
import hashlib
import itertools
import json
import os
import shutil
import statistics
import sys
import time
import warnings
import weakref
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single and warns on the
# old names. The old names are the ones every torch >= 2.6 has (and every tutorial uses), so we
# keep them and silence just that warning.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


# ----------------------------------------------------------------------------------------------
# Distributed set-up: torchrun puts RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR... in the environment

class UsageError(Exception):
    """Bad input from the command line or the environment: printed as one line, exit code 2."""


class CheckpointError(UsageError):
    """A checkpoint that does not fit (another model, a missing, truncated or corrupt file)."""


def setup(backend=None, device=None, timeout_s=120):
    """Join the process group torchrun describes, or make a group of one without torchrun.

    Default: NCCL when every local rank has a GPU of its own, else gloo on CPU tensors.
    gloo also works with CUDA tensors (--backend gloo --device cuda), which lets several ranks share
    one GPU; NCCL refuses that. Returns (rank, world_size, device)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count()
    if device is None:
        device = "cuda" if backend != "gloo" and 0 < local_world <= gpus else "cpu"
    if backend is None:
        backend = "nccl" if device == "cuda" and local_world <= gpus else "gloo"
    if device == "cuda" and gpus == 0:
        raise UsageError("--device cuda, but no CUDA GPU is visible")
    if backend == "nccl" and (device != "cuda" or local_world > gpus):
        raise UsageError(f"NCCL needs one CUDA GPU per local rank: {local_world} local rank(s), "
                         f"{gpus} GPU(s); use --backend gloo (add --device cuda to share GPUs)")
    dev = torch.device("cuda", local_rank % gpus) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        # A bounded timeout: if a rank dies, the others fail in their next collective after
        # timeout_s instead of waiting forever.
        timeout = timedelta(seconds=timeout_s)
        if "RANK" in os.environ:
            dist.init_process_group(backend, store=_attempt_store(timeout), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        else:  # plain `python zero.py`: a group of one, so world size 1 runs the very same code
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), dev


def _attempt_store(timeout):
    """The key-value store torchrun describes (what init_process_group's env:// would use), its
    keys prefixed by the restart attempt. Gotcha: after torchrun --max-restarts restarts a failed
    group, the store still holds the old ranks' gloo addresses, and a new rank that reads one
    before its new owner overwrites it waits for ever to connect to a dead process."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts the store
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=not agent and os.environ["RANK"] == "0", timeout=timeout)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)


# ----------------------------------------------------------------------------------------------
# The sharded layout. A Unit is a group of parameters communicated as one tensor, like FSDP's
# FlatParameter: its parameters back to back in one flat buffer, padded with zeros to a multiple
# of N so that it splits into N equal, contiguous shards. Rank r owns shard r.
#
#   flat  [N*S]: | p0 ........ | p1 .... | p2 ............ | 0 0 |    p.data is a view into it
#                |<- shard 0 ->|<- shard 1 ->|<- shard 2 ->|<- 3 ->|  (N = 4, S elements each)
#
# Why one flat buffer, not whole parameters handed round-robin to owners: every rank gets the
# same number of elements (to within the padding), and each collective is a single call.
# Why several units, not one buffer for the whole model: a unit is what stage 2 reduce-scatters
# as soon as backward is done with it, and what stage 3 gathers just before it computes. With
# units=[] everything is one unit, the root.

class Unit:
    def __init__(self, modules, params, rank, world):
        self.modules, self.params = modules, params  # modules []: the root unit (what is left over)
        numel = sum(p.numel() for p in params)
        self.S = -(-numel // world)                # shard size: ceil(numel / N)
        p0 = params[0]
        if any(p.dtype != p0.dtype or p.device != p0.device for p in params):
            raise ValueError("zero: the parameters of one unit must share dtype and device")
        self.flat = torch.zeros(world * self.S, dtype=p0.dtype, device=p0.device)  # [N*S]
        self.offset, o = {}, 0
        for p in params:
            self.flat[o:o + p.numel()].copy_(p.detach().flatten())
            p.data = self.flat[o:o + p.numel()].view_as(p)  # the module now computes with the view
            self.offset[p], o = o, o + p.numel()
        self.mine = slice(rank * self.S, (rank + 1) * self.S)  # the elements this rank owns
        self.shard = self.flat[self.mine]  # [S] this rank's part of the parameters
        self.master = self.shard           # [S] what the optimizer steps: the shard, or its fp32 copy
        self.grad = None                   # [N*S] the full gradient, when this rank holds one
        self.grad_shard = None             # [S] the owned 1/N of the averaged gradient
        self.ready = 0                     # parameters whose gradient arrived in this backward
        self.dirty = False                 # holds local gradients not reduced yet
        self.fresh = True                  # holds no gradient since zero_grad(): p.grad is None
        self.scaled = False                # this backward's gradients were divided by N as copied in
        self.users = 0                     # stage 3: modules computing with the gathered unit now
        self.work = None                   # stage 3: an all-gather in flight (a prefetch)

    def cast(self, dtype):
        """Mixed precision: compute with a copy in `dtype`; the fp32 values stay with the optimizer."""
        self.flat = self.flat.to(dtype)
        for p in self.params:
            p.data = self.flat[self.offset[p]:self.offset[p] + p.numel()].view_as(p)

    def grad_view(self, p):
        return self.grad[self.offset[p]:self.offset[p] + p.numel()].view_as(p)


def default_units(module):
    """Every child that has trainable parameters; containers (ModuleList, ModuleDict) are opened,
    so the blocks of a transformer's ModuleList each become a unit. Parameters of the model that no
    unit holds (an embedding, a final norm) form the root unit."""
    units = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units += default_units(child)
        elif any(p.requires_grad for p in child.parameters()):
            units.append(child)
    return units


# Elements: the largest tensor the optimizer is handed (see DataParallel.__init__). On CPU, 4 MB
# (fp32) pieces keep most of what Adam passes over again and again (weights, gradient, m, v, two
# temporaries) in the caches; on a GPU the optimizer's kernels stream, and few large pieces
# mean fewer launches.
PIECE = {"cpu": 1 << 20, "cuda": 1 << 22}


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _all_ranks(row, device, dtype=torch.int64):
    """Every rank's `row` (numbers, as many on each rank), in rank order: one small all-gather.
    (all_gather_object would do it for any object, but needs numpy, which torch does not install.)"""
    mine = torch.tensor(row, dtype=dtype, device=device)
    every = torch.empty(dist.get_world_size() * len(row), dtype=dtype, device=device)
    dist.all_gather_into_tensor(every, mine)
    return every.view(dist.get_world_size(), len(row)).tolist()


def _wide(t):
    """t in float32, or kept in float64: the precision masters are saved and returned in."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _nbytes(tensors):
    """Bytes of the distinct storages behind these tensors: what is really allocated, so a view
    is not counted twice and a freed buffer (storage resized to 0) counts 0."""
    storages = {s.data_ptr(): s.nbytes() for s in (t.untyped_storage() for t in tensors)}
    return sum(n for ptr, n in storages.items() if ptr)


# ----------------------------------------------------------------------------------------------
# The two collectives ZeRO is made of

# Every stage below is built from reduce-scatter and all-gather (an all-reduce is one then the
# other). NCCL runs both as rings: each rank sends (N-1)/N of the buffer, in N-1 steps, with no
# extra memory. gloo's reduce_scatter_tensor and all_gather_into_tensor are slow on CPU (measured
# on 4 ranks, 50 MB: 114 and 75 ms, against 65 ms for its whole all-reduce; fsdp_demo.py --bench
# prints it), so on gloo with CPU tensors these two functions do the same another way, sending
# the same (N-1)/N per rank:
#   reduce-scatter = one all_to_all (slice j of every rank goes to rank j) + a local sum of the N
#                    slices received; above A2A_BYTES, N reduces in place (rank j the root of
#                    slice j), which need no receive buffer and are faster there,
#   all-gather     = N broadcasts, in place (rank j sends its shard to everyone).
# Measured, 4 ranks: reduce-scatter of 1 MB 1.5 ms (gloo's own 3.9), of 50 MB 59 ms (114); all-gather
# of 50 MB 24 ms (75). N reduces cost ~8 ms even when tiny, hence the all-to-all below A2A_BYTES.
# Trade-off: the all-to-all's receive buffer (up to A2A_BYTES, counted as gradient memory while
# it is in flight). DIRECT = False, another backend, or CUDA tensors (where these paths were not
# measured) use the native calls.
DIRECT = True
A2A_BYTES = 16 << 20
DIRECT_CALLS = {"reduce_scatter": "all_to_all", "all_gather": "broadcast"}  # below A2A_BYTES


class _Pending:
    """What an async reduce_scatter/all_gather returns: a handle like torch's Work, waiting for all
    the calls it is made of and then finishing on this rank (the local sum, or a copy)."""

    def __init__(self, works, finish=None, buffers=()):
        self.works, self.finish, self.buffers = works, finish, buffers

    def is_completed(self):
        return all(w.is_completed() for w in self.works)

    def wait(self):
        for w in self.works:
            w.wait()
        if self.finish is not None:
            self.finish()
        self.works, self.finish, self.buffers = [], None, ()


def _direct(x):
    return DIRECT and x.device.type == "cpu" and dist.get_backend() == "gloo"


def reduce_scatter(out, x, async_op=False):
    """out [S] = the sum over ranks of x[rank*S:(rank+1)*S], x [N*S]. out may be that slice of x.
    Only out is defined afterwards: the rest of x may have changed."""
    if not _direct(x):
        return dist.reduce_scatter_tensor(out, x, async_op=async_op)
    S, rank, world = out.numel(), dist.get_rank(), dist.get_world_size()
    if x.numel() * x.element_size() <= A2A_BYTES:
        received = torch.empty_like(x)  # row j: rank j's slice for this rank
        work = dist.all_to_all_single(received, x, async_op=True)
        pending = _Pending([work], lambda: torch.sum(received.view(world, S), 0, out=out), [received])
    else:
        works = [dist.reduce(x[j * S:(j + 1) * S], dst=j, async_op=True) for j in range(world)]
        mine = x[rank * S:(rank + 1) * S]  # the sum lands here
        pending = _Pending(works, None if mine.data_ptr() == out.data_ptr() else lambda: out.copy_(mine))
    return pending if async_op else pending.wait()


def all_gather(out, shard, async_op=False):
    """out [N*S] = every rank's shard [S], in rank order. shard may be this rank's slice of out."""
    if not _direct(out):
        return dist.all_gather_into_tensor(out, shard, async_op=async_op)
    S, rank = shard.numel(), dist.get_rank()
    if shard.data_ptr() != out[rank * S:].data_ptr():
        out[rank * S:(rank + 1) * S].copy_(shard)
    works = [dist.broadcast(out[j * S:(j + 1) * S], src=j, async_op=True) for j in range(dist.get_world_size())]
    pending = _Pending(works)
    return pending if async_op else pending.wait()


# ----------------------------------------------------------------------------------------------
# Stage 0: data parallelism, the baseline every stage is measured against

class DataParallel:
    """Stage 0: every rank holds full parameters, gradients and optimizer state; gradients are
    averaged with all_reduce before the step. Memory 16Ψ per rank; communication 2Ψ (N-1)/N.

    This is DDP's job, done DDP's way: as soon as backward has produced the last gradient of a unit
    (a bucket), its all-reduce is launched asynchronously and backward goes on computing the next
    units' gradients meanwhile; step() waits for what is still in flight. With overlap=False
    everything is reduced in step() instead. Gradient accumulation: backward calls inside
    `with optimizer.no_sync():` only add up local gradients (as DDP's no_sync), so the
    reduction happens once per step, in the last micro-batch."""

    stage = 0
    _grad_views = True   # p.grad stays a view into the unit's gradient buffer (see _on_grad)
    _end_queued = False  # is _end_of_backward already queued for the backward now running?
    _sync = True         # False inside no_sync(): backward only adds up local gradients
    _max_in_flight = 1 << 30  # reductions launched in backward that may be in flight at once
    _prescale = True     # gradients are divided by N as they are copied in (see _on_grad)

    def __init__(self, model, optimizer, units=None, param_dtype=None, reduce_dtype=None, overlap=True,
                 bucket_bytes=0):
        self.model = model
        self.overlap = overlap  # communicate while autograd computes (reductions, stage 3's gathers)
        self.bucket_bytes = bucket_bytes  # stages 0-2: buckets this big instead of units (see _buckets)
        self._in_flight = []    # reductions launched during backward, their results not yet used
        # Mixed precision (the paper's accounting): compute, gradients and all-gathers in
        # param_dtype (2 bytes), reductions in reduce_dtype (fp32 by default: a sum over N ranks in
        # bf16 loses bits), and an fp32 master copy of this rank's shard for the optimizer, which
        # makes K = 4 + 8 = 12 bytes for Adam. None: everything stays in the model's dtype.
        self.reduce_dtype = reduce_dtype or (torch.float32 if param_dtype is not None else None)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.comm = Counter()  # bytes this rank has sent, per collective kind (ring cost, see _sent)
        self.peak = Counter()  # largest memory_breakdown() value seen, per kind
        self._now, self._held = Counter(), {}  # the same now, in all and per unit (see _track_peak)
        self.units = self._make_units(model, default_units(model) if units is None else list(units))
        self.psi = sum(p.numel() for u in self.units for p in u.params)  # Ψ: trainable parameters
        self._check_ranks_agree()
        # Ranks may have built their models with different seeds: start from rank 0's weights.
        # Frozen parameters and buffers too; they are not sharded, every rank keeps them whole.
        # (One-off set-up traffic, not counted in the per-step numbers.)
        for t in [u.flat for u in self.units] + [t for _, t in self._replicated()]:
            dist.broadcast(t.data, src=0)
        if param_dtype is not None:
            for p in model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(param_dtype)  # frozen weights compute in param_dtype too
            for m in [model] + self.unit_modules:  # as FSDP2 does: float inputs cast to param_dtype
                m.register_forward_pre_hook(functools.partial(_cast_inputs, param_dtype))
        for i, unit in enumerate(self.units):
            full32 = unit.flat
            if param_dtype is not None:
                unit.cast(param_dtype)
            self._shard(unit)
            if param_dtype is not None:  # [S] fp32, or the whole [N*S] in stage 0
                unit.master = full32[self._owned(unit)].clone()
            for p in unit.params:  # runs once p.grad holds this backward's gradient for p
                p.register_post_accumulate_grad_hook(functools.partial(_grad_hook, weakref.ref(self), i))
        if any(map(self._reduces_a_copy, self.units)):
            self._max_in_flight = 1  # each reduction in flight holds a copy in reduce_dtype of its own
        # The optimizer only ever sees flat tensors: the whole flat buffer here, this rank's shard
        # from stage 1 on. That is exact for element-wise optimizers (SGD, Adam, AdamW, Adagrad...):
        # each element's update depends on that element's gradient and state only, so cutting the
        # model into flat shards changes nothing. It is NOT exact for optimizers that look at a
        # whole tensor: LAMB and LARS scale by per-tensor norms, Shampoo and Muon precondition or
        # orthogonalize whole matrices; a shard holds slices of several tensors. They need the
        # full tensor, or shards cut along tensor boundaries plus extra communication.
        # (Per-parameter groups, e.g. no weight decay on biases, are not possible for the same reason.)
        #
        # The optimizer gets each flat tensor cut into pieces of at most PIECE elements (views, no
        # copy). Exact all the same, and it bounds the temporaries torch's optimizers allocate per
        # tensor (Adam's sqrt(v) + eps, ...) to one piece: one [S] temporary of a 50M-parameter
        # shard is 200 MB of transient memory. On CPU the pieces are small enough to stay in cache
        # while Adam makes its passes over them (measured, 50M model, stage 0 on 4 CPU ranks: the
        # step took 315-360 ms with 16 MB pieces, 130-205 ms with 4 MB ones; 1 MB pieces were no
        # faster, and each piece costs Adam a step counter of its own).
        device = self.units[0].flat.device if self.units else torch.device("cpu")
        self.piece = PIECE.get(device.type, PIECE["cuda"])
        for u in self.units:
            u.pieces = u.master.split(self.piece)
            if u.master is u.shard:  # mixed precision: step() hands over an fp32 copy of the gradient
                for piece, g in zip(u.pieces, u.grad_shard.split(self.piece)):
                    piece.grad = g
        self.optimizer = optimizer([piece for u in self.units for piece in u.pieces])
        self._reduced = False
        self._track_peak()

    def _make_units(self, model, modules):
        """Give each trainable parameter to the first unit module that holds it; the rest is root."""
        inside = {id(m) for m in model.modules() if m is not model}
        if any(id(m) not in inside for m in modules):
            raise ValueError("zero: every unit must be a submodule of the model (not the model itself)")
        modules = list(dict.fromkeys(modules))
        self.unit_modules = modules  # a module holding only tied weights of other units stays listed
        seen, groups = set(), []
        for module in modules + [None]:
            params = [p for p in (module or model).parameters() if p.requires_grad and p not in seen]
            seen.update(params)
            if params:
                groups.append(([module] if module else [], params))
        if not groups:
            raise ValueError("zero: the model has no trainable parameters")
        return [Unit(mods, params, self.rank, self.world) for mods, params in self._buckets(groups)]

    def _buckets(self, groups):
        # Bucketing: a collective has a fixed cost (latency, a launch, a sync with the slowest rank)
        # on top of its bytes, so many small units are slow to reduce one by one, and one huge unit
        # is reduced only once backward is done with all of it. With bucket_bytes, stages 0-2 cut
        # the parameters into buckets of their own, as DDP's 25 MB buckets: walking them in
        # reverse (the order backward produces gradients in, roughly), a bucket is closed as soon
        # as it holds bucket_bytes. Small units are merged, large ones split at parameter
        # boundaries, and what is left over is the bucket of the model's first parameters, the
        # last one backward completes: the reduction nothing overlaps is the smallest. A bucket
        # also ends where the dtype or device changes (one flat buffer holds one). The price: a
        # bucket is reduced only when its last gradient has arrived, and stage 2 holds a whole
        # bucket's full gradient while it is reduced.
        if not self.bucket_bytes:
            return groups
        params = [p for _, ps in groups for p in ps]
        buckets, open_, held = [], [], 0
        for p in reversed(params):
            if open_ and (p.dtype, p.device) != (open_[-1].dtype, open_[-1].device):
                buckets.append(open_[::-1])
                open_, held = [], 0
            open_.append(p)
            held += p.numel() * p.element_size()
            if held >= self.bucket_bytes:
                buckets.append(open_[::-1])
                open_, held = [], 0
        if open_:
            buckets.append(open_[::-1])
        return [([], b) for b in reversed(buckets)]  # in model order, as units are

    def _check_ranks_agree(self):
        # Fail fast. Ranks that built another model or chose another stage would hang in the next
        # collective (its sizes differ) until the timeout, or exchange garbage. So the first
        # collective is a small one every rank can make: stage, Ψ and a hash of the layout.
        layout = {k: v for k, v in self.layout().items() if k != "world_size"}
        digest = hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).digest()[:8]
        rows = _all_ranks([self.stage, self.psi, int.from_bytes(digest, "little", signed=True)], self.units[0].flat.device)
        for r, (stage, psi, digest) in enumerate(rows):
            if (stage, psi, digest) != tuple(rows[0]):
                raise ValueError(f"zero: ranks disagree: rank 0 has stage {rows[0][0]}, Ψ = {rows[0][1]:,}, "
                                 f"layout hash {rows[0][2] & (2**64 - 1):016x}; rank {r} has stage {stage}, "
                                 f"Ψ = {psi:,}, layout hash {digest & (2**64 - 1):016x}")

    def _shard(self, unit):
        # Stage 0 shards nothing: the "shard" this rank steps is the whole flat buffer, and the
        # full gradient lives as long as the model (4Ψ bytes in fp32).
        unit.shard = unit.master = unit.flat
        unit.grad = unit.grad_shard = torch.zeros_like(unit.flat)

    def _owned(self, unit):
        return slice(None)  # the elements of a unit this rank steps: all of them

    def _for_reduce(self, grad):
        return grad if self.reduce_dtype is None else grad.to(self.reduce_dtype)  # no copy if equal

    def _reduces_a_copy(self, unit):  # _for_reduce() copies this unit's gradient into reduce_dtype
        return self.reduce_dtype not in (None, unit.flat.dtype)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward calls inside only add up local gradients, as DDP's no_sync(): the next backward
        outside (or step()) reduces their sum, so k micro-batches cost one reduction, not k.
        Stages 2 and 3 reduce-scatter in every backward regardless: that is what frees their full
        gradients (ZeRO2)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _on_grad(self, unit, p):
        if self._reduced:  # adding local gradients to averaged ones would silently be wrong
            raise RuntimeError("zero: backward() after step() or clip_grad_norm_(): call zero_grad() first")
        if not self._end_queued:  # a parameter unused in this backward never reports: catch it at the end
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_queued = True
        # Move p's gradient into the unit's flat gradient: one buffer, one collective per unit.
        # Stages 0 and 1 keep that buffer, and leave p.grad as a view into it, as DDP's
        # gradient_as_bucket_view: the next backward's autograd adds into it in place, no copy.
        # Autograd hands over a new tensor instead when p.grad was None (after zero_grad: the
        # buffer still holds last step's values) or when it accumulated out of place
        # (create_graph=True: p.grad + new). Either way it is p's whole gradient so far: copy it
        # (its values: a graph through the gradient does not survive the collectives).
        view = unit.grad_view(p)
        if unit.ready == 0:  # the unit's first gradient in this backward
            # As DDP: if the buffer holds nothing yet (zero_grad() ran) and is all-reduced in this
            # backward, divide by N while copying in. The all-reduce then sums means, and the
            # separate pass of / N after it, a whole pass over the gradient, is saved. (Sum of
            # x/N or sum / N: the same bits when N is a power of two, else within rounding.)
            # Stage 1 divides only its shard, after the reduce-scatter: 1/N of that pass.
            unit.scaled = unit.fresh and self._prescale and self._reduce_in_backward() and \
                not self._reduces_a_copy(unit)
            unit.fresh = False
        if p.grad.data_ptr() != view.data_ptr():
            if unit.scaled:
                torch.mul(p.grad.detach(), 1 / self.world, out=view)
            else:
                view.copy_(p.grad.detach())
        p.grad = view if self._grad_views else None
        unit.dirty, unit.ready = True, unit.ready + 1
        if unit.ready == len(unit.params) and self._reduce_in_backward():  # backward is done with it
            self._reduce_unit(unit)

    def _reduce_in_backward(self):
        return self.overlap and self._sync  # stages 0 and 1 reduce in backward only to overlap

    def _end_of_backward(self):
        # Runs once when the autograd engine finishes a backward. Units that some parameter of
        # did not receive a gradient (unused in this forward) are reduced here, in unit order, the
        # same on every rank. (If ranks use different parameters, the collectives no longer match
        # and the job hangs until the timeout, as in DDP without find_unused_parameters.)
        self._end_queued = False
        for unit in self.units:
            if unit.dirty and self._reduce_in_backward():
                self._reduce_unit(unit)
            unit.ready = 0
        self._land_reduced()  # the end of backward is where overlap waits

    def _zero_missing(self, unit):
        # Stages 0 and 1: a parameter that got no gradient since zero_grad() (unused in forward)
        # still has last step's values in the buffer. Zero them: the flat buffer is reduced and
        # stepped whole, so an unused parameter gets a zero gradient (not None, as in plain torch).
        if self._grad_views:
            for p in unit.params:
                if p.grad is None:
                    unit.grad_view(p).zero_()

    def _reduce_unit(self, unit):
        self._zero_missing(unit)
        g = self._for_reduce(unit.grad)
        work = dist.all_reduce(g, async_op=self.overlap)  # [N*S] sum over ranks
        self._sent("all_reduce", g)
        unit.dirty = False
        self._in_flight.append((work, unit, g))
        self._track_peak(unit)  # in mixed precision, with the fp32 copy being reduced
        self._land_reduced(wait=not self.overlap)

    def _land_reduced(self, wait=True):
        # Overlap: with async_op=True the collective runs on the backend's own thread while
        # autograd goes on computing the next unit's gradients. Stage 0's all-reduces work in
        # place, with no memory of their own, so as DDP it leaves them all in flight (unless each
        # reduces a copy in reduce_dtype: see __init__). From stage 1 on, as FSDP2, one at a time
        # (stage 2 holds a full-unit buffer for each, gloo's all-to-all a receive buffer):
        # launching the next waits for the last. They land oldest first, the same order as
        # without overlap, so the sums are the same.
        while self._in_flight and (wait or len(self._in_flight) > self._max_in_flight
                                   or self._in_flight[0][0].is_completed()):
            work, unit, reduced = self._in_flight.pop(0)
            if work is not None:
                work.wait()
            self._land(unit, reduced)
            self._track_peak(unit)  # the buffers it used are let go

    def _land(self, unit, g):
        # / N: the global-batch mean, on every rank. A later backward (accumulation without
        # no_sync) adds local gradients to it, and reducing again is still right: every rank adds
        # the same mean, so (N·mean + sum of new) / N = mean + the new mean. (DDP does the same.)
        unit.grad.copy_(g if unit.scaled else g.div_(self.world))

    def _sent(self, kind, full):
        """Count what a ring algorithm makes this rank send for a collective over `full` (M bytes):
        all_reduce 2(N-1)/N M, reduce_scatter and all_gather (N-1)/N M each. What replaces them
        on gloo (all_to_all or N reduces, N broadcasts: see reduce_scatter) sends the same."""
        times = 2 if kind == "all_reduce" else 1
        self.comm[kind] += times * (self.world - 1) * full.numel() * full.element_size() / self.world

    def _reduce_grads(self):
        # clip_grad_norm_() and step() start here: reduce what no backward has reduced (all of it
        # with overlap=False; the micro-batches of no_sync()), and wait for what is in flight.
        if self._reduced:
            return
        for unit in self.units:
            if unit.dirty:
                self._reduce_unit(unit)
            else:
                self._zero_missing(unit)  # no gradient at all this step, on any rank
        self._land_reduced()
        self._reduced = True

    def _sum_of_squares(self):
        # Every rank holds the whole averaged gradient: its squares are the global ones.
        # (vector_norm in fp32, squared: no temporary as large as the gradient, unlike g.pow(2).sum())
        return torch.stack([torch.linalg.vector_norm(u.grad_shard, dtype=torch.float32) ** 2 for u in self.units]).sum()

    def clip_grad_norm_(self, max_norm):
        """Scale gradients so that their global L2 norm is at most max_norm, as
        torch.nn.utils.clip_grad_norm_ does on the unsharded model. Returns the norm before."""
        self._reduce_grads()
        norm = self._sum_of_squares().sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # eps added once, to the global norm
        for u in self.units:
            u.grad_shard.mul_(scale.to(u.grad_shard.dtype))
        return norm

    def step(self):
        self._reduce_grads()
        mixed = [u for u in self.units if u.master is not u.shard]
        for u in mixed:  # [S] fp32 gradient, for the step only
            for piece, g in zip(u.pieces, u.grad_shard.to(u.master.dtype).split(self.piece)):
                piece.grad = g
        self.optimizer.step()
        for u in mixed:
            u.shard.copy_(u.master)  # round the updated fp32 master into the compute copy
            for piece in u.pieces:
                piece.grad = None
        self._gather_params()
        self._track_peak()

    def _gather_params(self):
        pass  # stage 0: every rank stepped the whole model, nothing to fetch

    def zero_grad(self):
        for u in self.units:
            if self._grad_views:
                # Stages 0 and 1, as DDP: no pass over the buffer. The next backward's gradients
                # overwrite it (_on_grad copies), what none overwrites is zeroed (_zero_missing).
                for p in u.params:
                    p.grad = None
                u.fresh = True
            else:
                u.grad_shard.zero_()
            u.dirty = False
        self._reduced = False

    def memory_breakdown(self):
        """Bytes of model state this rank holds right now, summed over the storages really
        allocated (a view counts once, a freed buffer counts 0). Frozen parameters and buffers are
        not model state that ZeRO shards and are not counted."""
        held = [self._unit_bytes(u) for u in self.units]
        return {"params": sum(h["params"] for h in held), "grads": sum(h["grads"] for h in held),
                "optimizer": self._optimizer_bytes()}

    def _unit_bytes(self, unit):
        # No two units share a storage, so what a rank holds is the sum of what each unit holds:
        # its parameters and gradients, with what its reduction in flight holds.
        flying = [t for w, u, mine in self._in_flight if u is unit for t in (mine, *getattr(w, "buffers", ()))]
        return Counter(params=_nbytes([unit.flat, unit.shard]),
                       grads=_nbytes([g for g in (unit.grad, unit.grad_shard) if g is not None] + flying))

    def _optimizer_bytes(self):
        state = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return _nbytes(state + [u.master for u in self.units if u.master is not u.shard])  # + fp32 masters

    def _track_peak(self, unit=None):
        # Called where memory changes. After the step (unit None) everything is measured. During
        # forward and backward one unit's memory changes at a time (stage 3's gathers and frees,
        # stage 2's buffers, reductions launched and landed): only that unit is measured again and
        # the running total corrected, so an event costs the same with 5 units or 500. (Measured,
        # 200 small Linear units, stage 3, one CPU rank: 160 ms per step when every unit was
        # measured at every event, 43 ms this way, 27 ms with no tracking at all.) The optimizer
        # state changes in step() alone.
        for u in self.units if unit is None else [unit]:
            old, self._held[u] = self._held.get(u, Counter()), self._unit_bytes(u)
            self._now.update(self._held[u])
            self._now.subtract(old)
        if unit is None:
            self._now["optimizer"] = self._optimizer_bytes()
        for kind, n in self._now.items():
            self.peak[kind] = max(self.peak[kind], n)

    def full_state_dict(self):
        """{name: full float32 tensor (float64 for a float64 parameter)} for every parameter (tied
        ones once, frozen ones too), on every rank; in mixed precision, the fp32 master values."""
        full = {}
        for unit in self.units:  # one unit at a time: stage 3 never holds the whole model at once
            flat = self._full_master(unit)
            full.update({p: flat[unit.offset[p]:unit.offset[p] + p.numel()].view_as(p).clone() for p in unit.params})
        return {n: full[p] if p in full else _wide(p.detach()).clone() for n, p in self.model.named_parameters()}

    def _full_master(self, unit):
        return _wide(unit.master)  # [N*S]: every rank steps the whole unit

    # Checkpoints. A checkpoint must outlive its job's shape: it is written by N ranks at one
    # stage and may be read by M ranks at another. So what a rank writes is stated in the
    # coordinates of the model, not of the sharding: its 1/N of each unit's elements (stage 0
    # too: every rank holds everything, each writes 1/N of it), fp32 master values and each
    # per-element optimizer state (Adam's m and v), plus the names and shapes of the parameters
    # in each unit's flat order (layout()). Reading cuts what a rank owns now out of the parts
    # that hold it, parameter by parameter, by name. The files: save_checkpoint() below.

    def _replicated(self):
        """Frozen parameters and buffers: every rank holds them whole, none of them is sharded."""
        frozen = [(n, p) for n, p in self.model.named_parameters() if not p.requires_grad]
        return frozen + list(self.model.named_buffers())

    def layout(self):
        """The names and shapes, in flat order, of each unit's parameters, and what else a reader
        of this rank's state_dict() needs to know. Equal on every rank."""
        names = {p: n for n, p in self.model.named_parameters()}
        return {"stage": self.stage, "world_size": self.world, "psi": self.psi,
                "dtype": {"compute": str(self.units[0].flat.dtype), "master": str(_wide(self.units[0].master).dtype)},
                "units": [[[names[p], list(p.shape)] for p in u.params] for u in self.units],
                "replicated": {n: list(t.shape) for n, t in self._replicated()}}

    def state_dict(self):
        """This rank's part of a checkpoint: elements [rank*S, (rank+1)*S) of each unit's fp32
        master weights and per-element optimizer state, optimizer scalars (Adam's step count) and
        hyper-parameters; rank 0 also the frozen parameters and buffers."""
        units, scalars = [], {}
        for u in self.units:
            def mine(pieces):  # [S], a new tensor: stage 0 steps all N*S elements and writes 1/N of them
                if self._owned(u) == slice(None):  # only the pieces' parts inside u.mine: no full copy
                    starts = itertools.accumulate((t.numel() for t in pieces), initial=0)
                    pieces = [t[max(u.mine.start - a, 0):max(u.mine.stop - a, 0)] for t, a in zip(pieces, starts)]
                return _wide(torch.cat([t.detach() for t in pieces if t.numel()]))
            states = [self.optimizer.state.get(piece, {}) for piece in u.pieces]
            per_element = {}
            for key, value in states[0].items():
                if torch.is_tensor(value) and value.shape == u.pieces[0].shape:
                    per_element[key] = mine([s[key] for s in states])
                else:
                    scalars[key] = value
            units.append({"master": mine(u.pieces), "state": per_element})
        return {"rank": self.rank, "units": units, "scalars": scalars, "optimizer": type(self.optimizer).__name__,
                "hyper": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
                "replicated": {n: t.detach().clone() for n, t in self._replicated()} if self.rank == 0 else {}}

    def load_state_dict(self, parts, layout):
        """Load a checkpoint written at any stage and world size: `parts` are the state_dict()s of
        all its ranks, in rank order, `layout` the writer's layout(). Everything is checked before
        anything changes. Exact: each element's values are copied, not recomputed."""
        self._check_checkpoint(parts, layout)
        where, S = {}, []  # parameter name -> (writer's unit, offset in its flat); writer's shard sizes
        for i, params in enumerate(layout["units"]):
            o = 0
            for name, shape in params:
                where[name], o = (i, o), o + _numel(shape)
            S.append(-(-o // len(parts)))

        def read(i, lo, hi, key):  # elements [lo, hi) of the writer's unit i, from the parts holding them
            out = []
            while lo < hi:
                q = lo // S[i]  # the rank that wrote element lo
                end = min(hi, (q + 1) * S[i])
                unit = parts[q]["units"][i]
                out.append((unit["master"] if key == "master" else unit["state"][key])[lo - q * S[i]:end - q * S[i]])
                lo = end
            return torch.cat(out)

        keys = ["master"] + list(parts[0]["units"][0]["state"])
        scalars = parts[0]["scalars"]
        names = {p: n for n, p in self.model.named_parameters()}
        state = {}
        with torch.no_grad():
            for u in self.units:
                owned = self._owned(u)
                lo = owned.start or 0  # this rank's elements of the unit: [lo, lo + numel of master)
                values = {k: torch.zeros(u.master.numel(), dtype=_wide(u.master).dtype) for k in keys}  # padding 0
                for p in u.params:
                    a, b = max(u.offset[p], lo), min(u.offset[p] + p.numel(), lo + u.master.numel())
                    if a < b:  # p has elements in this rank's range: fetch them by p's name
                        i, o = where[names[p]]
                        for k, t in values.items():
                            t[a - lo:b - lo] = read(i, o + a - u.offset[p], o + b - u.offset[p], k)
                u.master.copy_(values.pop("master"))
                u.shard.copy_(u.master)  # the same tensor, unless mixed precision
                if values or scalars:  # the optimizer has state (it has stepped at least once)
                    for piece, *chunks in zip(u.pieces, *(t.split(self.piece) for t in values.values())):
                        state[piece] = {**dict(zip(values, chunks)),
                                        **{k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}}
            for n, t in self._replicated():
                t.copy_(parts[0]["replicated"][n])
        index = {piece: i for i, piece in enumerate(p for u in self.units for p in u.pieces)}
        groups = [{**h, "params": g["params"]} for h, g in zip(parts[0]["hyper"], self.optimizer.state_dict()["param_groups"])]
        self.optimizer.load_state_dict({"state": {index[p]: st for p, st in state.items()}, "param_groups": groups})
        self.zero_grad()
        self._gather_params()  # rebuild the full parameters from the shards (stages 1 and 2)

    def _check_checkpoint(self, parts, layout):
        """Raise CheckpointError, naming the first problem, unless the checkpoint fits this model."""
        mine = self.layout()
        want = {n: s for unit in mine["units"] for n, s in unit}
        got = {n: s for unit in layout["units"] for n, s in unit}
        for kind, a, b in [("parameter", want, got), ("frozen parameter or buffer", mine["replicated"], layout["replicated"])]:
            for n in list(a) + list(b):
                if a.get(n) != b.get(n):
                    raise CheckpointError(f"checkpoint is for another model: {kind} {n!r} is "
                                          f"{b.get(n, 'absent')} there, {a.get(n, 'absent')} here")
        if len(parts) != layout["world_size"] or [p.get("rank") for p in parts] != list(range(len(parts))):
            raise CheckpointError(f"checkpoint has {len(parts)} rank part(s), its layout says {layout['world_size']}")
        keys = set(parts[0]["units"][0]["state"]) if parts[0]["units"] else set()
        for r, part in enumerate(parts):
            for i, (unit, params) in enumerate(zip(part["units"], layout["units"])):
                size = -(-sum(_numel(s) for _, s in params) // len(parts))
                if set(unit["state"]) != keys or any(t.numel() != size for t in [unit["master"], *unit["state"].values()]):
                    raise CheckpointError(f"checkpoint part of rank {r}, unit {i}: not the {size} elements "
                                          f"(master and state {sorted(keys)}) the layout says")
            if len(part["units"]) != len(layout["units"]):
                raise CheckpointError(f"checkpoint part of rank {r} has {len(part['units'])} units, the layout {len(layout['units'])}")
        if parts[0].get("optimizer") != type(self.optimizer).__name__:
            raise CheckpointError(f"checkpoint was written with optimizer {parts[0].get('optimizer')}, "
                                  f"this run has {type(self.optimizer).__name__}")


# ----------------------------------------------------------------------------------------------
# Stage 1: shard the optimizer state

class ZeRO1(DataParallel):
    """Changes vs DataParallel: each rank keeps optimizer state for its 1/N of each unit only.
    Gradients are reduce-scattered (each rank receives the sum of its own shard only), the
    optimizer steps that shard, and the updated shards are all-gathered back into every rank's
    full parameters. Memory 4Ψ + 12Ψ/N (paper); communication unchanged, 2Ψ (N-1)/N.

    torch.distributed.optim.ZeroRedundancyOptimizer does this job, but hands whole parameters to
    owner ranks; here each unit is cut evenly (THEORY.md: round-robin owners balance badly)."""

    stage = 1
    _max_in_flight = 1
    _prescale = False

    def _shard(self, unit):
        super()._shard(unit)                            # full gradient buffer, as in stage 0...
        unit.shard = unit.master = unit.flat[unit.mine]  # ...but the optimizer sees this rank's [S]
        unit.grad_shard = unit.grad[unit.mine]          # and its [S] of the gradient: views, no copy

    def _owned(self, unit):
        return unit.mine

    def _reduce_unit(self, unit):
        # In place: input is the full [N*S] gradient, output is this rank's [S] slice of it.
        # Half the all-reduce: the other half, the all-gather, comes after the step, on params.
        self._zero_missing(unit)
        g = self._for_reduce(unit.grad)
        mine = g[unit.mine]
        work = reduce_scatter(mine, g, async_op=True)  # waited for at once below without overlap
        self._sent("reduce_scatter", g)
        unit.dirty = False
        self._in_flight.append((work, unit, mine))
        self._track_peak(unit)  # with the all-to-all's receive buffer, if any
        self._land_reduced(wait=not self.overlap)

    def _land(self, unit, mine):
        # This rank's [S] now holds the sum over ranks of its slice. The rest of the buffer still
        # holds this rank's local values, which that sum counts already: zero them, so that a
        # later backward adds only new gradients. Keep the sum, not the mean: the next
        # reduce-scatter then adds the new sums to it, and _reduce_grads divides once, at the end.
        unit.grad_shard.copy_(mine)
        unit.grad[:unit.mine.start].zero_()
        unit.grad[unit.mine.stop:].zero_()

    def _reduce_grads(self):
        if not self._reduced:
            super()._reduce_grads()
            for unit in self.units:
                unit.grad_shard.div_(self.world)  # the sum over ranks / N: the global-batch mean

    def _sum_of_squares(self):
        # Each rank holds 1/N of the gradient: add up the squares of all shards first.
        squares = super()._sum_of_squares()
        dist.all_reduce(squares)
        self._sent("all_reduce", squares)
        return squares

    def _gather_params(self):
        for unit in self.units:
            # In place: each rank contributes its freshly stepped shard, which is already a slice
            # of flat, and receives everyone else's.
            all_gather(unit.flat, unit.shard)
            self._sent("all_gather", unit.flat)

    def _full_master(self, unit):
        if unit.master is unit.shard:  # fp32: the flat buffer already holds every rank's stepped shard
            return _wide(unit.flat)
        return self._gather_master(unit)

    def _gather_master(self, unit):
        full = torch.empty(unit.flat.numel(), dtype=unit.master.dtype, device=unit.master.device)
        all_gather(full, unit.master)  # [N*S] <- every rank's [S]
        self._sent("all_gather", full)
        return _wide(full)


# ----------------------------------------------------------------------------------------------
# Stage 2: shard the gradients

class ZeRO2(ZeRO1):
    """Changes vs ZeRO1: the full gradient no longer lives between steps. As soon as backward has
    produced every gradient of a unit, that unit's gradient is reduce-scattered, this rank adds its
    [S] into a persistent gradient shard, and the full [N*S] buffer is freed. Memory
    2Ψ + 14Ψ/N (paper); communication unchanged, but reduce-scatters run during backward.

    Timing is the whole point (THEORY.md): a "ZeRO-2" that reduce-scatters after backward has
    finished holds every full gradient at the peak and saves nothing. Trade-off: with gradient
    accumulation every backward call now communicates (stages 0 and 1 can defer to the last
    micro-batch with no_sync(); here that would keep the full gradient)."""

    stage = 2
    _grad_views = False  # the buffer is freed once reduced: p.grad must not keep it alive

    def _shard(self, unit):
        unit.shard = unit.master = unit.flat[unit.mine]
        unit.grad = None                                # allocated per backward, freed when reduced
        unit.grad_shard = torch.zeros_like(unit.shard)  # [S] accumulates over backward calls

    def _on_grad(self, unit, p):
        if unit.grad is None:
            unit.grad = torch.zeros_like(unit.flat)     # [N*S], lives only until the unit is complete
            self._track_peak(unit)
        super()._on_grad(unit, p)

    def _reduce_in_backward(self):
        return True  # always, overlap or not, no_sync or not: it is what frees the full gradient

    def _reduce_unit(self, unit):
        super()._reduce_unit(unit)  # the same reduce-scatter as ZeRO1, launched during backward
        unit.grad = None  # dropped here; the reduced slice keeps the [N*S] buffer until it lands
        self._track_peak(unit)  # (or it has landed already, and the buffer is gone)

    def _land(self, unit, mine):
        unit.grad_shard.add_(mine)  # the sum over ranks, added up over backward calls; / N at the end


# ----------------------------------------------------------------------------------------------
# Stage 3: shard the parameters

class ZeRO3(ZeRO2):
    """Changes vs ZeRO2: each unit keeps only its [S] shard of the parameters. A hook all-gathers
    the unit right before its module computes in forward and frees it right after; it is gathered
    again right before the module's backward and freed once its gradient is reduce-scattered.
    At any moment only the unit computing is gathered (with overlap, also the next one, being
    prefetched), never the whole model. Memory 16Ψ/N (paper); communication
    3Ψ (N-1)/N: the parameters are all-gathered twice per step instead of once.

    The root unit (parameters outside every unit, e.g. embedding and final norm) stays gathered
    from the start of forward to the end of backward, as FSDP2 does for its root: backward would
    need it again at once. That saves one of its all-gathers per step."""

    stage = 3

    def __init__(self, model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        # Which units each module computes with. Usually just its own; a module whose weight is
        # tied to another unit's (an output head sharing the embedding) needs that unit too.
        owner = {p: u for u in self.units for p in u.params}
        needs = {model: [u for u in self.units if not u.modules]}
        for m in self.unit_modules:
            needs[m] = list(dict.fromkeys(owner[p] for p in m.parameters() if p in owner))
        # Prefetch: the order in which modules gather their units, recorded in the first forward.
        self._order, self._calls, self._open = None, [], []
        model.register_forward_pre_hook(self._start_forward)
        for module, units in needs.items():
            if units:
                module.register_forward_pre_hook(functools.partial(self._pre_forward, units))
                module.register_forward_hook(functools.partial(self._post_forward, units))

    def _buckets(self, groups):
        return groups  # the unit is what a module gathers to compute: no merging in stage 3

    def _shard(self, unit):
        super()._shard(unit)
        unit.shard = unit.master = unit.shard.clone()  # [S] in storage of its own: survives the free
        self._free(unit)

    def _gather(self, unit, prefetch=False):
        if unit.flat.untyped_storage().nbytes() == 0:
            unit.flat.untyped_storage().resize_(unit.flat.numel() * unit.flat.element_size())
            unit.work = all_gather(unit.flat, unit.shard, async_op=prefetch)  # [N*S] <- N x [S]
            self._sent("all_gather", unit.flat)
            self._track_peak(unit)
        if unit.work is not None and not prefetch:  # needed now: wait for the prefetch to land
            unit.work.wait()
            unit.work = None

    def _prefetch(self, call):
        # Overlap: start gathering the units of the module that computes next (call + 1 in
        # forward, call - 1 in backward) while this one computes. Costs one more unit of memory.
        if self.overlap and self._order and 0 <= call < len(self._order):
            for u in self._order[call]:
                self._gather(u, prefetch=True)

    def _start_forward(self, model, args):
        if self._order is None and self._calls:
            self._order = self._calls  # the first forward's order serves every later step
        self._calls = []

    def _free(self, unit):
        # Gotcha: `p.data = torch.empty(0)` would not free anything while autograd still holds
        # the parameter for backward. Shrinking the storage itself frees the memory under every
        # view and saved tensor at once; _gather re-allocates it and refills it in place, so what
        # autograd saved sees the gathered values again in backward.
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        unit.flat.untyped_storage().resize_(0)
        self._track_peak(unit)

    def _pre_forward(self, units, module, args):
        call = len(self._calls)  # this module's place in the order of gathers
        self._calls.append(units)
        self._open.append(call)
        for u in units:
            u.users += 1
            self._gather(u)
        self._prefetch(call + 1)

    def _post_forward(self, units, module, args, output):
        call = self._open.pop()
        training = torch.is_grad_enabled()
        for u in units:
            u.users -= 1
            if u.users == 0 and not (training and not u.modules):  # keep the root for backward
                self._free(u)
        tensors = [t for t in _tensors(output) if t.requires_grad]
        if training and tensors:  # fires when backward reaches this module's output: gather again
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(self._pre_backward, units, call), mode="any")

    def _pre_backward(self, units, call, grad):
        for u in units:
            self._gather(u)
        self._prefetch(call - 1)

    def _reduce_unit(self, unit):
        super()._reduce_unit(unit)
        if unit.users == 0:
            self._free(unit)  # its gradient is complete, so backward is done with its parameters

    def _end_of_backward(self):
        super()._end_of_backward()
        for unit in self.units:  # the root, and units gathered for a backward that gave no grads
            if unit.users == 0:
                self._free(unit)

    def _full_master(self, unit):
        return self._gather_master(unit)  # parameters are sharded between steps: gather the masters

    def _gather_params(self):
        # Nothing to gather after the step: the next forward gathers each unit when it needs it.
        # A unit still gathered (a forward that had no backward) now holds stale values: free it.
        for unit in self.units:
            if unit.users == 0:
                self._free(unit)


def _grad_hook(zero_ref, i, p):
    # Gotcha: a parameter keeps its hooks in C++, where Python's garbage collector cannot see
    # them, so a hook holding the ZeRO object (or a unit, which holds the parameters) would keep
    # the whole model state alive for ever. The hook holds a weak reference and a unit number.
    self = zero_ref()
    if self is not None:
        self._on_grad(self.units[i], p)


def _cast_inputs(dtype, module, args):
    return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _tensors(x):
    """The tensors inside a module's output (a tensor, or tuples, lists and dicts of them)."""
    if torch.is_tensor(x):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    return [t for item in x for t in _tensors(item)] if isinstance(x, (list, tuple)) else []


STAGES = [DataParallel, ZeRO1, ZeRO2, ZeRO3]


def wrap(model, stage, optimizer, units=None, param_dtype=None, reduce_dtype=None, overlap=True, bucket_bytes=0):
    """Shard `model` (changed in place, as FSDP2's fully_shard does) for ZeRO `stage` over the
    default process group and return the optimizer to train it with.

    optimizer: builds a torch optimizer from a list of tensors, e.g. partial(torch.optim.AdamW, lr=1e-3);
    the torch optimizer itself is `.optimizer` (attach LR schedulers to that).
    units: the modules communicated as one (stage 3 gathers them one by one); default_units(model).
    param_dtype: e.g. torch.bfloat16 for mixed precision; reduce_dtype: of the gradient reductions
    (default float32 in mixed precision). overlap: reduce during backward, prefetch in stage 3.
    bucket_bytes: stages 0-2 cut the parameters into buckets of this many bytes, from the last
    backwards, merging small units and splitting large ones at parameter boundaries (0: every
    unit is its own bucket); stage 3 gathers unit by unit and ignores it."""
    if stage not in range(len(STAGES)):
        raise ValueError(f"zero: stage must be 0, 1, 2 or 3, not {stage!r}")
    if not dist.is_initialized():
        setup()
    return STAGES[stage](model, optimizer, units=units, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                         overlap=overlap, bucket_bytes=bucket_bytes)


# ----------------------------------------------------------------------------------------------
# Checkpoint files: sharded, atomic, and readable at any stage and world size
#
#   DIR/step_00000010/rank_00000.pt ... rank_00003.pt   each rank's state_dict(), in parallel
#   DIR/step_00000010/manifest.json                     rank 0, last: stage, N, Ψ, names and
#                                                       shapes, every file's size and sha256
#
# A checkpoint is complete when its manifest exists. Every file is written under a temporary
# name, fsync'ed and renamed (a rename is atomic), and the manifest only after every rank's file
# is on disk, so a job killed in the middle of a save leaves the previous checkpoint as it was
# and an incomplete directory that loading skips. The newest `keep` complete ones are kept, and
# always the one just written. Only the names save_checkpoint writes (step_ and the step in 8 or
# more digits) are checkpoints: anything else in DIR is never read, nor deleted.
#
# One job per DIR (ckpt_dir_lock): two jobs in one directory delete each other's checkpoints.
# The manifest is data, not instructions: a reader opens only the files a writer of its
# world_size would have written (rank_<r>.pt, r < N), only if they are regular files, and checks
# that each one holds the part of its own rank.

FORMAT = "zero.py sharded checkpoint, version 1"


def _atomic_write(path, write):
    """write(f) into a temporary file, then rename it to path. If the writing or the rename
    fails, the temporary file is removed and path is as it was."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name says they are there
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(path))  # and so is the rename


def _is_temporary(name):
    """A name _atomic_write gives its temporary files: NAME.tmp<pid>."""
    stem, _, pid = name.rpartition(".tmp")
    return bool(stem) and pid.isascii() and pid.isdigit()


def _fsync_dir(path):
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _json_lines(d):  # a key a line
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in d.items()) + "\n}\n"


def _step_of(name):
    """The step of a checkpoint directory's name, step_00000010 -> 10; None for any other name
    (step_00000010.bak, step_, step_10, a file's name...)."""
    digits = name[5:]
    if name.startswith("step_") and digits.isascii() and digits.isdigit():
        if name == f"step_{int(digits):08d}":
            return int(digits)
    return None


def _steps(root):
    """{step: directory} of the complete checkpoints under root."""
    try:
        names = os.listdir(root) if os.path.isdir(root) else []
    except OSError as e:
        raise CheckpointError(f"{root}: cannot be listed ({e.strerror})") from None
    found = {}
    for name in names:
        step = _step_of(name)
        if step is not None and os.path.exists(os.path.join(root, name, "manifest.json")):
            found[step] = os.path.join(root, name)
    return found


def latest_checkpoint(root):
    """The newest complete checkpoint directory under root, or None."""
    found = _steps(root)
    return found[max(found)] if found else None


def choose_checkpoint(root, device):
    """latest_checkpoint(root) as rank 0 sees it, on every rank (a collective). Each rank listing
    root on its own could resume two ranks from two checkpoints, when one completes between their
    listings."""
    mine, error = -1, None
    if dist.get_rank() == 0:
        try:
            mine = max(_steps(root), default=-1)
        except CheckpointError as e:
            mine, error = -2, e
    choice = torch.tensor([mine], dtype=torch.int64, device=device)
    dist.broadcast(choice, src=0)
    step = choice.item()
    if step == -2:
        raise error or CheckpointError(f"{root}: rank 0 cannot list it")
    return None if step < 0 else os.path.join(root, f"step_{step:08d}")


def _first_error(error, device):
    """Every rank's error message ("": none) to every rank, in one small all-gather, and the first
    of them, or "". What lets all ranks raise together: none is left waiting in a collective."""
    text = error.encode()[:512]
    rows = _all_ranks(list(text.ljust(512, b"\0")), device, dtype=torch.uint8)
    errors = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows]
    return next((e for e in errors if e), "")


def _lock_holder(fd):
    """' (process PID)' if /proc/locks names the process that holds a flock on fd's file."""
    st = os.fstat(fd)
    file = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with contextlib.suppress(OSError, IndexError):
        with open("/proc/locks") as f:  # 1: FLOCK  ADVISORY  WRITE 5833 fe:00:2146937 0 EOF
            for fields in map(str.split, f):
                if fields[1] == "FLOCK" and fields[5] == file:
                    return f" (process {fields[4]})"
    return ""


@contextlib.contextmanager
def ckpt_dir_lock(root, device):
    """Make `root` (created if missing) this job's checkpoint directory while in this block; every
    rank enters it (a collective). A directory that is a file or not writable, or in use by
    another job, is a UsageError on every rank, before any training.

    One job per directory: rank 0 holds an exclusive flock on the directory itself (no lock file
    to leave behind). The kernel drops it when the process ends, however it ends, so a job that
    died, or the group torchrun --max-restarts stops before it starts a new one, never blocks
    the next. (Where the file system has no flock, a warning, and nothing stops a second job.)"""
    import fcntl
    fd, error = None, ""
    try:
        if os.path.exists(root) and not os.path.isdir(root):
            raise UsageError(f"checkpoint directory {root}: exists and is not a directory")
        os.makedirs(root, exist_ok=True)
        if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
            raise UsageError(f"checkpoint directory {root}: not writable")
        if dist.get_rank() == 0:
            fd = os.open(root, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UsageError(f"checkpoint directory {root}: in use by another job"
                                 f"{_lock_holder(fd)}; one job per directory") from None
            except OSError as e:
                print(f"warning: checkpoint directory {root} cannot be locked ({e.strerror}): "
                      "make sure that no other job uses it", file=sys.stderr, flush=True)
    except UsageError as e:
        error = str(e)
    except OSError as e:
        error = f"checkpoint directory {root}: {e.strerror or e}"
    error = _first_error(error, device)
    try:
        if error:
            raise UsageError(error)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # the lock goes with the last descriptor of its open file


def _remove_quietly(path):
    with contextlib.suppress(OSError):
        os.remove(path)


def _rotate(root, step, keep):
    """Rank 0, after a save: delete the checkpoints, complete or not, older than the newest `keep`
    complete ones, but never the one just written (`step`, even if older), and the temporary
    files that saves killed midway left in the checkpoints kept."""
    found = sorted(_steps(root))
    if not found:
        return
    kept = set(found[-keep:]) | {step}
    for name in os.listdir(root):
        s = _step_of(name)
        if s is not None and s < min(found[-keep:]) and s not in kept:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for s in kept:
        path = os.path.join(root, f"step_{s:08d}")
        for name in filter(_is_temporary, os.listdir(path)):
            _remove_quietly(os.path.join(path, name))


def save_checkpoint(opt, root, step, extra=None, keep=2):
    """Write opt's checkpoint for `step` under root (every rank calls this; a collective). If a
    rank cannot write (a full disk...), every rank raises CheckpointError, what this save wrote
    is removed, and the checkpoints written before are as they were."""
    path = os.path.join(root, f"step_{step:08d}")
    name = os.path.join(path, f"rank_{opt.rank:05d}.pt")
    manifest_path = os.path.join(path, "manifest.json")
    device = opt.units[0].flat.device

    def failed(error):  # "" if no rank failed; else every rank removes what this save wrote
        if error:
            _remove_quietly(name)  # (a manifest that failed is never renamed into place)
            if opt.rank == 0:
                with contextlib.suppress(OSError):
                    os.rmdir(path)  # if nothing else is left in it
            raise CheckpointError(f"step {step} not saved: {error}; the checkpoints written "
                                  "before it are intact")

    size, digest, error = 0, bytes(32), ""
    try:
        os.makedirs(path, exist_ok=True)
        _fsync_dir(root)  # the new directory's name is on disk before old checkpoints are deleted
        _atomic_write(name, lambda f: torch.save(opt.state_dict(), f))
        size, digest = os.path.getsize(name), bytes.fromhex(_sha256(name))  # 32 bytes
    except (OSError, RuntimeError) as e:  # torch.save reports some failed writes as RuntimeError
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        error = f"rank {opt.rank}: {getattr(e, 'filename', None) or name}: {reason}"
    failed(_first_error(error, device))
    # Rank 0 lists every file's size and hash in the manifest: one small all-gather, and it is
    # also the barrier that makes every rank's file durable before the manifest is written.
    rows = _all_ranks([size, *digest], device)
    error = ""
    if opt.rank == 0:
        files = {f"rank_{r:05d}.pt": [row[0], bytes(row[1:]).hex()] for r, row in enumerate(rows)}
        aliases = {id(p): n for n, p in opt.model.named_parameters()}  # tied: the first name
        keys = {n: aliases[id(p)] for n, p in opt.model.named_parameters(remove_duplicate=False)
                if p.requires_grad}
        manifest = {"format": FORMAT, "step": step, **opt.layout(),
                    "optimizer": type(opt.optimizer).__name__,
                    "keys": [[k, keys.get(k, k)] for k in opt.model.state_dict()], "files": files,
                    "extra": extra or {}}
        try:
            _atomic_write(manifest_path, lambda f: f.write(_json_lines(manifest).encode()))
        except OSError as e:
            error = f"rank 0: {manifest_path}: {e.strerror or e}"
        else:
            with contextlib.suppress(OSError, CheckpointError):
                _rotate(root, step, keep)
    # nobody goes on (or dies) believing a save is complete before it is
    failed(_first_error(error, device))


def _count(x, least=0):
    return type(x) is int and x >= least  # an int, and not a bool


def _is_shape(x):
    return isinstance(x, list) and all(map(_count, x))


def _manifest_problem(m):
    """What is wrong with a manifest's contents, or None. Everything a reader uses is checked."""
    if not _count(m.get("step")):
        return f"'step' is {m.get('step')!r}, not a step number"
    if not (_count(m.get("stage")) and m["stage"] < 4):
        return f"'stage' is {m.get('stage')!r}, not 0, 1, 2 or 3"
    n = m.get("world_size")
    if not _count(n, 1):
        return f"'world_size' is {n!r}, not a number of ranks"
    units, replicated = m.get("units"), m.get("replicated")
    if not (isinstance(units, list) and all(isinstance(u, list) for u in units) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and _is_shape(p[1])
            for u in units for p in u)):
        return "'units' is not a list, per unit, of [name, shape] (a shape: a list of ints >= 0)"
    if not (isinstance(replicated, dict) and all(map(_is_shape, replicated.values()))):
        return "'replicated' is not a dictionary {name: shape}"
    psi = sum(_numel(s) for u in units for _, s in u)
    if m.get("psi") != psi:
        return f"'psi' is {m.get('psi')!r}, its units hold {psi} elements"
    names = {name for u in units for name, _ in u} | set(replicated)
    keys = m.get("keys")
    if not (isinstance(keys, list) and all(isinstance(k, list) and len(k) == 2 and
                                           all(isinstance(x, str) for x in k) and k[1] in names
                                           for k in keys)):
        return "'keys' is not a list of [state_dict key, name of a parameter or buffer]"
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        return "'files' is missing or empty"
    want = {f"rank_{r:05d}.pt" for r in range(n)} if len(files) == n else set()
    if set(files) != want:
        named = ", ".join(map(repr, sorted(files)))
        return (f"'files' must be exactly rank_00000.pt ... rank_{n - 1:05d}.pt (world_size {n}), "
                f"not {named[:200]}")
    for file, entry in files.items():
        if not (isinstance(entry, list) and len(entry) == 2 and _count(entry[0]) and
                isinstance(entry[1], str) and len(entry[1]) == 64 and
                set(entry[1]) <= set("0123456789abcdef")):
            return f"'files' entry {file}: not [size, sha256 in hex]"
    if not isinstance(m.get("extra"), dict):
        return "'extra' is missing or not a dictionary"
    return None


def _part_problem(part, r, manifest):
    """What is wrong with the part of rank r (its own rank field, its units' sizes), or None."""
    if not isinstance(part, dict):
        return "not a checkpoint part"
    if part.get("rank") != r:
        return (f"holds the part of rank {part.get('rank')!r}, not of rank {r} "
                "(files swapped or renamed?)")
    units = part.get("units")
    if not isinstance(units, list) or len(units) != len(manifest["units"]):
        return f"does not hold the {len(manifest['units'])} unit(s) the manifest lists"
    for i, (unit, params) in enumerate(zip(units, manifest["units"])):
        size = -(-sum(_numel(s) for _, s in params) // manifest["world_size"])
        state = unit.get("state") if isinstance(unit, dict) else None
        tensors = [unit.get("master"), *state.values()] if isinstance(state, dict) else [None]
        if not all(torch.is_tensor(t) and t.dim() == 1 and t.numel() == size for t in tensors):
            return f"unit {i}: not {size} elements of master weights and of each optimizer state"
    replicated = part.get("replicated")
    if not isinstance(replicated, dict) or not all(map(torch.is_tensor, replicated.values())):
        return "'replicated' is not a dictionary of tensors"
    if r == 0 and {n: list(t.shape) for n, t in replicated.items()} != manifest["replicated"]:
        return "its frozen parameters and buffers are not the ones the manifest lists"
    return None


def _regular_size(file, missing):
    """The size of `file`, a regular file: opening a FIFO (or a device) could wait for ever."""
    import stat
    try:
        st = os.stat(file)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: {missing}") from None
    except OSError as e:
        raise CheckpointError(f"{file}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{file}: not a regular file")
    return st.st_size


def read_checkpoint(path, verify=None):
    """The manifest and every rank's part of the checkpoint in directory `path`, each part
    checked against the manifest's size (and sha256, for the ranks in `verify`; None: all) and
    read with torch.load(weights_only=True): a file cannot run code. mmap: a part's bytes are
    read from disk only where they are used. No process group needed. Anything wrong, in the
    manifest or in a part, is a CheckpointError that says what."""
    if path is None:
        raise CheckpointError("no checkpoint path was given (None: latest_checkpoint() returns "
                              "None where there is no complete checkpoint)")
    manifest_path = os.path.join(path, "manifest.json")
    _regular_size(manifest_path, "missing: no manifest.json, not a complete checkpoint")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{manifest_path}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: not a {FORMAT!r} manifest")
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"{manifest_path}: {problem}")
    n, parts = manifest["world_size"], []
    for r in range(n):
        file = os.path.join(path, f"rank_{r:05d}.pt")
        size, digest = manifest["files"][os.path.basename(file)]
        found = _regular_size(file, f"missing (rank {r} of {n} wrote it)")
        if found != size:
            raise CheckpointError(f"{file}: {found} bytes, the manifest says {size}: "
                                  "truncated or overwritten")
        try:
            if (verify is None or r in verify) and _sha256(file) != digest:
                raise CheckpointError(f"{file}: its sha256 differs from the manifest's: "
                                      "the file is corrupt")
            part = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except CheckpointError:
            raise
        except OSError as e:
            raise CheckpointError(f"{file}: {e.strerror or e}") from None
        except Exception as e:  # weights_only refuses anything but plain tensors and containers
            raise CheckpointError(f"{file}: cannot be read ({str(e).splitlines()[0]})") from None
        problem = _part_problem(part, r, manifest)
        if problem:
            raise CheckpointError(f"{file}: {problem}")
        parts.append(part)
    return manifest, parts


def load_checkpoint(opt, path):
    """Load the checkpoint in directory `path` into opt, whatever stage and world size wrote it,
    and return its manifest (step, extra). Every rank calls this; if any rank finds a problem,
    every rank raises CheckpointError and nothing has changed. Each rank checks the hashes of
    1/N of the files (rank r: files r, r+N, ...), so the whole checkpoint is read once, not N
    times. The optimizer's hyper-parameters (lr...) are the checkpoint's."""
    error = ""
    try:
        manifest, parts = read_checkpoint(path, verify=range(opt.rank, 1 << 30, opt.world))
        opt._check_checkpoint(parts, manifest)
    except CheckpointError as e:
        error = str(e)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:  # other contents
        error = f"{path}: not laid out as this code writes checkpoints ({type(e).__name__}: {e})"
    # Agree before anyone changes anything (or waits alone in a collective): every rank's error,
    # up to 512 bytes of it, goes to every rank, and all raise the first one.
    error = _first_error(error[:500], opt.units[0].flat.device)
    if error:
        raise CheckpointError(error)
    opt.load_state_dict(parts, manifest)
    return manifest


def consolidate(path, out):
    """Write one plain state_dict, {key: full fp32 (or fp64) tensor} for every key of the model's
    own state_dict(), from the sharded checkpoint in `path`: what model.load_state_dict() takes.
    One process, no process group, any stage and world size. A checkpoint that is not right is a
    CheckpointError, a file `out` that cannot be written a UsageError; neither leaves a file."""
    manifest, parts = read_checkpoint(path)
    try:
        full = dict(parts[0]["replicated"])
        for i, params in enumerate(manifest["units"]):
            flat = torch.cat([part["units"][i]["master"] for part in parts])  # [N*S]: each rank's S
            o = 0
            for name, shape in params:
                full[name], o = flat[o:o + _numel(shape)].view(shape).clone(), o + _numel(shape)
        state = {key: full[name] for key, name in manifest["keys"]}
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not laid out as this code writes checkpoints "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
    try:
        _atomic_write(out, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise UsageError(f"{out}: cannot be written ({reason})") from None
    return manifest


# ----------------------------------------------------------------------------------------------
# The formulas (THEORY.md), to print next to what is measured

STAGE_NAMES = ["data parallel: nothing sharded", "ZeRO-1: optimizer state sharded",
               "ZeRO-2: optimizer state + gradients sharded", "ZeRO-3: optimizer state + gradients + parameters sharded"]


def memory_formula(stage, psi, world, param_bytes=4, grad_bytes=4, optim_bytes=8):
    """Model-state bytes per rank: stage >= 1 shards the optimizer state, >= 2 the gradients,
    3 the parameters. Defaults: fp32 AdamW (m and v: K = 8). The paper: 2, 2, 12."""
    return {"params": param_bytes * psi / (world if stage >= 3 else 1),
            "grads": grad_bytes * psi / (world if stage >= 2 else 1),
            "optimizer": optim_bytes * psi / (world if stage >= 1 else 1)}


def comm_formula(stage, psi, world, gather_bytes=4, reduce_bytes=4, micro_batches=1):
    """Bytes one rank sends per optimizer step (ring algorithms), by collective. With k micro-batches
    stages 0 and 1 reduce once (all but the last in no_sync()), stages 2 and 3 reduce-scatter in
    every backward, and stage 3 gathers in every forward and backward."""
    ring, k = (world - 1) / world * psi, micro_batches
    g, r = ring * gather_bytes, ring * reduce_bytes
    return [{"all_reduce": 2 * r},
            {"reduce_scatter": r, "all_gather": g},
            {"reduce_scatter": k * r, "all_gather": g},
            {"reduce_scatter": k * r, "all_gather": 2 * k * g}][stage]


def estimate(psi, world):
    """Per-rank model-state memory for each stage, from the formula alone: no model, no ranks."""
    print(f"ZeRO model-state memory per rank (formula, THEORY.md / paper Figure 1)\n"
          f"Ψ = {psi:.4g} parameters, N = {world} ranks, mixed-precision Adam: 2 + 2 + 12 bytes "
          f"per parameter, GB = 1e9 bytes\n")
    print(f"{'stage':<32} {'params':>10} {'grads':>10} {'optimizer':>10} {'total':>10}   communication per step")
    traffic = ["2Ψ(N-1)/N", "2Ψ(N-1)/N", "2Ψ(N-1)/N", "3Ψ(N-1)/N"]
    for stage in range(4):
        m = {k: v / 1e9 for k, v in memory_formula(stage, psi, world, 2, 2, 12).items()}
        elements = sum(comm_formula(stage, psi, world, 1, 1).values())
        print(f"{stage} {STAGE_NAMES[stage].split(':')[0]:<30} {m['params']:>7.2f} GB {m['grads']:>7.2f} GB "
              f"{m['optimizer']:>7.2f} GB {sum(m.values()):>7.1f} GB   {traffic[stage]} = {elements:.3g} elements")


# ----------------------------------------------------------------------------------------------
# The demo model and data: a small byte-level GPT trained on the bytes of this very file, so that
# nothing is downloaded and the loss visibly falls from ln(256) = 5.55 within a minute on CPU.

class Block(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
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
    """Byte-level GPT. The blocks are the stage-3 units; the token embedding (tied to the output
    head: one parameter, used twice), the position embedding and the final norm form the root
    unit."""

    def __init__(self, seq_len=64, d_model=64, n_layer=4, n_head=4, vocab=256):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d_model), nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():  # GPT-2's init: small weights, so the first loss is about ln(256)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):  # idx: [B, T] byte values -> logits [B, T, vocab]
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def get_batch(data, step, micro, rank, world, batch_size, seq_len, seed):
    """This rank's rows of the global batch for (step, micro-batch): rank r takes rows
    [r*B, (r+1)*B) of N*B windows drawn from one seeded generator, so every stage sees the same
    global batch and a single process fed all N*B rows is the exact reference."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + micro)
    starts = torch.randint(len(data) - seq_len - 1, (world * batch_size,), generator=g)
    mine = starts[rank * batch_size:(rank + 1) * batch_size]
    rows = torch.stack([data[s:s + seq_len + 1] for s in mine])
    return rows[:, :-1], rows[:, 1:]  # inputs [B, T], targets [B, T]: the next byte


# ----------------------------------------------------------------------------------------------
# Training and the report: one line per step from rank 0, and a closing table of what each rank
# held and sent, measured, next to the formula.

def box(rows):
    width = max(len(k) for k, _ in rows), max(len(str(v)) for _, v in rows)
    line = f"+-{'-' * width[0]}-+-{'-' * width[1]}-+"
    body = [f"| {k:<{width[0]}} | {str(v):<{width[1]}} |" for k, v in rows]
    return "\n".join([line] + body + [line])


def adamw(args):
    return functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.1)


def log0(*a, **k):
    if dist.get_rank() == 0:  # one voice: rank 0 prints, the others stay quiet
        print(*a, **k, flush=True)


class Diverged(Exception):
    """The loss or the gradient norm is not finite: training stopped before that step was applied
    (printed as one line, exit code 3)."""


def train(args, build=None, keep_params=False, quiet=False):
    """Train the demo model and return what was measured (gathered from every rank).

    build(model) -> (callable model, optimizer, label) chooses how the model is parallelized; the
    default is zero.wrap. fsdp_demo.py passes PyTorch's own (DDP, ZeroRedundancyOptimizer, FSDP2):
    same model, data, seed, loop and measurements, only the sharding differs.

    With args.ckpt_dir: one job per directory (ckpt_dir_lock), checked before anything is built."""
    rank, world, device = setup(args.backend, args.device, args.timeout)
    ckpt = getattr(args, "ckpt_dir", None)
    with ckpt_dir_lock(ckpt, device) if ckpt else contextlib.nullcontext():
        return _train(args, build, keep_params, quiet, rank, world, device)


def _train(args, build, keep_params, quiet, rank, world, device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # this run's peak only
    torch.manual_seed(args.seed)
    model = GPT(args.seq_len, args.d_model, args.n_layer, args.n_head).to(device)
    if getattr(args, "init_from", None):
        init_from(model, args.init_from)
    if build is None:
        net, opt = model, wrap(model, args.stage, adamw(args), units=model.blocks,
                               param_dtype=torch.bfloat16 if args.bf16 else None,
                               overlap=not args.no_overlap,
                               bucket_bytes=int(args.bucket_mb * 2**20))
        label = f"zero.py stage {args.stage} ({STAGE_NAMES[args.stage]})"
    else:
        net, opt, label = build(model)
    data = torch.frombuffer(bytearray(open(__file__, "rb").read()), dtype=torch.uint8).long()
    log = (lambda *a, **k: None) if quiet else log0
    log(box([("run", label),
             ("world size", f"{world} ({dist.get_backend()}, device {device.type})"),
             ("Ψ", f"{opt.psi:,} trainable parameters"),
             ("model", f"GPT, {args.n_layer} layers, d_model {args.d_model}, {args.n_head} heads, "
                       f"bytes of {os.path.basename(__file__)}"),
             ("dtype, optimizer",
              "bfloat16 compute, float32 master weights and reductions, AdamW" if args.bf16
              else "float32, AdamW (state m, v: 8 bytes per parameter)"),
             ("global batch", f"{world} rank(s) x {args.batch_size} rows x {args.seq_len} bytes x "
                              f"{args.grad_accum} micro-batch(es)")]))
    # Resume: the newest complete checkpoint, whatever stage and world size wrote it, as rank 0
    # sees it (choose_checkpoint). The data position is the step: get_batch() draws step k's
    # global batch from a generator seeded by k. The checkpoint's hyper-parameters are loaded
    # with its state, then --lr is applied: the command line has the last word.
    first, ckpt = 1, getattr(args, "ckpt_dir", None)
    found = choose_checkpoint(ckpt, device) if ckpt else None
    if found:
        manifest = load_checkpoint(opt, found)
        first = manifest["step"] + 1
        loaded_lr = opt.optimizer.param_groups[0]["lr"]
        for group in opt.optimizer.param_groups:
            group["lr"] = args.lr
        log(f"resumed from {found}: step {manifest['step']}, written at stage {manifest['stage']} "
            f"by {manifest['world_size']} rank(s)" +
            (f"; its hyper-parameters loaded, then --lr {args.lr:g} applied (it had {loaded_lr:g})"
             if loaded_lr != args.lr else ""))
        if manifest["extra"].get("data") != data_position(args, world):
            log(f"note: the data stream differs from the checkpoint's "
                f"({manifest['extra'].get('data')}, now {data_position(args, world)}): "
                "training goes on, on other batches")
    # zero.py counts its own calls as it makes them (_sent); fsdp_demo.py's PyTorch runs count
    # theirs at the dispatcher, inside this context, which leaves out the loss's all-reduce.
    counting = opt.counting if hasattr(opt, "counting") else contextlib.nullcontext
    times, losses, sent, mem, start = [], [], [], None, Counter(opt.comm)
    last_good = found  # the newest checkpoint known to hold finite values
    skip, skipped = getattr(args, "skip_nonfinite", False), 0
    if first > args.steps:
        log(f"nothing left to train: the checkpoint is at step {first - 1}, "
            f"--steps is {args.steps}")
        return None
    for step in range(first, args.steps + 1):
        t0, sent0 = time.perf_counter(), sum(opt.comm.values())
        loss_sum = torch.zeros((), device=device)
        counted = counting()  # one per step, entered twice: the check between is not counted
        with counted:
            for micro in range(args.grad_accum):
                x, y = get_batch(data, step, micro, rank, world, args.batch_size, args.seq_len,
                                 args.seed)
                # all micro-batches but the last accumulate locally: one reduction per step
                with opt.no_sync() if micro < args.grad_accum - 1 else contextlib.nullcontext():
                    logits = net(x.to(device)).float()
                    loss = F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten())
                    loss = loss / args.grad_accum
                    loss.backward()
                loss_sum += loss.detach()
            # The global gradient norm, the same on every rank: clipped to --clip, or with
            # --clip 0 only measured (a scale of exactly 1), for the check below.
            norm = opt.clip_grad_norm_(args.clip if args.clip > 0 else float("inf"))
        # Divergence: a non-finite loss or gradient norm is never applied, so never saved. The
        # loss of the global batch (all-reduced: every rank decides the same) and the norm are
        # checked before the step; the run stops there (or, --skip-nonfinite, drops the step).
        dist.all_reduce(loss_sum)
        loss, norm = loss_sum.item() / world, norm.item()
        inf = float("inf")
        finite = abs(loss) < inf and abs(norm) < inf  # False for nan too
        if not finite and not skip:
            what = " and ".join(f"the {name} is {value:g}" for name, value in
                                (("loss", loss), ("gradient norm", norm)) if not abs(value) < inf)
            saved = last_good or ("none written" if ckpt else "none (no --ckpt-dir)")
            raise Diverged(f"step {step}: {what}; stopped before this step was applied. Last good "
                           f"checkpoint: {saved} (try a lower --lr, or --skip-nonfinite)")
        if finite:
            with counted:
                opt.step()
        else:
            skipped += 1
        mem = opt.memory_breakdown()  # after the step, before zero_grad: every kind of state held
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        sent.append(sum(opt.comm.values()) - sent0)
        losses.append(loss)
        log(f"step {step:4d} | loss {loss:.6f} | {times[-1] * 1e3:8.1f} ms | "
            f"sent {sent[-1] / 1e6:8.4f} MB" + (f" | grad norm {norm:.4f}" if args.clip > 0 else "")
            + ("" if finite else " | not finite: skipped, the weights are unchanged"))
        if ckpt and (step == args.steps or (args.ckpt_every and step % args.ckpt_every == 0)):
            save_checkpoint(opt, ckpt, step, extra={"data": data_position(args, world)})
            last_good = os.path.join(ckpt, f"step_{step:08d}")
    if skipped:
        log(f"{skipped} step(s) of {len(times)} skipped: loss or gradient norm not finite")
    # Every rank's measurements: params, grads, optimizer held; the same at their peak; CUDA's
    # peak (-1: none).
    kinds = ("params", "grads", "optimizer")
    cuda_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else -1
    row = [mem[k] for k in kinds] + [opt.peak.get(k, -1) for k in kinds] + [cuda_peak]
    ranks = _all_ranks(row, device)
    most = [max(column) for column in zip(*ranks)]
    return {"label": label, "stage": args.stage, "psi": opt.psi, "world": world, "losses": losses,
            "times": times, "sent": sent,
            "comm": {k: (v - start[k]) / len(times) for k, v in opt.comm.items()},
            "mem": dict(zip(kinds, most[:3])),
            "peak": dict(zip(kinds, most[3:6])) if most[3] >= 0 else None,
            "cuda_peak": [row[6] for row in ranks] if cuda_peak >= 0 else None,
            "full": opt.full_state_dict() if keep_params else None}


def data_position(args, world):
    """What decides which rows step k trains on; equal in a resumed run means the same batches."""
    return {"seed": args.seed, "global_rows": world * args.batch_size, "seq_len": args.seq_len,
            "grad_accum": args.grad_accum, "data": os.path.basename(__file__)}


def init_from(model, path):
    """Start from a plain state_dict file (what --consolidate writes, or
    torch.save(model.state_dict()))."""
    try:
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as e:  # a missing or unreadable file, or weights for another model
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise UsageError(f"--init-from {path}: {' '.join(lines)[:300]}") from None


def report(res, args):
    psi, stage, world, k = res["psi"], res["stage"], res["world"], args.grad_accum
    pb, gb, ob = (2, 2, 12) if args.bf16 else (4, 4, 8)  # bytes per parameter: the paper's, or fp32
    formula = memory_formula(stage, psi, world, pb, gb, ob)
    labels = {"params": f"{pb}Ψ" + "/N" * (stage >= 3), "grads": f"{gb}Ψ" + "/N" * (stage >= 2),
              "optimizer": f"{ob}Ψ" + "/N" * (stage >= 1)}
    peak = res["peak"] or {}
    log0(f"\nmodel state per rank, bytes (measured: largest over the {world} ranks, after the step;"
         f" formula: {'mixed-precision' if args.bf16 else 'fp32'} AdamW)")
    log0(f"  {'':<10} {'measured':>12}   {'formula':<10} {'':>12}   {'peak during a step':>18}")
    for kind in ("params", "grads", "optimizer"):
        log0(f"  {kind:<10} {res['mem'][kind]:>12,}   {labels[kind]:<10} {formula[kind]:>12,.0f}"
             f"   {format(peak[kind], ',') if peak else 'not measured':>18}")
    total = [f"{pb + gb + ob}Ψ", f"{pb + gb}Ψ + {ob}Ψ/N", f"{pb}Ψ + {gb + ob}Ψ/N",
             f"{pb + gb + ob}Ψ/N"][stage]
    log0(f"  {'total':<10} {sum(res['mem'].values()):>12,}   {total:<10} "
         f"{sum(formula.values()):>12,.0f}")
    log0("  (measured includes padding and Adam's step counters; 'peak' adds the transient "
         "full-unit\n"
         "   gradients of stages 2 and 3, with their all-to-all receive buffers on gloo/CPU, and "
         "the\n"
         "   gathered units of stage 3)")
    log0(f"\ncommunication per rank per step, bytes (ring cost of the calls made; gathers in {pb} "
         f"bytes, reductions in 4;"
         f" N = {world}, k = {k} micro-batches)")
    expected, comm = comm_formula(stage, psi, world, pb, 4, k), res["comm"]
    names = {"all_reduce": "2Ψ(N-1)/N" if stage == 0 else "-",
             "reduce_scatter": f"{k}·Ψ(N-1)/N" if stage >= 2 else "Ψ(N-1)/N",
             "all_gather": f"{2 * k}·Ψ(N-1)/N" if stage == 3 else "Ψ(N-1)/N"}
    for kind in sorted(set(comm) | set(expected)):
        log0(f"  {kind:<15} {comm.get(kind, 0):>14,.0f}   {names.get(kind, '-'):<12} "
             f"{expected.get(kind, 0):>14,.0f}")
    log0(f"  {'total':<15} {sum(comm.values()):>14,.0f}   {'':<12} "
         f"{sum(expected.values()):>14,.0f}")
    if stage == 3:
        log0("  (stage 3: the root unit stays gathered from forward into backward, one all-gather "
             "fewer)")
    if stage > 0 and DIRECT and dist.get_backend() == "gloo" and res["cuda_peak"] is None:
        log0(f"  (gloo on CPU: reduce_scatter runs as an all_to_all + local sum (N reduces above "
             f"{A2A_BYTES >> 20} MB),"
             "\n   all_gather as N broadcasts: the same bytes per rank, in less time; see "
             "reduce_scatter() in zero.py)")
    if comm.get("all_reduce") and stage >= 1:
        log0("  (all_reduce: the sum of squares for clipping by the global gradient norm)"
             if args.clip > 0 else
             "  (all_reduce: the sum of squares for the global gradient norm, checked finite)")
    log0(f"\nmedian step time {statistics.median(res['times']) * 1e3:.1f} ms over "
         f"{len(res['times'])} steps")
    if res["cuda_peak"]:
        log0("torch.cuda.max_memory_allocated per rank: " +
             ", ".join(f"{b / 1e6:.1f} MB" for b in res["cuda_peak"]))


# ----------------------------------------------------------------------------------------------
# Command line: bad input is one line on stderr and exit code 2, never a traceback

class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every option's default: its value, or what the help says None means."""

    def _get_help_string(self, action):
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=_ShowDefaults, **kwargs)

    def error(self, message):
        raise UsageError(message)


def positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return value
    return parse


def training_parser(description):
    p = Parser(description=description)
    p.add_argument("--stage", type=int, default=3, choices=range(4),
                   help="0 data parallel, 1-3 ZeRO")
    p.add_argument("--steps", type=positive(int), default=30, help="optimizer steps to train")
    p.add_argument("--seed", type=int, default=0,
                   help=f"seeds the weights and the batches, 0 to {SEEDS - 1}")
    p.add_argument("--n-layer", type=positive(int), default=4, help="transformer blocks")
    p.add_argument("--d-model", type=positive(int), default=64, help="width")
    p.add_argument("--n-head", type=positive(int), default=4, help="attention heads")
    p.add_argument("--seq-len", type=positive(int), default=64, help="bytes per row")
    p.add_argument("--batch-size", type=positive(int), default=8,
                   help="rows per rank per micro-batch")
    p.add_argument("--grad-accum", type=positive(int), default=1,
                   help="micro-batches (backward calls) per step")
    p.add_argument("--lr", type=positive(float), default=3e-3,
                   help="AdamW's learning rate; applied also when resuming from a checkpoint")
    p.add_argument("--clip", type=float, default=1.0,
                   help="global gradient-norm clip; 0 turns it off")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="skip a step whose loss or gradient norm is not finite (inf, nan) and go "
                        "on, instead of stopping the run there")
    p.add_argument("--backend", choices=["nccl", "gloo"],
                   help="(default: nccl if every local rank has a GPU of its own, else gloo)")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   help="(default: cuda if every local rank has a GPU of its own and --backend "
                        "is not gloo, else cpu)")
    p.add_argument("--timeout", type=positive(float), default=120,
                   help=f"seconds before a stuck collective fails, {TIMEOUTS[0]:g} to "
                        f"{TIMEOUTS[1]:g}")
    p.add_argument("--bf16", action="store_true",
                   help="mixed precision: bf16 compute, fp32 master weights and reductions")
    p.add_argument("--no-overlap", action="store_true",
                   help="reduce in step() (stages 0, 1), wait for each collective, no prefetch")
    p.add_argument("--bucket-mb", type=float, default=0,
                   help="stages 0-2: cut the parameters into buckets of this many MiB (DDP: 25; "
                        "0: each unit its own bucket)")
    return p


SEEDS = 2**32  # --seed: 0 to 2**32 - 1 (get_batch multiplies it into a 64-bit generator seed)
TIMEOUTS = (1, 1e7)  # --timeout, seconds: below 1 s set-up fails; timedelta and c10d overflow


def check_args(args):
    if args.d_model % args.n_head:
        raise UsageError(f"--d-model {args.d_model} is not divisible by --n-head {args.n_head}")
    if not 0 <= args.clip < float("inf"):
        raise UsageError(f"--clip must be 0 (off) or a positive number, not {args.clip}")
    if not 0 <= args.bucket_mb * 2**20 < float("inf"):
        raise UsageError("--bucket-mb must be 0 (one bucket per unit) or a positive number, "
                         f"not {args.bucket_mb}")
    if not 0 <= args.seed < SEEDS:
        raise UsageError(f"--seed must be from 0 to {SEEDS - 1}, not {args.seed}")
    if not TIMEOUTS[0] <= args.timeout <= TIMEOUTS[1]:
        raise UsageError(f"--timeout must be from {TIMEOUTS[0]:g} to {TIMEOUTS[1]:g} seconds, "
                         f"not {args.timeout:g}")
    size = os.path.getsize(__file__)  # the data: this file's bytes; a row is seq_len + 1 of them
    if args.seq_len > size - 2:
        raise UsageError(f"--seq-len {args.seq_len} is longer than the data allows: at most "
                         f"{size - 2} ({os.path.basename(__file__)} has {size} bytes)")
    return args


def main(argv=None):
    p = training_parser("Data parallel and ZeRO-1/2/3 from raw torch.distributed collectives.")
    p.add_argument("--estimate", action="store_true",
                   help="print the per-rank memory formula and exit")
    p.add_argument("--params", type=positive(float),
                   help="Ψ for --estimate, e.g. 7.5e9 (default: none, --estimate needs it)")
    p.add_argument("--world-size", type=positive(int),
                   help="N for --estimate (default: none, --estimate needs it)")
    p.add_argument("--ckpt-dir",
                   help="write sharded checkpoints here and resume from the newest complete one; "
                        "one job per directory (default: no checkpoints)")
    p.add_argument("--ckpt-every", type=positive(int),
                   help="steps between checkpoints (default: after the last step only)")
    p.add_argument("--init-from", metavar="FILE",
                   help="start from a plain state_dict file, e.g. from --consolidate "
                        "(default: a fresh model)")
    p.add_argument("--consolidate", metavar="DIR",
                   help="write the newest checkpoint in DIR (or DIR itself, a checkpoint) as one "
                        "plain state_dict (--out) and exit (default: train)")
    p.add_argument("--out", metavar="FILE", help="--consolidate: the file to write (default: none)")
    args = check_args(p.parse_args(argv))
    if args.ckpt_every and not args.ckpt_dir:
        raise UsageError("--ckpt-every needs --ckpt-dir")
    if (args.params is not None or args.world_size is not None) and not args.estimate:
        raise UsageError("--params and --world-size are for --estimate")
    if args.out and not args.consolidate:
        raise UsageError("--out is for --consolidate")
    if args.estimate:
        if args.params is None or args.world_size is None:
            raise UsageError("--estimate needs --params and --world-size")
        estimate(args.params, args.world_size)
    elif args.consolidate:
        if not args.out:
            raise UsageError("--consolidate needs --out FILE")
        where = os.path.dirname(args.out) or "."
        if os.path.isdir(args.out) or not os.path.isdir(where):
            raise UsageError(f"--out {args.out}: " + ("is a directory" if os.path.isdir(args.out)
                                                      else f"no directory {where}"))
        found = os.path.exists(os.path.join(args.consolidate, "manifest.json"))
        path = args.consolidate if found else latest_checkpoint(args.consolidate)
        if path is None:
            raise CheckpointError(f"{args.consolidate}: no complete checkpoint (no manifest.json)")
        m = consolidate(path, args.out)
        print(f"wrote {args.out}: {len(m['keys'])} tensors, Ψ = {m['psi']:,}, step {m['step']} "
              f"(written at stage {m['stage']} by {m['world_size']} rank(s), "
              "fp32 master weights)")
    else:
        res = train(args)
        if res is not None:
            report(res, args)


PEER_FAILURES = ("gloo/transport", "Connection reset", "Connection closed", "Timed out",
                 "timed out", "NCCL")


def run(main, argv=None):
    """Run a command-line main: bad input is one line and exit code 2; a run stopped by a loss
    or gradient norm that is not finite, one line and exit code 3."""
    code, prog = 0, os.path.basename(sys.argv[0])
    rank0 = os.environ.get("RANK", "0") == "0"  # one voice: the ranks raise the same, together
    try:
        main(argv)
    except (UsageError, Diverged) as e:
        if rank0:
            print(f"{prog}: error: {e}", file=sys.stderr)
        code = 2 if isinstance(e, UsageError) else 3
    except ValueError as e:
        # wrap's own checks ("zero: ranks disagree: ..." on every rank, before any training) are
        # about what the ranks were told to run, not bugs: one line. Any other ValueError is a bug.
        if not str(e).startswith("zero: "):
            raise
        if rank0:
            print(f"{prog}: error: {str(e)[len('zero: '):]}", file=sys.stderr)
        code = 2
    except (dist.DistError, RuntimeError) as e:
        # Another rank died (its sockets close: gloo fails at once) or a collective waited past
        # --timeout: not a bug of this rank, so one line, not a traceback. Anything else is a bug.
        if not isinstance(e, dist.DistError) and not any(m in str(e) for m in PEER_FAILURES):
            raise
        print(f"{prog}: error: rank {os.environ.get('RANK', 0)}: a collective failed, another "
              f"rank is gone or --timeout passed ({str(e).strip().splitlines()[0][:200]})",
              file=sys.stderr)
        code = 1
    if dist.is_initialized() and code != 1:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown. With torch 2.13's gloo, a worker thread can still be
    # releasing the tensors of the last collective while Python shuts down, and the process then
    # aborts ("terminate called without an active exception") after a run that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run(main)
