"""
tradeoffs.py: which stage for which model and cluster. What each stage costs in memory, in bytes
sent and in time: measured here, in one launch, and predicted for a cluster by a time model
that is checked against those measurements.

    python zero.py --estimate --params 7.5e9 --world-size 64          # the paper's Figure 1
    python zero.py --estimate --params 7e9 --world-size 16 --n-layer 32 --d-model 4096 \\
        --seq-len 4096 --batch-size 1 --cluster gpus_per_node=8,inter_bw=12.5e9   # and in time
    torchrun --nproc_per_node=4 zero.py --tradeoffs [--unit-sizes]   # measured, and predicted

What it is:
- --estimate: the model-state memory of every stage and the elements each rank sends, from the
  ZeRO paper's formulas (arXiv:1910.02054) alone; with --cluster, the time model too: per stage
  and hybrid G, memory with activations, communication, compute, the exposed part, step time
  and tokens/s, and which configuration fits and is fastest. Every input a stated default.
- --tradeoffs: trains the command line's configuration at every stage (with --unit-sizes, also
  at three unit sizes) in one launch, and prints what each measured: model state, bytes sent,
  step time, the time spent waiting on collectives, tokens/s; next to it, the step time the time
  model predicts once calibrated on this machine (a sweep of the collectives, a measured forward
  and backward, a measured optimizer step), and the ratio.

The time model (step_time): a collective over n ranks on a ring takes 2(n-1) steps (all-reduce)
or n-1 (reduce-scatter, all-gather), each α + M/(n β) for M bytes (latency α, bandwidth β).
Compute is 6Ψ FLOPs per token (8Ψ with activation checkpointing: the forward again). Overlap:
a phase's collectives run beside its compute, all but one unit's hidden where the compute is
longer; what is left over waits (exposed). Not modeled: the kernels' launch overheads, Python's,
and on CPU the cores that compute and communication share (why the prediction is off there).

What it uses of zero.py: the formulas (memory_formula, comm_formula), train() and its results,
the collectives (all_gather, reduce_scatter), the demo GPT, adamw() and PIECE; memory.py's _si
(bytes as text). zero.py imports this file at the flags that need it.
"""
import argparse, dataclasses, os, statistics, time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from memory import _si
from zero import GPT, PIECE, STAGE_NAMES, UsageError, adamw, all_gather, comm_formula, log0, \
    median_step, memory_formula, reduce_scatter, setup, train


# ----------------------------------------------------------------------------------------------
# Memory and bytes from the formulas alone: --estimate

PARAMS_MAX = 1e15  # --cluster: its time model goes layer by layer (1e24: a million of them)


def command(args, argv):
    """zero.py --estimate [--cluster] or --tradeoffs: bad input is a UsageError first."""
    names = [a.split("=")[0] for a in argv]
    given = {flag for flag in ("--stage", "--n-layer", "--d-model", "--seq-len", "--batch-size")
             if any(len(n) > 2 and flag.startswith(n) for n in names)}  # (or abbreviated)
    if args.tradeoffs:
        if args.ckpt_dir or args.resume_from or args.max_memory or "--stage" in given:
            raise UsageError("--tradeoffs trains every stage from the start: not with --stage, "
                             "--ckpt-dir, --resume-from, --max-memory (one process's limit)")
        return tradeoff_table(args)
    if args.params is None or args.world_size is None:
        raise UsageError("--estimate needs --params and --world-size")
    for flag, value in [("--ckpt-dir", args.ckpt_dir), ("--resume-from", args.resume_from),
                        ("--init-from", args.init_from), ("--data", args.data),
                        ("--max-memory", args.max_memory), ("--bucket-mb", args.bucket_mb),
                        ("--bf16", args.bf16)]:  # (the estimate: mixed precision, always)
        if value:  # (each would be ignored)
            raise UsageError(f"{flag} is for training: --estimate trains nothing")
    most = PARAMS_MAX if args.cluster is not None else 1e300  # (else: 16Ψ bytes are finite)
    if not 1 <= args.params <= most or args.params % 1:
        raise UsageError(f"--params {args.params:g}: " + ("at least 1 parameter" if args.params < 1
                         else f"at most {most:g} parameters" + " with --cluster" * (most < 1e300)
                         if args.params > most else "a whole number of parameters"))
    cluster = None if args.cluster is None else parse_cluster(args.cluster)
    if cluster and args.world_size % min(cluster.gpus_per_node, args.world_size):
        raise UsageError(f"--cluster gpus_per_node={cluster.gpus_per_node} does not divide "
                         f"--world-size {args.world_size}")
    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 prints (a formula needs no group)
        return
    stages = [args.stage] if "--stage" in given else range(4)
    estimate(args.params, args.world_size, args.shard_size, stages, args.grad_accum)
    if cluster is not None:
        predict_cluster(model_shape(args, given), args.params, args.world_size, cluster, stages)


