"""
fsdp_demo.py: the training of zero.py, done by PyTorch's own implementation of each stage.

    torchrun --nproc_per_node=4 fsdp_demo.py --stage 3           # FSDP2, reshard_after_forward=True
    torchrun --nproc_per_node=4 fsdp_demo.py --stage 3 --compare # and zero.py's stage 3 beside it
    torchrun --nproc_per_node=4 fsdp_demo.py --stage 2 --bf16    # FSDP2 with bf16 compute
    torchrun --nproc_per_node=4 fsdp_demo.py --bench             # every stage vs PyTorch, timed
    torchrun --nproc_per_node=2 fsdp_demo.py --stage 3 --resume-from ckpt --ckpt-dir fsdp
                                      # continue zero.py's run (its checkpoints in ckpt), write DCP

Same model, data, seed, training loop and measurements as zero.py: they are imported from it, so
the only difference on this page is who shards. Per stage (parallelize() below builds each):

    zero.py        PyTorch
    DataParallel   DistributedDataParallel(model)
    ZeRO1          DDP + torch.distributed.optim.ZeroRedundancyOptimizer (each parameter has one
                   owner rank that keeps its Adam state and broadcasts it after the step: whole
                   parameters handed out, not an even flat cut, so the shards are uneven)
    ZeRO2          fully_shard(block, reshard_after_forward=False) per block, then the root.
                   Close, not equal: FSDP2 keeps parameters sharded between steps and gathers each
                   unit once per step (in forward, kept through backward); ZeRO-2 (and zero.py,
                   and DeepSpeed) keep them whole and all-gather the updated shards after the step.
                   Same bytes sent; FSDP2 holds less between steps, the same at the peak.
    ZeRO3          fully_shard(block, reshard_after_forward=True) per block, then the root

FSDP2's knobs and the zero.py code that does the same job:
- fully_shard(module): one communication unit, i.e. one zero.Unit (zero.wrap's `units=`). The
  root call takes whatever no block holds: zero.py's root unit.
- reshard_after_forward=True: ZeRO3._post_forward frees the unit after forward, and the
  multi-grad hook gathers it again before backward. False: the unit stays gathered until its
  gradient is reduced (zero.py's stage 3 does this for its root unit only).
- MixedPrecisionPolicy(param_dtype, reduce_dtype): zero.wrap(param_dtype=..., reduce_dtype=...);
  --bf16 sets param_dtype=bfloat16, reduce_dtype=float32 on both sides. FSDP2 keeps its sharded
  parameters in fp32 (they are the master copy) and casts a bf16 copy per unit for compute;
  zero.py keeps the bf16 shard and an fp32 master beside it, as the ZeRO paper
  (arXiv:1910.02054) does.
- Implicit prefetch (the next unit's all-gather issued while the current one computes) and
  set_modules_to_forward_prefetch / set_modules_to_backward_prefetch: zero.Prefetch, in the
  order recorded in the first forward (overlap=False / --no-overlap turns it off). FSDP2's
  reduce-scatter on its own stream, one in flight: ZeRO2._reduce_unit with async_op=True.
- set_requires_gradient_sync(False) for micro-batches without communication: zero.py's stages 0
  and 1 already wait for step(); stages 2 and 3 reduce-scatter in every backward.
- clip_grad_norm_ on DTensor gradients returns a DTensor norm (.full_tensor() reads it):
  zero.py's clip_grad_norm_ all-reduces the sum of squares of the shards itself.
- Parameters become DTensors sharded on dim 0 (each parameter cut separately, padded); zero.py
  cuts one flat buffer per unit. Both give each rank 1/N of every unit.
- fully_shard(mesh=init_device_mesh(device, (N/G, G))): hybrid sharding (HSDP), shard over G,
  replicate over N/G: zero.py's --shard-size G (hybrid.py); --compare --shard-size G runs both.
- A model built on the meta device: fully_shard it there, then to_empty() and an init, then
  set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True) for weights that rank 0
  holds (materialize below): zero.wrap(init=...) (materialize in zero.py) and
  load_full_state_dict, where each rank reads its own shards of the file instead.

What FSDP2 and DeepSpeed offer that zero.py leaves out, and why: CUDA streams and events for
overlap (zero.py uses the backends' async work handles, which is all gloo has), per-parameter
groups; CPU and NVMe offload (ZeRO-Offload/Infinity: another memory tier, not another idea);
quantized communication (ZeRO++); ZeRO-R's activation partitioning (activations are not model
state; activation checkpointing itself works at every stage); DTensor state dicts and
torch.distributed.checkpoint (zero.py's checkpoints do the same job in small: a file per rank
plus a manifest, resharded when loaded; each side continues the other's, Torch.load_checkpoint
below and checkpoints.load_dcp); torch.compile integration. Each is an optimization on
top of the three sharding ideas, and each would double the code to read.
"""
import argparse, collections, contextlib, gc, itertools, math, statistics

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, \
    set_model_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import checkpoints
import zero
from tradeoffs import median_time

log = zero.log0  # rank 0 prints, the others stay quiet


# ----------------------------------------------------------------------------------------------
# PyTorch's counterpart of each zero.py stage

# (by stage: 0, 1, then 2 and 3, FSDP2 without and with resharding after forward)
PYTORCH_NAMES = ["DistributedDataParallel", "DDP + ZeroRedundancyOptimizer",
                 *(f"FSDP2 fully_shard(reshard_after_forward={b})" for b in (False, True))]
# FSDP2 on the CPU (gloo) before torch 2.9: 2.6's fails in its first all-gather (a CPU stream has
# no record_event), 2.7's in HSDP (gloo has no AVG all-reduce), and up to 2.8 gloo's AVG
# reduce-scatter sums: N times the gradients. Why it cannot run here, or None.
NO_CPU_FSDP2 = None if torch.__version__ >= "2.9" else \
    f"PyTorch's FSDP2 on the CPU needs torch 2.9 or newer (this is {torch.__version__})"


def parallelize(model, args, device):
    """PyTorch's counterpart of zero.py's stage args.stage, for a model built on the meta device:
    returns (model to call, optimizer, the replicate group of hybrid sharding or None)."""
    if args.stage < 2:  # DDP needs the whole model on every rank: allocate and initialize it
        materialize(model, args, device)
        # gradient_as_bucket_view: the gradients live in DDP's all-reduce buckets, not beside them
        net = DDP(model, gradient_as_bucket_view=True)
        # zero.ZeRO1: zero.py's AdamW (zero.adamw) in each owner rank's ZeroRedundancyOptimizer;
        # zero.DataParallel: the same AdamW on every rank
        return net, (ZeroRedundancyOptimizer(model.parameters(), optimizer_class=zero.adamw(args))
                     if args.stage == 1 else zero.adamw(args)(model.parameters())), None

    # zero.ZeRO2 and zero.ZeRO3: FSDP2, as in PyTorch's FSDP2 example, each block, then the root,
    # on the meta device: fully_shard only records shapes there, and to_empty() (materialize)
    # then allocates each rank's shards and nothing more
    # (param_dtype: bf16 under --bf16, else the parameters' own; reduce_dtype: fp32 always)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.bf16 else None,
                                     reduce_dtype=torch.float32)
    # Hybrid sharding (zero.py's --shard-size G): a 2-D mesh, replicate x shard, whose rows are
    # G consecutive ranks, as zero.py's shard groups (HSDP). None (no G, or G = N): every rank.
    G, world = args.shard_size, dist.get_world_size()
    if G and world % G:  # (init_device_mesh would fail on some ranks only, with a traceback)
        raise zero.UsageError(f"--shard-size {G} must divide the world size {world}")
    mesh = None if not G or G == world else dist.init_device_mesh(
        device.type, (world // G, G), mesh_dim_names=("replicate", "shard"))
    for module in [*model.blocks, model]:
        fully_shard(module, mesh=mesh, reshard_after_forward=args.stage == 3, mp_policy=mp_policy)
    materialize(model, args, device)
    return model, zero.adamw(args)(model.parameters()), mesh and mesh.get_group("replicate")


def materialize(model, args, device):
    """PyTorch's recipe for a model built on the meta device: to_empty() allocates it (FSDP2:
    this rank's shards only), and set_model_state_dict loads a full state_dict that rank 0 alone
    holds and broadcasts (broadcast_from_rank0), each rank keeping its shards: every tensor.
    An init on each rank (model.apply(GPT.init_weights)) would not give zero.py's weights, and
    is not run: FSDP2's init runs on each rank's local shards, which draw their random numbers
    from the same generator state, not from one stream over the whole tensor. So rank 0's
    state_dict is the --init-from file, or the weights that zero.wrap(init=GPT.init_weights)
    gives: the same model, initialized whole in one process."""
    # Gotcha: to_empty() gives each module a new Parameter for its meta one, so a parameter that
    # two modules share (the head tied to the embedding) becomes two. With this switch it swaps
    # the new tensor's contents into the same Parameter object instead (swap_tensors): ties stay.
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    full = {}  # rank 0's, for every rank
    if args.init_from:  # every rank checks it (the same file: read_state_dict), as zero.py does
        full = checkpoints.read_state_dict(args.init_from, device)
        misfit, key_of, twin = checkpoints.fit_problem(model, full)
        misfit = misfit or next((f"tied here, different there: {key_of[t]} and {k}" for t, k in
                                 twin.items() if not torch.equal(full[k], full[key_of[t]])), None)
        if misfit:
            raise zero.UsageError(f"--init-from {args.init_from}: does not fit the model: {misfit}")
        full = {k: full[key_of[t]] for k, t in model.state_dict(keep_vars=True).items()
                } if dist.get_rank() == 0 else {}  # (each key: set_model_state_dict is strict)
    elif dist.get_rank() == 0:  # built whole on the CPU (its constructor draws an init), then
        whole = zero.GPT(args.seq_len, args.d_model, args.n_layer, args.n_head)  # seeded again
        torch.manual_seed(args.seed)
        whole.apply(zero.GPT.init_weights)
        full = whole.state_dict()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                              broadcast_from_rank0=True))