def estimate(psi, world, shard_size=None, stages=range(4), k=1):
    """Per-rank model-state memory for each stage (or those in `stages`), from the formula
    alone: no model, no ranks; and the elements each rank sends per step of k micro-batches,
    inside its group of G and across the groups."""
    G = shard_size or world
    print(f"ZeRO model-state memory per rank (formula: the ZeRO paper, arXiv:1910.02054, "
          f"Figure 1)\nΨ = {psi:.4g} parameters, N = {world} ranks"
          + (f" in groups of G = {G} (hybrid: stages 1-3 shard over G)" if G < world else "")
          + ",\nmixed-precision Adam: 2 + 2 + 12 bytes per parameter, GB = 1e9 bytes\n\n"
          f"{'stage':<27} {'params':>9} {'grads':>9} {'optimizer':>9} {'total':>9}  "
          f"{'sent, in group':>14} {'across groups':>14}")
    for stage in stages:
        m = {k: v / 1e9 for k, v in memory_formula(stage, psi, world, 2, 2, 12, G).items()}
        sent = comm_formula(stage, psi, world, 1, 1, k, shard_size=G)
        across = sent.pop("all_reduce across groups", 0)
        inside = sum(sent.values()) if stage or G == world else 0  # stage 0: all-reduce over N
        across += 0 if stage or G == world else sum(sent.values())
        gb = [_fit(m[k], 2) for k in ("params", "grads", "optimizer")] + [_fit(sum(m.values()), 1)]
        print(f"{stage} {STAGE_NAMES[stage].split(':')[0]:<25} "
              + " ".join(f"{x:>6} GB" for x in gb) + f"  {inside:>14.4g} {across:>14.4g}")
    times = [2, 2, k + 1, 3 * k]  # k micro-batches: stage 2 reduce-scatters in each, 3 all of it
    ring = "2Ψ(N-1)/N for stages 0-2, 3Ψ(N-1)/N for stage 3" if len(stages) == 4 and k == 1 \
        else ", ".join(f"{times[s]}Ψ(N-1)/N for stage {s}" for s in stages)
    print("\nsent: elements per rank per step (ring algorithms" + (
          "): " if k == 1 else f", k = {k} micro-batches):\n") + ring + (
        ";\nwith G < N the reduce-scatters and all-gathers run inside a group of G, and each "
        "shard's all-reduce\ncrosses the groups (stage 0's all-reduce runs over all N)"
        if G < world else ""))


def _fit(x, decimals, width=6):
    """x with `decimals` decimals, fewer where that is wider than `width`, else as 1.23e8 (Ψ =
    1e30: 1.2e22): the columns hold, and a value below 1e10 keeps 3 significant digits."""
    fixed = (f"{x:.{d}f}" for d in range(decimals, -1, -1))
    short = (f"{float(m):g}e{int(e)}" for m, e in (f"{x:.{d}e}".split("e") for d in (2, 1, 0)))
    return next((t for t in (*fixed, *short) if len(t) <= width), f"{x:.0e}")


# ----------------------------------------------------------------------------------------------
# The time model

@dataclasses.dataclass(frozen=True)
class Link:
    """A latency-bandwidth model of one ring: each of its steps costs alpha seconds plus the
    chunk it moves (M/n bytes) at beta bytes per second."""
    alpha: float
    beta: float