def pytorch(args, world, count_steps=math.inf):
    """build() for zero.train: parallelize the model with PyTorch's counterpart of args.stage."""
    def build(model, device):
        net, optimizer, across = parallelize(model, args, device)
        opt = Torch(model, optimizer, world, count_steps, net, across)
        # what complete.json records
        opt.written = dict(stage=args.stage, world_size=world, shard_size=args.shard_size or world)
        return net, opt, f"PyTorch {PYTORCH_NAMES[args.stage]} (zero.py stage {args.stage})"
    return build


# ----------------------------------------------------------------------------------------------
# Counting PyTorch's communication at the dispatcher

class CommCounter(TorchDispatchMode):
    """Counts the bytes of every c10d collective that runs while it is active, at the same ring
    cost as zero.py's own counter (Meter.sent). FSDP2 and ZeroRedundancyOptimizer call
    torch.distributed from Python, DDP's reducer from C++; all of them go through the dispatcher
    as c10d ops, and that is where this looks. Not seen: what DTensor sends inside its own
    dispatch (a mode is switched off there), which here is only the few bytes of
    clip_grad_norm_'s norm over FSDP2's sharded gradients."""

    # each kind's op: its name without the underscores (c10d.allreduce_: all_reduce)
    KINDS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "all_to_all"]

    def __init__(self, comm, across=None):
        super().__init__()
        self.comm, self.across = comm, across  # hybrid sharding's replicate group (else None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # c10d.allreduce_, c10d._allgather_base_, ...: in place, all-gather's output comes first
        # and reduce-scatter's input second; the op's ProcessGroup argument is the ring
        name = func.overloadpacket.__name__.replace("_", "") if func.namespace == "c10d" else ""
        # the first: "reducescatter" is matched before "reduce"
        for kind in [k for k in self.KINDS if name.startswith(k.replace("_", ""))][:1]:
            data = args[1] if kind == "reduce_scatter" else args[0]
            full = sum(t.numel() * t.element_size() for t in tree_leaves(data))
            group = dist.ProcessGroup.unbox(next(a for a in args if isinstance(
                a, torch.ScriptObject) and a._type().name() == "ProcessGroup"))
            times = 2 if kind == "all_reduce" else 1  # the ring's cost: all-reduce 2(N-1)/N M
            if kind == "all_reduce" and group is self.across:  # (G = 1: every rank's group)
                kind = "all_reduce across groups"
            self.comm[kind] += times * (group.size() - 1) * full / group.size()
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------------------------
# The adapter: PyTorch's model and optimizer behind zero.py's optimizer interface

def _nbytes(tensors):  # zero._nbytes of the tensors among them (not None, nor a number): of a
    # DTensor, its local shard
    return zero._nbytes([t.to_local() if isinstance(t, DTensor) else t for t in tensors
                         if torch.is_tensor(t)])


class Torch:
    """A PyTorch model and optimizer behind the interface zero.train measures (step, zero_grad,
    clip_grad_norm_, memory_breakdown, full_state_dict, comm): the same measurements for both."""

    def __init__(self, model, optimizer, world, count_steps=math.inf, net=None, across=None):
        self.model, self.optimizer, self.world, self.across = model, optimizer, world, across
        self.step, self.zero_grad = optimizer.step, optimizer.zero_grad  # torch's own
        # DDP's own no_sync (stages 0, 1); FSDP2 reduce-scatters every backward, as zero.py's 2, 3
        self.no_sync = net.no_sync if isinstance(net, DDP) else contextlib.nullcontext
        self.device = next(model.parameters()).device
        # --bench counts only the first step (count_steps=1): the mode costs time
        self.count_steps, self.comm = count_steps, collections.Counter()
        # DTensor parameters: numel() is the global count
        self.psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # (no self.peak, which zero.train reads as "not measured": the transient buffers live
        # inside PyTorch's internals)

    def counting(self):
        self.count_steps -= 1
        return CommCounter(self.comm, self.across) if self.count_steps >= 0 else \
            contextlib.nullcontext()

    def clip_grad_norm_(self, max_norm):
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm  # FSDP2: a DTensor norm

    def memory_breakdown(self):
        """Bytes this rank holds, from the local shards of DTensors, as zero.py measures its own."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        # ZeroRedundancyOptimizer: its local optimizer holds this rank's state
        local = getattr(self.optimizer, "optim", self.optimizer)
        return {"params": _nbytes(params), "grads": _nbytes(p.grad for p in params),
                "optimizer": _nbytes(v for s in local.state.values() for v in s.values())}

    def full_state_dict(self):
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
                for n, p in self.model.named_parameters()}

    # Checkpoints (FSDP2 only), through torch.distributed.checkpoint's state_dict API: each rank's
    # DTensor shards in, each rank's DTensor shards out, keyed by the model's names.

    def _state(self):  # {"model": its state dict, "optimizer": the optimizer's}, as DCP keys them
        return dict(zip(("model", "optimizer"), get_state_dict(self.model, self.optimizer)))

    def save_checkpoint(self, root, step, extra=None):
        """checkpoints.save_checkpoint's counterpart: DCP, as torchtitan writes it
        (checkpoints.save_dcp)."""
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        info = {**self.written, "optimizer": "AdamW", "hyper": hyper, "extra": extra or {}}
        checkpoints.save_dcp(self._state(), root, step, info, self.device)

    def load_checkpoint(self, path):
        """checkpoints.load_checkpoint's counterpart: FSDP2 continues a DCP checkpoint, or
        zero.py's own, of any stage and world size. Returns its step, stage, N and extra."""
        checkpoints._one_checkpoint(path, self.device)  # every rank the same one
        with checkpoints._agreed(self.device):  # every rank's error on every rank, before a change
            if checkpoints.is_dcp(path):
                info, tensors = checkpoints.read_dcp(path)
                checkpoints.check_dcp(self.model, self.optimizer, info, tensors, path)
            else:
                verify = range(dist.get_rank(), 1 << 30, self.world)  # rank r: files r, r+N, ...
                info, parts = checkpoints.read_checkpoint(path, verify=verify)
                here = {k: list(t.shape) for k, t in self.model.state_dict().items()}
                # each name's shape: a sharded parameter's, else a replicated tensor's
                shapes = {**info["replicated"], **{n: s for unit in info["units"] for n, s in unit}}
                checkpoints.another_model(here, {k: shapes.get(n) for k, n in info["keys"]})
                checkpoints.another_optimizer(info["optimizer"], parts[0].get("hyper"),
                                              self.optimizer)
        if checkpoints.is_dcp(path):
            state = self._state()  # torch's own way: the state_dict as a template, filled in place
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(self.model, state["model"])
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        else:
            self._load_zero(info, parts)
        return info

    def _load_zero(self, manifest, parts):
        """zero.py's checkpoint into FSDP2: each parameter, and each of its Adam states, whole
        from the memory-mapped parts (checkpoints.checkpoint_tensors), one at a time, then cut
        into this rank's DTensor shard (every rank holds it whole: a Replicate DTensor, which
        redistribute() cuts here, sending nothing); then torch's set_*_state_dict, sharded."""
        params = dict(self.model.named_parameters())

        def shard(name, full):
            mesh = params[name].device_mesh
            whole = DTensor.from_local(full.to(self.device), mesh, [Replicate()] * mesh.ndim)
            return whole.redistribute(mesh, params[name].placements)
        weights = {n: shard(n, t) for n, t in checkpoints.checkpoint_tensors(manifest, parts)}
        # Adam's step counts (of the parameters ever stepped), then exp_avg, exp_avg_sq
        state = {n: dict(s) for n, s in checkpoints.checkpoint_scalars(parts).items()}
        for key in checkpoints.checkpoint_state_keys(parts):
            for n, t in checkpoints.checkpoint_tensors(manifest, parts, key):
                if n in state:
                    state[n][key] = shard(n, t)
        # and the frozen parameters and buffers, which rank 0's part holds
        values = {**parts[0]["replicated"], **weights}
        set_model_state_dict(self.model, {k: values[n] for k, n in manifest["keys"]})
        if state:  # (none: the optimizer never stepped, and starts fresh)
            set_optimizer_state_dict(self.model, self.optimizer, {"state": state, "param_groups": [
                {**h, "params": list(params)} for h in parts[0]["hyper"]]})