def collective_time(kind, nbytes, n, link):
    """Seconds for a ring collective over n ranks of an nbytes buffer: all_reduce 2(n-1) steps,
    reduce_scatter and all_gather n-1 (a broadcast, pipelined: as many), each moving nbytes/n."""
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if kind.startswith("all_reduce") else n - 1
    return steps * (link.alpha + nbytes / n / link.beta)


def overlapped(comm, compute, units, overlap=True):
    """The part of a phase's communication (comm seconds over `units` collectives, one a unit)
    that compute (seconds) does not hide: each unit's collective runs beside the next unit's
    compute, so all but one can hide, and only while there is compute left to hide behind."""
    if not overlap or units == 0:
        return comm
    return max(comm / units, comm - compute * (units - 1) / units)


def step_time(stage, units, world, G, coll, compute, optimizer_s, k=1, gather_bytes=4,
              reduce_bytes=4, overlap=True):
    """The time model of one optimizer step of zero.py's stage, in seconds, as a dict: compute
    (forward and backward of k micro-batches), comm (every collective, end to end), exposed (the
    part compute does not hide, overlapped()), optimizer (the step), step (compute + exposed +
    optimizer), loss (the loop's all-reduce of the loss, in comm and exposed: not ZeRO's, so not
    in the waiting zero.py measures).

    units: (elements, root) of each unit, as it is cut (padded to N*S); coll(kind, nbytes, n,
    across): a collective's seconds (collective_time on a Link, or as calibrated); compute: the
    seconds of one micro-batch's forward and backward (a third forward, two thirds backward:
    2Ψ and 4Ψ FLOPs per token); optimizer_s: of the optimizer step on this rank's elements."""
    L, R = len(units), world // G
    n = G if stage else world  # the ring the shards' collectives run on
    fwd, bwd = compute / 3, compute * 2 / 3

    def each(kind, nbytes):  # one collective per unit
        return sum(coll(kind, e * nbytes, n, False) for e, _ in units)

    reduce = each("all_reduce" if stage == 0 else "reduce_scatter", reduce_bytes)
    if stage and R > 1:  # hybrid: each rank's sum of its shard, across the R groups
        reduce += sum(coll("all_reduce", e // G * reduce_bytes, R, True) for e, _ in units)
    loss = coll("all_reduce", 16, world, False)  # the loop's all-reduce of the loss: a latency
    small = (2 if stage == 0 else 3) * loss  # and as many for the check and (stages 1-3) the norm
    gather = each("all_gather", gather_bytes)
    if stage == 3:  # every forward gathers each unit, every backward again (not the root)
        again = sum(coll("all_gather", e * gather_bytes, n, False) for e, root in units if not root)
        comm = k * (gather + again + reduce)
        exposed = k * (overlapped(gather, fwd, L, overlap) +
                       overlapped(again + reduce, bwd, L, overlap))
    else:  # stages 0, 1 reduce in the last backward only; stage 2 in every one
        times = k if stage == 2 else 1
        comm = times * reduce + gather * (stage > 0)
        exposed = times * overlapped(reduce, bwd, L, overlap) + gather * (stage > 0)
    return {"compute": k * compute, "comm": comm + small, "exposed": exposed + small,
            "optimizer": optimizer_s, "loss": loss,
            "step": k * compute + exposed + small + optimizer_s}


# ----------------------------------------------------------------------------------------------
# Predicted for a cluster: --estimate --cluster

@dataclasses.dataclass
class Cluster:
    """--cluster KEY=VALUE,...: the cluster the time model predicts for. Each default is an
    assumption (about an 8-GPU H100 node and 100 Gb/s Ethernet between nodes), printed as such."""
    gpus_per_node: int = 8
    gpu_memory: float = 80e9     # bytes per GPU
    intra_bw: float = 150e9      # bytes/s a rank sends on a ring inside a node (NVLink)
    inter_bw: float = 12.5e9     # bytes/s between nodes, per node (one 100 Gb/s link)
    intra_latency: float = 10e-6   # seconds per ring step inside a node
    inter_latency: float = 30e-6   # seconds per ring step between nodes
    flops: float = 300e12        # FLOP/s each GPU achieves in forward and backward (bf16)
    memory_bw: float = 2e12      # bytes/s of GPU memory: the optimizer step streams 32 B/element

    def ring(self, n, across, world, G):
        """The Link of a ring of n ranks: inside a node while its ranks are in one (the job, or
        a group of G consecutive ranks), else every step waits for the slowest link, the one
        between nodes. across: one of hybrid sharding's rings across the groups, which all run
        at once, one for each rank of a group: a node's ranks in them share its link."""
        if world <= self.gpus_per_node or n <= self.gpus_per_node and not across:
            return Link(self.intra_latency, self.intra_bw)
        share = min(G, self.gpus_per_node) if across else 1
        return Link(self.inter_latency, min(self.intra_bw, self.inter_bw / share))


def parse_cluster(text):
    """'gpus_per_node=8,inter_bw=25e9' -> Cluster; an unknown key or a bad value: UsageError."""
    fields = {f.name: f.type for f in dataclasses.fields(Cluster)}
    values = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in fields or key in values:
            raise UsageError(f"--cluster: {key!r} twice" if key in values else
                             f"--cluster: no key {key!r}; the keys are {', '.join(fields)}")
        whole = fields[key] in (int, "int")
        try:
            values[key] = (int if whole else float)(value)
        except ValueError:
            raise UsageError(f"--cluster {key}={value}: not {'a whole' if whole else 'a'} "
                             "number") from None
        if not 1e-9 <= values[key] <= 1e21:  # (beyond: a step time overflows, inf or nan)
            raise UsageError(f"--cluster {key}={value}: must be positive, from 1e-09 to 1e+21")
    return Cluster(**values)


def activation_bytes(layers, d_model, seq_len, rows, checkpointing):
    """Bytes of activations a rank keeps for backward, in 16-bit: 34·s·b·h per transformer
    layer (Korthikanti et al., arXiv:2205.05198, with a fused attention that keeps no s×s
    scores); with activation checkpointing each layer's input (2·s·b·h) and one layer's whole."""
    per_layer = 34 * seq_len * rows * d_model
    return 2 * seq_len * rows * d_model * layers + per_layer if checkpointing else \
        per_layer * layers


def model_shape(args, given):
    """args, with the shape --cluster predicts for: what the command line gives (`given`: the
    flags it names), and what it does not assumed, and listed in args.assumed: layers and
    d_model from Ψ ≈ 12·layers·d_model² with d_model = 128·layers (the shape of GPT-3's and
    Llama's 7B: 32 x 4096), rows of 2048 tokens, one row per rank (not the demo's defaults)."""
    psi, assumed = args.params, []
    layers, d = args.n_layer, args.d_model
    if "--n-layer" not in given and "--d-model" not in given:
        layers = max(1, round((psi / (12 * 128 ** 2)) ** (1 / 3)))
        assumed.append("layers and d_model from Ψ, d_model = 128·layers")
    if "--d-model" not in given:
        d = max(64, round((psi / (12 * layers)) ** 0.5 / 64) * 64)
        if "--n-layer" in given:
            assumed.append("d_model from Ψ and layers")
    elif "--n-layer" not in given:
        layers = max(1, round(psi / (12 * d * d)))
        assumed.append("layers from Ψ and d_model")
    ratio = psi / (12 * layers * d * d)  # the shape and --params: do they describe one model?
    note = [f"note: --params is {f'{ratio:,.0f}' if ratio >= 10 else f'{ratio:.2g}'}x the "
            "blocks' 12·layers·d_model²" + " (embeddings?)" * (ratio > 1) + ":\n   Ψ sets the "
            "FLOPs and bytes, the shape the activations"] * (not 0.5 <= ratio <= 2)  # (a
    # shape derived from Ψ too: at least 1 layer of 64, for a Ψ of a few thousand)
    seq_len = args.seq_len if "--seq-len" in given else 2048
    rows = args.batch_size if "--batch-size" in given else 1
    assumed += ["seq_len 2048"] * ("--seq-len" not in given) + \
        ["1 row per rank"] * ("--batch-size" not in given)
    return argparse.Namespace(**{**vars(args), "n_layer": layers, "d_model": d,
                                 "seq_len": seq_len, "batch_size": rows, "assumed": assumed,
                                 "note": note})


def predict_cluster(args, psi, world, cluster, stages=range(4)):
    """--estimate --cluster: the time model per stage (of `stages`), hybrid G and activation
    checkpointing."""
    c, L, k = cluster, args.n_layer, args.grad_accum
    tokens = args.batch_size * args.seq_len  # per rank per micro-batch
    shards = sorted({world, min(c.gpus_per_node, world)} | ({args.shard_size} - {None}),
                    reverse=True)
    print(f"\nTime per step (the time model, tradeoffs.py: ring collectives, 6Ψ FLOPs a token, "
          f"8Ψ with\nactivation checkpointing). Ψ = {psi:.4g}, {L} layers of d_model "
          f"{args.d_model}, {args.batch_size} row(s) x\n{args.seq_len} tokens per rank x {k} "
          f"micro-batch(es), bf16 with fp32 reductions, on N = {world} =\n"
          f"{max(world // c.gpus_per_node, 1)} node(s) x {min(c.gpus_per_node, world)} GPUs; "
          "times in ms per step" + "".join(f"\n  (assumed, not given: {a})"
                                            for a in getattr(args, "assumed", []))
          + "".join(f"\n  ({n})" for n in getattr(args, "note", [])) + "\n")
    print(f"{'stage':<6}{'G':>5} {'ckpt':>5} {'model':>8} {'activ.':>8} {'total':>8} {'fits':>5} "
          f"{'compute':>8} {'comm':>8} {'exposed':>8} {'step':>8} {'tokens/s':>10}")
    rows = []
    for stage in stages:
        for G in shards if stage else [world]:
            for ckpt in (False, True):
                state = sum(memory_formula(stage, psi, world, 2, 2, 12, G).values())
                act = activation_bytes(L, args.d_model, args.seq_len, args.batch_size, ckpt)
                t = step_time(stage, [(psi / L, False)] * L, world, G,
                              lambda kind, nbytes, n, across: collective_time(
                                  kind, nbytes, n, c.ring(n, across, world, G)),
                              (8 if ckpt else 6) * psi * tokens / c.flops,
                              32 * psi / (G if stage else 1) / c.memory_bw, k, 2, 4)
                fits = state + act <= c.gpu_memory
                rows.append((stage, G, ckpt, fits, world * tokens * k / t["step"], t,
                             state + act))
                print(f"{stage:<6}{G:>5} {'yes' if ckpt else 'no':>5} {_si(state):>7}B "
                      f"{_si(act):>7}B {_si(state + act):>7}B {'yes' if fits else 'NO':>5} "
                      + " ".join(f"{_ms(t[key]):>8}" for key in ("compute", "comm", "exposed",
                                                                 "step"))
                      + f" {rows[-1][4]:>10.4g}")
    given = {item.split("=")[0].strip() for item in (args.cluster or "").split(",")}
    for kind, keys in (("given", [f.name for f in dataclasses.fields(c) if f.name in given]),
                       ("assumed (the defaults; --cluster KEY=VALUE,... to change them)",
                        [f.name for f in dataclasses.fields(c) if f.name not in given])):
        if keys:
            print(f"\n{kind}:" + "".join(("\n " if i % 4 == 0 else "") + f" {k}={getattr(c, k):g}"
                                         for i, k in enumerate(keys)))
    print("formulas: activations 34·s·b·h bytes a layer (Korthikanti et al. 2022; with "
          "checkpointing 2·s·b·h a\nlayer and one layer's 34·s·b·h), the optimizer step 32 bytes "
          "an element stepped at memory_bw.\nNot modeled: kernel launches, the logits' memory, "
          "fragmentation, what a step holds for a moment\n(an fp32 copy of the gradients "
          "stepped, full-unit gradients, stage 3's gathered units), compute\nslowed by "
          "communication on the same GPU")
    fitting = [r for r in rows if r[3]]
    if not fitting:
        which = "no stage fits" if len(stages) == 4 else f"stage {stages[0]} does not fit"
        print(f"verdict: {which} in gpu_memory, with or without checkpointing: memory binds (more "
              "ranks, or a smaller micro-batch" + (", or another stage)" if len(stages) < 4 else
                                                  ")"))
        return rows
    best = max(fitting, key=lambda r: (r[4], -r[6]))  # of equal speed, the least memory
    stage, G, ckpt, _, tps, t, _ = best
    binds = "communication (exposed " + f"{t['exposed'] / t['step']:.0%} of the step)" \
        if t["exposed"] > t["compute"] / 2 else "compute"
    lighter = [r for r in rows if not r[3] and r[4] > tps]
    print(f"verdict: stage {stage}" + (f" with G = {G}" if stage and G < world else "")
          + (" with activation checkpointing" if ckpt else "") + f" fits and is fastest, "
          f"{tps:.4g} tokens/s; {binds} binds" + (
              "; faster configurations do not fit in gpu_memory (memory binds them)"
              if lighter else ""))
    return rows


def _ms(seconds):
    return f"{seconds * 1e3:.4g}"


# ----------------------------------------------------------------------------------------------
# Measured here, and predicted once calibrated: --tradeoffs

UNIT_SIZES = ("model", "block", "layer")  # --unit-sizes: the whole model as one unit, ...


def calibrate(args, device, reps=5):
    """This machine's time model, measured on the job's ranks at once: each collective kind's
    seconds as a + b·bytes (a least-squares line through a sweep of sizes), the seconds of one
    micro-batch's forward and backward of the demo GPT (unwrapped), and of the optimizer's step
    per element. Returns {"coll": {kind: (a, b)}, "compute": s, "optimizer_per_element": s}."""
    world = dist.get_world_size()
    fits = {}
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        xs, ys = [], []
        for numel in (world * 256, world * 4096, world * 65536, world * 262144):
            x = torch.zeros(numel, device=device)
            out = x[dist.get_rank() * (numel // world):][:numel // world]
            call = {"all_reduce": lambda: dist.all_reduce(x),
                    "reduce_scatter": lambda: reduce_scatter(out.clone(), x),
                    "all_gather": lambda: all_gather(x, out.clone())}[kind]
            xs.append(numel * 4)
            ys.append(median_time(call, reps, device))
        fits[kind] = _line(xs, ys)
    with torch.device(device):
        torch.manual_seed(args.seed)
        model = GPT(args.seq_len, args.d_model, args.n_layer, args.n_head)
    if args.bf16:
        model = model.to(torch.bfloat16)
    x = torch.randint(256, (args.batch_size, args.seq_len), device=device)

    def forward_backward():
        F.cross_entropy(model(x).float().flatten(0, 1), x.flatten()).backward()
    compute = median_time(forward_backward, reps, device)
    pieces = [torch.zeros(PIECE.get(device.type, PIECE["cuda"]), device=device,
                          requires_grad=True) for _ in range(8)]
    for p in pieces:
        p.grad = torch.zeros_like(p)
    opt = adamw(args)(pieces)
    step = median_time(opt.step, reps, device)
    return {"coll": fits, "compute": compute,
            "optimizer_per_element": step / sum(p.numel() for p in pieces)}


def median_time(fn, reps, device):
    """Seconds fn() takes, the median of `reps` calls after a warm-up, the slowest rank's."""
    fn()  # warm: the first call allocates, and sets up connections
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":  # a collective returns once queued: the clock is read
            torch.cuda.synchronize()  # when the GPU is done with it
        times.append(time.perf_counter() - t0)
    return _agree(statistics.median(times), device)


def _agree(seconds, device):  # the slowest rank's: a collective ends when its last rank does
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _line(xs, ys):
    """(a, b) of the least-squares line y = a + b·x, neither below 0."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    b = max(b, 0.0)
    return max(my - b * mx, 0.0), b


def calibrated_step(cal, stage, units, world, args):
    """The time model of zero.py's `stage` on this machine, with its calibration."""
    def coll(kind, nbytes, n, across):  # the calibrated line, measured at this job's N
        a, b = cal["coll"]["all_reduce" if kind.startswith("all_reduce") else kind]
        return a + b * nbytes if n > 1 else 0.0
    stepped = sum(e for e, _ in units) // (world if stage else 1)
    return step_time(stage, units, world, world, coll, cal["compute"],
                     cal["optimizer_per_element"] * stepped, args.grad_accum,
                     2 if args.bf16 else 4, 4, not args.no_overlap)


def measured_row(res, args):
    """What the table shows of one run: the numbers the report prints (the model state measured
    after the step, the bytes sent per step), the median step time and time spent waiting."""
    times = res["times"]  # the first step warms up: left out, unless it is the only one
    i = median_step(times, first=int(len(times) > 1))  # the median step, and its own waiting
    t = times[i]
    return {"state": sum(res["mem"].values()), "sent": sum(res["comm"].values()), "step": t,
            "waiting": res["waits"][i],
            "tokens/s": res["world"] * args.batch_size * args.seq_len * args.grad_accum / t}


def tradeoff_table(args):
    """--tradeoffs: train args at every stage (and --unit-sizes: with each of UNIT_SIZES) in
    this one launch; rank 0 prints the measured table and the calibrated prediction."""
    if args.shard_size:
        raise UsageError("--tradeoffs compares the stages over all N ranks: not with "
                         "--shard-size")
    _, world, device = setup(args.backend, args.device, args.timeout)
    cal = calibrate(args, device)
    sizes = UNIT_SIZES if args.unit_sizes else (args.units,)
    log0(f"zero.py at every stage, one launch: N = {world}, {args.steps} steps each, "
         f"{args.n_layer} blocks of d_model {args.d_model}, {args.batch_size} row(s) x "
         f"{args.seq_len} bytes per rank x {args.grad_accum} micro-batch(es)"
         + (", bf16" if args.bf16 else "") + "\n")
    log0(f"{'stage':<6}{'units':>6} {'model state':>12} {'sent/step':>11} {'step ms':>8} "
         f"{'waiting':>8} {'tokens/s':>9} | {'predicted':>9} {'waiting':>8} {'ratio':>6}")
    rows = []
    for units in sizes:
        for stage in range(4):
            res = train(argparse.Namespace(**{**vars(args), "stage": stage, "units": units}),
                        quiet=True)
            got = measured_row(res, args)
            want = calibrated_step(cal, stage, res["units"], world, args)
            rows.append((stage, units, got, want))
            waits = want["exposed"] - want["loss"]  # (the measured leaves the loss's out too)
            log0(f"{stage:<6}{units:>6} {got['state']:>12,} {got['sent']:>11,.0f} "
                 f"{got['step'] * 1e3:>8.1f} {got['waiting'] * 1e3:>8.1f} "
                 f"{got['tokens/s']:>9.0f} | {want['step'] * 1e3:>9.1f} "
                 f"{waits * 1e3:>8.1f} {got['step'] / want['step']:>6.2f}")
    fitted = "\n".join(f"  {k:<15} {a * 1e6:8.0f} µs + " + (f"bytes / {1 / b / 1e9:.3g} GB/s" if b
                       else "no time per byte (the sweep's slope was not above 0)")
                       for k, (a, b) in cal["coll"].items())
    log0("\nmodel state: bytes held per rank after the step; sent: bytes per rank per step; "
         "step ms: median step\n("
         + ("the first left out" if args.steps > 1 else "one step, with its warm-up")
         + f"); waiting: of it, the time the training "
         f"thread waited on collectives\n(measured inside their wait(); on CUDA, the compute "
         f"stream's stall, CUDA events).\npredicted: the time model (tradeoffs.py) calibrated "
         f"here, each collective a line through a sweep:\n{fitted}\n  forward + backward "
         f"{cal['compute'] * 1e3:.1f} ms a micro-batch; the optimizer "
         f"{cal['optimizer_per_element'] * 1e9:.2f} ns an element; its waiting leaves out the "
         "loop's\nall-reduce of the loss, as the measured does. ratio: measured / predicted. "
         f"On CPU compute and communication share the cores, which the\nmodel does not know, and "
         f"the sweep moves from run to run: read the ratios as rough.")
    return rows


if __name__ == "__main__":  # (its commands are zero.py's flags)
    raise SystemExit("tradeoffs.py: run it through zero.py: python zero.py --tradeoffs, or "
                     "python zero.py --estimate --params P --world-size N --cluster")