# ----------------------------------------------------------------------------------------------
# --compare: PyTorch's run, then zero.py's, in the same processes

def compare(args, keep_params=False, zero_too=True):
    """PyTorch's run, then (zero_too) zero.py's in the same processes; returns both results, or
    None where only PyTorch's ran."""
    _, world, _ = zero.setup(args.backend, args.device, args.timeout)
    theirs = zero.train(args, pytorch(args, world), keep_params)
    if theirs is None:  # a checkpoint at --steps already: zero.train said so, nothing to report
        return None
    zero.report(theirs, args)  # and what its numbers mean beside zero.py's
    if args.stage >= 2 and dist.get_backend() == "gloo":
        log("  (gloo: its reduce_scatter_tensor, which FSDP2 calls, all-reduces the whole input: "
            "on the wire\n   an all-reduce's bytes, twice the reduce_scatter's ring cost above)")
    if args.stage >= 2 and args.bf16:
        log("  (--bf16: FSDP2's parameters are its fp32 shards, the master copy, and its gradients "
            "fp32 shards:\n   params 4Ψ/N, grads 4Ψ/N, optimizer 8Ψ/N, 16Ψ/N in all as the "
            "formula's; the bf16 copy of\n   a unit lives while it computes)")
    if not zero_too:
        return None
    gc.collect()  # PyTorch's model and optimizer are garbage now: free them before zero.py's run
    seen = collections.Counter()

    def counted(model, device):
        # build() for zero.train: zero.py's own stage, also counted at the dispatcher into
        # `seen`, as a check that both counters agree
        model, opt, label = zero.zero_build(args)(model, device)
        opt.counting = lambda: CommCounter(seen, getattr(opt, "replica_group", None))
        return model, opt, label
    ours = zero.train(args, counted, keep_params)
    zero.report(ours, args)
    ours["comm_seen"] = {k: v / args.steps for k, v in seen.items()}
    return theirs, ours


def print_comparison(theirs, ours, args):
    log(f"\nzero.py vs PyTorch, stage {args.stage}: {PYTORCH_NAMES[args.stage]}, N = "
        f"{ours['world']}\n  step  loss PyTorch  loss zero.py  difference")  # widths 4, 12, 12, 10
    for i, (a, b) in enumerate(zip(theirs["losses"], ours["losses"]), theirs["first"]):
        log(f"  {i:>4}  {a:>12.6f}  {b:>12.6f}  {abs(a - b):>10.2e}")
    largest = max(abs(a - b) for a, b in zip(theirs["losses"], ours["losses"]))
    diff = max((theirs["full"][n] - t).abs().max().item() for n, t in ours["full"].items())
    log(f"  largest loss difference {largest:.2e}\n  largest parameter difference after "
        f"{args.steps} steps {diff:.2e}\n\n  {'per rank (largest over ranks)':<34} {'PyTorch':>14}"
        f" {'zero.py':>14} {'zero.py / PyTorch':>18}")

    def column(res):  # one run's numbers, in the order of `names`
        mem = [res["mem"][k] for k in ("params", "grads", "optimizer")]
        return [*mem, sum(mem), sum(res["comm"].values()),
                statistics.median_high(res["times"]) * 1e3,  # (one step's, as zero.report's)
                *([max(res["cuda_peak"])] if ours["cuda_peak"] else [])]  # (on CUDA only)
    names = ["params bytes", "grads bytes", "optimizer bytes", "model state bytes",
             "bytes sent per step", "median step time, ms", "cuda max_memory_allocated"]
    for name, a, b in zip(names, column(theirs), column(ours)):
        log(f"  {name:<34} {a:>14,.1f} {b:>14,.1f} {b / a if a else float('nan'):>18.3f}")
    log(f"  (bytes sent: the ring cost of the calls made, PyTorch's counted at the dispatcher,"
        f"\n   zero.py's by itself, the dispatcher saw {sum(ours['comm_seen'].values()):,.1f} for "
        "it" + ("; on gloo FSDP2's reduce-scatters\n   send twice their ring cost: its report)"
                if args.stage >= 2 and dist.get_backend() == "gloo" else ")"))
    for name, res in (("PyTorch", theirs), ("zero.py", ours)) if ours["cuda_peak"] else ():
        log(f"  torch.cuda.max_memory_allocated per rank, {name}: "
            + ", ".join(f"{b / 1e6:.1f} MB" for b in res["cuda_peak"]))
    if args.stage == 2:
        log("  (stage 2: FSDP2 keeps parameters sharded between steps, zero.py keeps them whole: "
            "see the docstring)")


# ----------------------------------------------------------------------------------------------
# --bench: every stage against its PyTorch counterpart, timed

BENCH_MODELS = [("default", {}),  # and 4 blocks of width 1024: 50.7M parameters
                ("50M", dict(d_model=1024, n_layer=4, n_head=16, seq_len=32, batch_size=2))]


def bench(args):
    """--bench: each zero.py stage against its PyTorch counterpart, on the default model and on a
    50M-parameter one, in one launch: the two alternate, args.repeats times, and the table gives
    medians over every timed step. The first step of each run warms up and is the one whose bytes
    are counted (PyTorch's at the dispatcher: that mode slows what it watches), so no timed step
    is counted and no counted step is timed. Printed only; the tests never assert a timing."""
    _, world, device = zero.setup(args.backend, args.device, args.timeout)
    steps = max(args.steps, 2)  # the first warms up

    table, zero_ms = [], {}  # the table's lines; zero.py's median step, ms, per (model, stage)
    for (name, size), stage in itertools.product(BENCH_MODELS, range(4)):
        # Stages 0 and 1 use DDP's 25 MB buckets, as their PyTorch counterparts do; stages 2
        # and 3 use the units FSDP2 is given (one per block), so both sides communicate the
        # same pieces.
        a = argparse.Namespace(**{**vars(args), **size, "stage": stage, "steps": steps,
                                  "bucket_mb": 25 if stage < 2 else args.bucket_mb})
        runs = {"PyTorch": [], "zero.py": []}
        for _ in range(args.repeats):
            # PyTorch's build, then zero.py's (None: zero.train's own, zero_build)
            for who, build in zip(runs, [pytorch(a, world, count_steps=1), None]):
                runs[who].append(zero.train(a, build, quiet=True))
                gc.collect()
        ms = {who: statistics.median(t for r in rs for t in r["times"][1:]) * 1e3
              for who, rs in runs.items()}
        zero_ms[name, stage], ratio = ms["zero.py"], ms["zero.py"] / ms["PyTorch"]
        theirs, ours = runs["PyTorch"][-1], runs["zero.py"][-1]
        formula = sum(zero.comm_formula(stage, ours["psi"], world).values())
        table.append(f"{name:<8} {stage:<6} {PYTORCH_NAMES[stage]:<48} {ms['PyTorch']:>10.1f}"
                     f" {ms['zero.py']:>9.1f} {ratio:>6.3f} {sum(theirs['mem'].values()):>14,}"
                     f" {sum(ours['mem'].values()):>12,} {theirs['sent'][0]:>13,.0f}"
                     f" {ours['sent'][0]:>11,.0f} {formula:>11,.0f}")
        log(f"  measured {name} stage {stage}: zero.py / PyTorch = {ratio:.3f}")
    log(f"\n--bench: N = {world} ({dist.get_backend()}), fp32 AdamW, {args.repeats} alternating "
        f"runs x {steps - 1} timed steps each; bytes per rank (largest over ranks)")
    log(f"{'model':<8} {'stage':<6} {'PyTorch counterpart':<48} {'ms PyTorch':>10} {'ms zero':>9}"
        f" {'ratio':>6} {'state PyTorch':>14} {'state zero':>12} {'sent PyTorch':>13}"
        f" {'sent zero':>11} {'formula':>11}", *table, sep="\n")  # the header, then the rows
    log("ratio: zero.py / PyTorch median step time (below 1: zero.py is faster); state: params"
        " + grads + optimizer after the step; sent: first step's bytes, ring cost; formula: 2Ψ or"
        " 3Ψ (N-1)/N x 4 bytes")
    # The cost of zero.py's per-step check that ranks communicated the same units (one all-reduce
    # of 16 bytes per step, zero.check_step_agrees; check_steps=False, --no-step-check: off)
    check = torch.zeros(2, dtype=torch.int64, device=device)
    check_ms = 1e3 * median_time(lambda: dist.all_reduce(check, op=dist.ReduceOp.MAX),
                                 10 * args.repeats, device)
    first, _ = BENCH_MODELS[0]  # the default model
    log(f"per-step check that ranks agree (one 16-byte all_reduce): {check_ms:.3f} ms, "
        f"{100 * check_ms / zero_ms[first, 0]:.1f}% of the {first} model's stage-0 step")
    # What the backend charges for each collective on the same bytes: the ZeRO paper's "stage 1
    # costs what stage 0 costs" (arXiv:1910.02054) assumes reduce-scatter + all-gather =
    # all-reduce, as ring algorithms give.
    x = torch.randn(ours["psi"] // world * world, device=device)  # Ψ of the last model
    shard, full = torch.empty(x.numel() // world, device=device), torch.empty_like(x)
    times = {name: 1e3 * median_time(call, args.repeats, device) for name, call in [
        ("all_reduce", lambda: dist.all_reduce(x)),
        ("reduce_scatter", lambda: dist.reduce_scatter_tensor(shard, x)),
        ("all_gather", lambda: dist.all_gather_into_tensor(full, shard)),
        ("zero.reduce_scatter", lambda: zero.reduce_scatter(shard, x)),
        ("zero.all_gather", lambda: zero.all_gather(full, shard))]}
    own = (times["zero.reduce_scatter"] + times["zero.all_gather"]) / times["all_reduce"]
    log(f"{dist.get_backend()} collectives on {4 * x.numel() / 1e6:.0f} MB (the 50M model's fp32 "
        "gradients), median ms: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()) +
        "; reduce_scatter + all_gather / all_reduce = "
        f"{(times['reduce_scatter'] + times['all_gather']) / times['all_reduce']:.2f},"
        f" zero.py's own on gloo/CPU (see zero.reduce_scatter): {own:.2f}")


# ----------------------------------------------------------------------------------------------
# Command line

def main(argv=None):
    p = zero.training_parser("zero.py's training by PyTorch: DDP, ZeroRedundancyOptimizer, FSDP2")
    add = p.add_argument
    add("--compare", action="store_true", help="also run zero.py's stage, print both side by side")
    add("--bench", action="store_true", help="each stage vs PyTorch, default and 50M models, timed")
    add("--repeats", type=zero.positive(int), help="--bench: alternating runs per pair (default 3)")
    args = zero.check_args(p.parse_args(argv))
    # no FSDP2 in this run (stages 0, 1; --bench): refused, what only FSDP2 does here
    no_fsdp2 = args.stage < 2 or args.bench
    only = "stages 2 and 3 only" + (", not --bench" if args.bench else "")
    for bad, message in [
            # (--bench compares every stage itself)
            (args.bench and args.compare, "--bench and --compare: choose one"),
            (args.repeats is not None and not args.bench, "--repeats is for --bench"),
            (no_fsdp2 and (args.ckpt_dir or args.resume_from),
             f"--ckpt-dir and --resume-from are FSDP2's here: {only}"),
            (no_fsdp2 and args.bf16, f"--bf16 is FSDP2's MixedPrecisionPolicy: {only}"),
            (no_fsdp2 and args.shard_size, f"--shard-size is FSDP2's 2-D mesh (HSDP) here: {only}"),
            # FSDP2 is given one unit per block, DDP buckets its own
            (args.units != "block", "--units is zero.py's: fsdp_demo.py shards one unit per block"),
            # (at stages 0, 1 or with --bench: refused above)
            (args.ckpt_dir and args.compare, "--ckpt-dir and --compare: both would write there")]:
        if bad:
            raise zero.UsageError(message)
    args.repeats = args.repeats or 3
    if NO_CPU_FSDP2 and (args.stage > 1 or args.bench) and \
            zero.choose_device(args.backend, args.device)[1].type == "cpu":
        raise zero.UsageError(f"{NO_CPU_FSDP2}: --stage 0 or 1 (no --bench) or --device cuda")
    if args.bench:
        bench(args)
    elif compared := compare(args, keep_params=args.compare, zero_too=args.compare):
        print_comparison(*compared, args)


if __name__ == "__main__":
    zero.run(main)
