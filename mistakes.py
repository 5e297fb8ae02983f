"""
mistakes.py: what breaks, and why. The classic mistakes of data-parallel and ZeRO training, each
run beside the right code on the same data, with the same seed, in the same launch, and measured
against single-process training on the global batch.

    torchrun --nproc_per_node=4 mistakes.py              # every mistake: one table
    torchrun --nproc_per_node=4 mistakes.py no-divide-sgd local-clip   # these, with detail
    python mistakes.py --list                            # the names, stages, one line each
    torchrun --nproc_per_node=4 mistakes.py --json mistakes.json       # the results as data

Each mistake is a diff of the right code, short enough to read. A mistake in the algorithm is a
subclass of one of zero.py's stage classes that overrides one method, the wrong line marked
`# WRONG`, exactly as the stages themselves are diffs of each other (class LateReduceScatter(
zero.ZeRO2) reduces in step() what ZeRO2 reduces during backward). A mistake in the training
loop is what differs in the loop (its own lines for the loss, handed to the right loop, train(),
or the line it leaves out), the wrong one marked the same way. Nothing is simulated: every
number below comes from running the wrong code and the right code.

How to read a row (from a run at N = 4):

    mistake                stage  measured                                     wrong        right
    late-reduce-scatter        2  peak gradient bytes                       28,520 B     15,080 B
      note: formula, grads: stage 2 4,804 B (+ the units in flight), stage 1 19,216 B
      why: Reduce-scattered after backward, every unit's full gradient is held at once: stage 1's
           peak, and more. It trains right; it saves nothing. Timing is the whole point of stage 2.
      right: ZeRO2._reduce_in_backward

`measured` says what: a loss gap (the global loss of each step against the reference's, the
largest over the steps), a distance (the largest difference of any parameter from the
reference's after the last step), the spread of the replicas (the largest difference between
two ranks' copies of one parameter: 0 when ranks agree), peak model-state bytes (zero.py's own
Meter, `opt.peak`, with `zero.memory_formula` on the note line), or what happened: an error's
first line, or a hang, ended by a short timeout. `wrong` is the mistake's number, `right` the
right code's, on the same data. `right:` names the place in zero.py that gets it right. Where a
guard of zero.py stops the mistake, the row shows both: what the guard says (`with the guard:`)
and, in the numbers, what happens without it. Named on the command line, a mistake also prints
its detail (the losses step by step, the second comparison, the distance of a run that only
costs memory).

The reference is a plain model stepped by a plain torch optimizer on the concatenation of every
rank's batch. Everything runs in float64 (the clipping row in float32: zero.py takes the norm in
float32), so that the right code meets the reference to within rounding, about 1e-15, and any
gap above that is the mistake's. The model is tiny (eight residual blocks, an embedding tied to
the output head, a second task's head that these steps never use), so that the whole lab runs
in well under a minute on two cores. A hang never hangs the lab: the collectives that would wait
for ever run on a process group of their own with a timeout of a few seconds, which ends the
wait with an error; the group is then abandoned and every rank meets again at a barrier.

The formulas are the ZeRO paper's (Rajbhandari et al., arXiv:1910.02054); zero.py is the code
that gets each of these right, and its docstring the lesson on what each stage does.
"""
import collections, contextlib, functools, inspect, io, json, os, statistics, textwrap, time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero
from checkpoints import writable, write_file  # (the files: checkpoints.py's)

# ----------------------------------------------------------------------------------------------
# The model, the data and the loop every mistake runs (and the reference runs too)

V, D, H, ROWS, T = 16, 8, 16, 2, 6  # vocab, width, hidden, rows per rank, tokens per row
BLOCKS = 8                          # the units: many small ones, as in a real model
STEPS = 6                           # optimizer steps per run (the tests run fewer: quick)
DTYPE = torch.float64               # rounding at 1e-16: a gap above that is the mistake's
HANG_S = 3                          # seconds before a collective no other rank makes is a hang
SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)
ADAMW = functools.partial(torch.optim.AdamW, lr=0.02, weight_decay=0.1)


class Tiny(nn.Module):
    """A tiny language model: embedding, BLOCKS residual blocks (the units: default_units finds
    them), a final norm and an output head tied to the embedding (one parameter, used twice). The
    second task's head `aux` is never used in these steps: it gets no gradient."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))
                                    for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight
        self.aux = nn.Linear(D, 2)

    def forward(self, x):  # x: [rows, T] token ids -> logits [rows, T, V]
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def build(seed=0, dtype=DTYPE):
    torch.manual_seed(seed)  # every rank the same weights (wrap() broadcasts rank 0's anyway)
    return Tiny().to(dtype)


def batch(step, world, micro=0, masked=False):
    """The global batch of (step, micro-batch): N*ROWS rows; rank r reads rows(r) of them, the
    reference all of them. masked: rows of different lengths (targets -100 past a row's end),
    rank r's rows shorter the higher r is: ranks hold different numbers of tokens."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randint(V, (world * ROWS, T), generator=g)
    y = (3 * x + 1) % V  # a target the model can learn
    if masked:
        length = T - torch.arange(world * ROWS) // ROWS % T  # rank r: T - r tokens a row
        y[torch.arange(T) >= length[:, None]] = -100
    return x, y


def rows(rank):
    return slice(rank * ROWS, (rank + 1) * ROWS)


def loss_of(model, x, y, keep=slice(None), reduction="mean"):  # over the rows `keep` (all: the
    # global batch), targets -100 not counted (cross_entropy's default ignore_index)
    return F.cross_entropy(model(x[keep]).flatten(0, 1), y[keep].flatten(), reduction=reduction)


def rank_mean(model, x, y):  # the loss of the loop: the mean over this rank's rows of the batch
    return loss_of(model, x, y, rows(dist.get_rank()))


def train(model, opt, steps, clip=None, accum=1, loss=rank_mean, masked=False, zero_grad=True):
    """The right loop (zero.py's interface), for every mistake in the algorithm: this rank's
    rows, backward (all micro-batches but the last under no_sync()), clip, step, zero_grad. A
    mistake in the loop hands in its own lines, loss(model, x, y) of the global batch (x, y),
    or leaves out zero_grad (zero_grad=False). Returns this rank's loss at each step (the
    reference's, one process: the global batch's; trained() averages the ranks')."""
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            x, y = batch(step, dist.get_world_size(), micro, masked)
            with opt.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                mine = loss(model, x, y) / accum
                mine.backward()
            total += mine.item()
        if clip:
            opt.clip_grad_norm_(clip)
        opt.step()
        if zero_grad:
            opt.zero_grad()
        losses.append(total)
    return losses


Run = collections.namedtuple("Run", "model opt losses gap distance")


def trained(cls, steps, optimizer=ADAMW, dtype=DTYPE, clip=None, accum=1, loss=rank_mean,
            masked=False, zero_grad=True, **options):
    """A fresh model (the same weights every time) and its optimizer cls(model, optimizer,
    **options), trained for `steps`: a Run (model, opt, the losses), measured against the
    reference of the same settings (the global batch's: a loss of the mistake's own lines, or
    zero_grad=False, is measured against the right loop's): its loss gap and distance."""
    model = build(dtype=dtype)
    opt = cls(model, optimizer, **options)
    # the loss of the global batch at each step, from each rank's mean (equal rows): every rank's
    # (zero.py's _all_ranks: one all-gather, in rank order), averaged
    mine = train(model, opt, steps, clip, accum, loss, masked, zero_grad)
    losses = [statistics.mean(step) for step in zip(*zero._all_ranks(mine, "cpu", DTYPE))]
    ref = reference(optimizer, steps, clip, accum, masked, dtype=dtype)
    gap = max(abs(a - b) for a, b in zip(losses, ref.losses))
    return Run(model, opt, losses, gap, distance(opt, dict(ref.model.named_parameters())))


@functools.lru_cache(maxsize=None)
def reference(optimizer, steps, clip=None, accum=1, masked=False, only=None, dtype=DTYPE):
    """Single-process training on the global batch (only=r: on rank r's rows alone): a plain
    model, a plain torch optimizer, in the same loop: train(). Returns a Run (its model as after
    the last step, the loss at each step; its gap and distance to itself: 0)."""
    model = build(dtype=dtype)
    opt = optimizer(model.parameters())
    # It, in the loop's interface (zero.py's), beside its own step and zero_grad: one process has
    # no ranks to sync; torch's clipping
    opt.no_sync = contextlib.nullcontext
    opt.clip_grad_norm_ = functools.partial(nn.utils.clip_grad_norm_, list(model.parameters()))
    # trained in place; the loss: of rank `only`'s rows, or of every row (the global batch)
    return Run(model, opt, train(model, opt, steps, clip, accum, functools.partial(
        loss_of, keep=slice(None) if only is None else rows(only)), masked), 0.0, 0.0)


# ----------------------------------------------------------------------------------------------
# What is measured

def distance(opt, ref_params):
    """The largest difference of any parameter from the reference's (full_state_dict: the values
    this rank holds at stages 0-2, the shards gathered at stage 3)."""
    full = opt.full_state_dict()
    return max((full[n] - ref_params[n]).abs().max().item() for n in ref_params)


def spread(model):
    """The replicas: the largest difference between two ranks' copies of one parameter, the
    values each rank computes with (stages 0-2 keep whole parameters). 0: the ranks agree."""
    mine = torch.cat([p.detach().flatten() for p in model.parameters()])
    # every rank's copy (zero.py's _all_ranks: one all-gather, in rank order), element by element
    return max(max(c) - min(c) for c in zip(*zero._all_ranks(mine.tolist(), "cpu", mine.dtype)))


def peak_bytes(wrong, right, kind, steps, accum=1):
    """The wrong and the right class's peak bytes of `kind` (zero.py's Meter, opt.peak) and
    their distances to the reference (the detail: a mistake that costs memory may train right);
    the note: the formula's bytes, at the stage the right code reaches and at the one the mistake
    falls back to (fp64 AdamW: 8 bytes a parameter, 8 a gradient, 16 of m and v)."""
    wrong, right = (trained(cls, steps, accum=accum) for cls in (wrong, right))
    (stage, extra), fallen = {"grads": ((2, "in flight"), 1), "params": ((3, "gathered"), 0)}[kind]
    formula = {s: zero.memory_formula(s, right.opt.psi, dist.get_world_size(), 8, 8, 16)[kind]
               for s in (stage, fallen)}
    return {"wrong": wrong.opt.peak[kind], "right": right.opt.peak[kind],
            "wrong_distance": wrong.distance, "right_distance": right.distance,
            "note": f"formula, {kind}: stage {stage} {formula[stage]:,.0f} B (+ the units "
                    f"{extra}), stage {fallen} {formula[fallen]:,.0f} B",
            "detail": [f"distance to the reference: wrong {wrong.distance:.2e}, right "
                       f"{right.distance:.1e}"]}


def first_line(e):
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"


def outcome(run):  # run()'s number, or the error it raised: the mistake's, or zero.py's guard's
    try:
        return run()
    except RuntimeError as e:
        return first_line(e)


# ----------------------------------------------------------------------------------------------
# The mistakes. Each is registered with what it measures, at which stage it runs here (and at
# which it applies) and the place in zero.py that gets it right. Its function runs the wrong code
# and the right code and returns both numbers; its docstring says why it breaks (at most three
# lines, as the table prints them).

# name: the function's (no-divide-sgd for no_divide_sgd); stages: where the mistake applies;
# stage: the stage it runs at here; measure: what the numbers are; where: the zero.py function or
# method that gets it right; why: the function's docstring
Mistake = collections.namedtuple("Mistake", "name stages stage measure where why run")
MISTAKES = {}


def mistake(stages, stage, measure, where):
    def register(fn):
        name = fn.__name__.replace("_", "-")
        MISTAKES[name] = Mistake(name, stages, stage, measure, where, inspect.getdoc(fn), fn)
        return fn
    return register


# --- the reduction: divide by N ---------------------------------------------------------------

class NoDivide(zero.ZeRO1):
    """ZeRO1 whose step forgets to divide the reduced gradient by N."""

    def _reduce_grads(self):  # DataParallel's, not super(): ZeRO1's divides
        zero.DataParallel._reduce_grads(self)  # reduce-scatter: the shard holds the sum
        # WRONG: ZeRO1 then divides, unit.grad_shard.div_(self.N) for each unit: the sum -> the mean


def no_divide(optimizer, steps):
    # (cls(model, ...) as zero.wrap(model, 1, ...) builds it)
    wrong, right = trained(NoDivide, steps, optimizer), trained(zero.ZeRO1, steps, optimizer)
    runs = [("reference", reference(optimizer, steps)), ("wrong", wrong), ("right", right)]
    return {"wrong": wrong.gap, "right": right.gap, "detail": [
        *(f"loss at each step, {label:<9}" + " ".join(f"{v:10.6g}" for v in run.losses)
          for label, run in runs), f"parameters' distance to the reference: wrong "
        f"{wrong.distance:.2e}, right {right.distance:.2e}"]}


@mistake("0-3", 1, "loss gap to the reference, max", "ZeRO1._reduce_grads")
def no_divide_sgd(quick):
    """The reduction sums the N ranks' gradients: the gradient of N times the loss. SGD's step
    is N times too large from the first step on."""
    return no_divide(SGD, 3 if quick else STEPS)


@mistake("0-3", 1, "loss gap to the reference, max", "ZeRO1._reduce_grads")
def no_divide_adamw(quick):
    """The same missing division, under AdamW: Adam divides m by sqrt(v), and the scale N
    cancels but for epsilon (and clipping). Almost invisible; still wrong."""
    return no_divide(ADAMW, 3 if quick else STEPS)


# --- stage 2: when the gradient is reduced ----------------------------------------------------

class LateReduceScatter(zero.ZeRO2):
    """ZeRO2 that reduce-scatters in step(), after backward has finished."""

    def _reduce_in_backward(self):
        return False  # WRONG: ZeRO2 returns True: reduce each unit as soon as its gradient is whole


class NoSyncKeepsGradients(zero.ZeRO2):
    """ZeRO2 that honours no_sync() as stage 1 does: no reduction until the last micro-batch."""

    def _reduce_in_backward(self):
        return self._sync  # WRONG: under no_sync() the full [N*S] gradient stays until later


@mistake("2", 2, "peak gradient bytes", "ZeRO2._reduce_in_backward")
def late_reduce_scatter(quick):
    """Reduce-scattered after backward, every unit's full gradient is held at once: stage 1's
    peak, and more. It trains right; it saves nothing. Timing is the whole point of stage 2."""
    return peak_bytes(LateReduceScatter, zero.ZeRO2, "grads", 2 if quick else 3)


@mistake("2", 2, "peak gradient bytes", "ZeRO2._reduce_in_backward")
def no_sync_stage_2(quick):
    """no_sync() defers the reduction, so the full gradient lives until the last micro-batch:
    stage 1's memory, and more. Here it also loses the first micro-batch: ZeRO2 keeps no
    p.grad to add to, so the next backward overwrites it. ZeRO2 reduce-scatters in every
    backward."""
    return peak_bytes(NoSyncKeepsGradients, zero.ZeRO2, "grads", 2 if quick else 3, accum=2)


# --- stage 3: gather what computes ------------------------------------------------------------

class NoRegather(zero.ZeRO3):
    """ZeRO3 that frees a unit after forward and does not gather it again for backward."""

    def _pre_backward(self, units, call, grad):
        # WRONG: ZeRO3 gathers here (self._gather(u) for u in units); backward then reads freed
        # parameters: autograd saved views of the unit's storage, which _free shrank to 0 bytes
        self.prefetcher.backward_started(call)


@mistake("3", 3, "the first step: its loss, or the error", "ZeRO3._pre_backward")
def no_regather(quick):
    """Forward freed each unit; backward needs its parameters again (x.grad = grad @ W). Not
    gathered again, they are memory given back: an error, or worse, garbage."""
    return {name: outcome(lambda: trained(cls, 1).losses[0])  # the first step's loss, if any
            for name, cls in [("wrong", NoRegather), ("right", zero.ZeRO3)]}


@mistake("3", 3, "peak parameter bytes", "zero.default_units (the blocks)")
def one_unit(quick):
    """With units=[] the whole model is one unit: gathered whole before the first module
    computes. It trains right; each rank's peak: every parameter (stage 0's) beside its shard."""
    # The wrong class, then the right one (zero.ZeRO3(model, ...) as zero.wrap(model, 3, ...)
    # builds it). WRONG: units=[]
    return peak_bytes(functools.partial(zero.ZeRO3, units=[]), zero.ZeRO3, "params", 2)


# --- replicas: every rank must compute with the same weights ----------------------------------

@mistake("0-3", 0, "replicas' spread after the steps", "DataParallel.__init__ (its broadcast)")
def different_seeds(quick):
    """Each rank built its own random weights. The mean gradient moves every replica alike,
    so they never meet. wrap() broadcasts rank 0's (stages 1-2: the all-gather after the
    step would hide it, every rank then holding a patchwork of the ranks' inits)."""
    out = {"guard": "wrap() broadcasts rank 0's weights: with it, ranks' seeds do not matter"}
    for name in ("wrong", "right"):
        model = build(seed=dist.get_rank())  # the mistake: a seed per rank
        opt = zero.wrap(model, 0, ADAMW)  # broadcasts rank 0's weights to every rank
        if name == "wrong":
            # The broadcast is a line of DataParallel.__init__, not a method to override: wrap()
            # without it would leave each rank its own weights, which this puts back in place
            # (at stage 0 a parameter is a view of its unit's flat buffer, what the step steps:
            # load_state_dict copies into it). WRONG: every rank its own random weights
            model.load_state_dict(build(seed=dist.get_rank()).state_dict())
        train(model, opt, 2 if quick else STEPS)
        out[name] = spread(model)
    return out


class NoGatherAfterStep(zero.ZeRO1):
    """ZeRO1 that steps its shard and never all-gathers the updated shards."""

    def _gather_params(self):
        pass  # WRONG: ZeRO1 all-gathers every unit's updated shards into every rank's parameters


@mistake("1-2", 1, "replicas' spread after the steps", "ZeRO1._gather_params")
def no_gather_after_step(quick):
    """Each rank updated only its own shard; the rest of its parameters are stale and differ
    from rank to rank. The replicas drift apart, and every forward computes with a mix."""
    wrong, right = (trained(cls, 3 if quick else STEPS) for cls in (NoGatherAfterStep, zero.ZeRO1))
    return {"wrong": spread(wrong.model), "right": spread(right.model), "detail": [
        f"loss gap to the reference, max: wrong {wrong.gap:.2e}, right {right.gap:.1e}"]}


# --- the step: clipping, and parameters without a gradient ------------------------------------

class LocalClip(zero.ZeRO1):
    """ZeRO1 that clips each rank's shard by that shard's own norm."""

    def _sum_of_squares(self):
        # WRONG: ZeRO1 adds up every rank's: dist.all_reduce(squares, group=self.group)
        return zero.DataParallel._sum_of_squares(self)  # this rank's [S] shards' squares


@mistake("1-3", 1, "distance to the reference, in float32", "ZeRO1._sum_of_squares")
def local_clip(quick):
    """The norm to clip by is the whole gradient's. Each rank's shard norm is smaller, and
    differs: each shard is scaled by its own factor, the update points somewhere else."""
    # float32 here: zero.py's clip_grad_norm_ takes the norm in float32, of float32 gradients
    return {name: trained(cls, 3 if quick else STEPS, SGD, torch.float32, clip=0.05).distance
            for name, cls in [("wrong", LocalClip), ("right", zero.ZeRO1)]}


class StepsWithoutGradient(zero.DataParallel):
    """DataParallel that steps every parameter, as if one without a gradient had a zero one."""

    def _reduce_grads(self):
        super()._reduce_grads()  # with_grad: the parameters some rank got a gradient for
        self.with_grad = {p for u in self.units for p in u.params}  # WRONG: all of them


@mistake("0-3", 0, "how far the unused head moved", "DataParallel.step (a .grad of None: skipped)")
def step_without_gradient(quick):
    """A zero gradient is not no gradient: AdamW still decays the weight (and a past step's
    m and v still move it). torch skips a parameter whose .grad is None; so does zero.py."""
    steps = 2 if quick else STEPS
    before = build().aux.weight.detach()  # (every fresh model: the same weights)
    out = {name: distance(trained(cls, steps).opt, {"aux.weight": before})  # how far it moved
           for name, cls in [("wrong", StepsWithoutGradient), ("right", zero.DataParallel)]}
    moved = (reference(ADAMW, steps).model.aux.weight - before).abs().max().item()
    out["detail"] = [f"the reference (plain torch: aux.grad is None) moved it {moved:.1e}"]
    return out


# --- the data: each rank its own rows, each token its weight ----------------------------------

@mistake("0-3", 1, "distance to the global-batch reference", "zero.get_batch (rank r's own rows)")
def same_batch(quick):
    """Every rank read rank 0's rows: N times the compute for one rank's batch. It trains
    exactly like one process on that batch, not like the global batch."""
    steps = 3 if quick else STEPS
    ref_one = dict(reference(SGD, steps, only=0).model.named_parameters())  # rank 0's rows alone
    # WRONG: rows(0), rank 0's rows, on every rank (the right loop's rank_mean: rows(rank))
    wrong, right = (trained(zero.ZeRO1, steps, SGD, loss=loss) for loss in [
        lambda model, x, y: loss_of(model, x, y, rows(0)), rank_mean])
    out = {"wrong": wrong.distance, "right": right.distance,  # to the global batch's reference
           "wrong_one": distance(wrong.opt, ref_one), "right_one": distance(right.opt, ref_one)}
    out["detail"] = [f"distance to one process on rank 0's rows alone: wrong "
                     f"{out['wrong_one']:.1e}, right {out['right_one']:.2e}"]
    return out


@mistake("0-3", 1, "distance to the reference",
         "the loop (zero.py divides the sum over ranks by N: ZeRO1._reduce_grads)")
def token_mean_per_rank(quick):
    """Each rank's mean over its own tokens, averaged over ranks, weighs a token of a short
    batch more than one of a long batch. Sum the tokens' losses; divide by the global count."""
    world, steps = dist.get_world_size(), 3 if quick else STEPS

    def token_sum(model, x, y):  # the sum over this rank's tokens / the global count, x N:
        mine = rows(dist.get_rank())  # zero.py divides by N
        tokens = torch.tensor(float((y[mine] != -100).sum()), dtype=DTYPE)
        dist.all_reduce(tokens)
        return loss_of(model, x, y, mine, "sum") * world / tokens

    # WRONG: rank_mean, the loop's loss: the mean over this rank's tokens. (The reference's:
    # the mean over every token.)
    out = {name: trained(zero.ZeRO1, steps, SGD, loss=loss, masked=True).distance
           for name, loss in [("wrong", rank_mean), ("right", token_sum)]}
    y = batch(0, world, masked=True)[1]
    out["detail"] = [f"tokens per rank: {[int((y[rows(r)] != -100).sum()) for r in range(world)]}"]
    return out


@mistake("0-3", 2, "distance to the reference", "DataParallel._reduce_unit (reduce_dtype: fp32)")
def bf16_reduce(quick):
    """Reduced in bfloat16 (8 bits of mantissa), each rank's gradient is rounded to about 3
    digits before it is summed, and the sum again: every step is off. Reduce in fp32."""
    # (zero.ZeRO2(model, ...) as zero.wrap(model, 2, ...) builds it)
    return {name: trained(zero.ZeRO2, 3 if quick else STEPS, reduce_dtype=dtype).distance
            for name, dtype in [("wrong", torch.bfloat16), ("right", None)]}  # WRONG: bfloat16


@mistake("1-3", 2, "how far the parameters moved", "zero.wrap (its optimizer steps the shards)")
def optimizer_before_wrap(quick):
    """A torch optimizer built over model.parameters() steps p with p.grad: at stage 2 that is
    None (each unit's gradient is reduced into this rank's shard). Nothing trains."""
    before = {n: p.detach() for n, p in build().named_parameters()}  # every fresh model's

    def moved(name):
        model = build()
        plain = torch.optim.AdamW(model.parameters(), lr=0.02)  # a torch optimizer, before wrap()
        opt = zero.wrap(model, 2, ADAMW)  # the optimizer wrap() returns: it steps the shards
        train(model, plain if name == "wrong" else opt, 2 if quick else 3)  # WRONG: plain
        return distance(opt, before)
    return {name: moved(name) for name in ("wrong", "right")}


@mistake("3", 3, "the saved weights, loaded: distance",
         "zero.guard_sharded_parameters; opt.full_state_dict()")
def state_dict_at_stage_3(quick):
    """Between steps a stage-3 parameter's storage is freed: its state_dict holds no values.
    torch.save writes the file all the same, and only loading it fails. zero.py refuses the
    read; opt.full_state_dict() gathers the shards, checkpoints.save_checkpoint saves them."""
    def saved_and_loaded(name):
        model, opt, *_ = trained(zero.ZeRO3, 1)
        if name == "wrong":  # the guard taken off: wrap() made every parameter a ShardedParameter
            for p in model.parameters():
                p.__class__ = nn.Parameter
        file = io.BytesIO()
        try:  # WRONG: model.state_dict(), the model's own, at stage 3 (right: the shards gathered)
            torch.save(opt.full_state_dict() if name == "right" else model.state_dict(), file)
            return distance(opt, torch.load(io.BytesIO(file.getvalue())))  # loaded back
        except RuntimeError as e:
            saved = len(file.getvalue())  # 0 where the guard refused to read the model
            return (f"torch.save wrote {saved:,} bytes; torch.load: " if saved else
                    "") + first_line(e)
    return {name: saved_and_loaded(name) for name in ("guard", "wrong", "right")}


# --- ranks out of step: a collective no other rank makes, units reduced in another order -------

@mistake("3", 3, "an evaluation forward", "ZeRO3._pre_forward")
def eval_on_rank_0(quick):
    """At stage 3 a forward is collectives: each unit is all-gathered before it computes. On
    rank 0 alone, its all-gather waits for partners that never come. Every rank evaluates."""
    x, y = batch(99, dist.get_world_size())
    out = {"wrong": "(rank 0 evaluated alone)"}  # on the other ranks
    for name in ("wrong", "right"):
        model, opt, *_ = trained(zero.ZeRO3, 1)
        # A group of its own with a short timeout (made by every rank, as new_group must be), so
        # that the wait ends: zero.py's stage 3 runs its collectives on opt.group.
        opt.group = dist.new_group(timeout=timedelta(seconds=1 if quick else HANG_S))
        start = time.perf_counter()
        try:
            # WRONG: `if rank == 0:` evaluates on rank 0 alone
            if name == "right" or dist.get_rank() == 0:
                with torch.no_grad():  # (every rank the same global batch: the same loss)
                    out[name] = loss_of(model, x, y).item()
        except RuntimeError as e:  # gloo's message starts with its source file: keep the end
            said = str(e).strip().splitlines()[0].split("] ")[-1]
            out[name] = (f"hang: rank 0 waited in an all-gather no other rank made, ended by the "
                         f"group's timeout after {time.perf_counter() - start:.1f} s ({said})")
        dist.barrier()  # every rank back in step, on the default group; opt.group is abandoned
        # (the wrong run's ZeRO3 is left half-gathered on rank 0: not used again)
    return out


class OtherOrder(zero.DataParallel):
    """DataParallel (reducing in step(): overlap=False) whose odd ranks reduce the first two units
    the other way round. Both are blocks of one size: the all-reduces pair without an error."""

    def _reduce_grads(self):
        units = self.units
        if self.rank % 2:
            self.units = [units[1], units[0], *units[2:]]  # WRONG: another order on odd ranks
        super()._reduce_grads()  # (where the guard stops the step, this optimizer is dropped)
        self.units = units


@mistake("0-3", 0, "replicas' spread (no check)", "zero.check_step_agrees")
def units_out_of_order(quick):
    """Rank 0's block 0 is summed with rank 1's block 1: every number is wrong, no collective
    fails. zero.py fingerprints what each rank reduced, and stops the step if they differ."""
    run = functools.partial(trained, steps=2 if quick else 3, overlap=False)
    # wrong: OtherOrder without check_steps
    return {name: outcome(lambda: spread(run(cls, check_steps=name != "wrong").model)) for name, cls
            in [("guard", OtherOrder), ("wrong", OtherOrder), ("right", zero.DataParallel)]}


class NoBackwardAfterStepCheck(zero.ZeRO1):
    """ZeRO1 without its refusal of a backward after step() (before zero_grad())."""

    def _on_grad(self, unit, p):
        self._reduced = False  # WRONG: clears the flag that makes this an error; backward goes on
        super()._on_grad(unit, p)


@mistake("0-3", 1, "distance to the reference (no check)", "DataParallel._on_grad")
def no_zero_grad(quick):
    """Without zero_grad() each backward adds to the last step's averaged gradient, which
    keeps pushing: every past step is applied again. zero.py refuses that backward."""
    # WRONG: zero_grad=False, the loop of the other two without opt.zero_grad() after step()
    return {name: outcome(lambda: trained(cls, 3 if quick else STEPS, SGD,
                                          zero_grad=name == "right").distance) for name, cls in
            [("guard", zero.ZeRO1), ("wrong", NoBackwardAfterStepCheck), ("right", zero.ZeRO1)]}


# ----------------------------------------------------------------------------------------------
# The table, --list, --json and the command line

def shown(v):
    """A number for the table: bytes as integers, anything else in 3 digits; a line: its kind."""
    if isinstance(v, str):
        return "hang" if v.startswith("hang") else "error"
    return f"{v:,} B" if isinstance(v, int) else f"{v:.2e}" if v else "0"


def row(m, res, detail):
    """A mistake's lines in the table: the numbers, then (within 100 columns) an error's or a
    hang's line, what the guard says, a formula, why, and where zero.py gets it right."""
    lines = [f"{m.name:<22} {m.stage:>5}  {m.measure:<37} {shown(res['wrong']):>12} "
             f"{shown(res['right']):>12}"]
    said = [(label, res[key]) for key, label in [("wrong", "wrong"), ("right", "right"),
            ("guard", "with the guard"), ("note", "note")] if isinstance(res.get(key), str)]
    for label, text in said:
        lines += textwrap.wrap(text, 98, initial_indent=f"  {label}: ", subsequent_indent="    ")
    lines += ("  why: " + m.why.replace("\n", "\n       ")).splitlines() + [f"  right: {m.where}"]
    return lines + ([f"  {d}" for d in res.get("detail", [])] if detail else [])


def run_lab(names, quick=False):
    """Every rank runs the named mistakes (default all), in turn: {name: result}. The ranks stay
    in step: each mistake's collectives pair up, and eval-on-rank-0, whose rank 0 waits alone,
    meets again at a barrier of its own (its hang's group abandoned)."""
    torch.set_num_threads(1)
    return {name: MISTAKES[name].run(quick) for name in names or MISTAKES}


def main(argv=None):
    p = zero.Parser(description="Classic data-parallel and ZeRO mistakes, beside the right code",
                    formatter_class=zero._ShowDefaults)
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="mistakes to run, with detail (default: every one, one table)")
    p.add_argument("--list", action="store_true", help="print the names and stages, and exit")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE (default: none)")
    args = p.parse_args(argv)
    unknown = next((name for name in args.names if name not in MISTAKES), None)
    where = os.path.dirname(args.json or "") or "."  # --json's directory
    for bad, message in [
            (args.list and (args.names or args.json), "--list: not with names or --json"),
            (args.json == "", "--json '': an empty name"),  # (else no file, and no word of it)
            (unknown is not None, f"no mistake named {unknown!r}; see `python mistakes.py --list`"),
            (args.json and os.path.isdir(args.json), f"--json {args.json}: is a directory"),
            (args.json and not os.path.isdir(where), f"--json {args.json}: no directory {where}"),
            (args.json and not writable(where), f"--json {args.json}: cannot write in {where}")]:
        if bad:
            raise zero.UsageError(message)
    if args.list:
        for m in MISTAKES.values():
            word = "stages" if "-" in m.stages else "stage "
            print(f"{m.name:<22} {word} {m.stages:<4} (runs at {m.stage}): {m.measure}")
        return
    start = time.perf_counter()
    rank, world, _ = zero.setup(backend="gloo", device="cpu")
    if world < 2:  # one rank has nothing to reduce, replicate or hang on: every row reads 0
        raise zero.UsageError("needs 2 or more ranks: torchrun --nproc_per_node=4 mistakes.py")
    results = run_lab(args.names)
    if rank != 0:
        return
    what = f"{len(results)} mistake{'s' * (len(results) > 1)}"
    print(f"{what} at N = {world} ranks (gloo, CPU, float64 unless said), beside the right code;\n"
          "reference: one process, plain torch, on the global batch\n\n"
          f"{'mistake':<22} {'stage':>5}  {'measured':<37} {'wrong':>12} {'right':>12}\n{'-' * 93}")
    for name, res in results.items():
        print("\n".join(row(MISTAKES[name], res, detail=bool(args.names))))
    print(f"\nwall time: {time.perf_counter() - start:.1f} s")
    if args.json:
        rows = [dict(name=n, stages=m.stages, stage=m.stage, measure=m.measure, wrong=r["wrong"],
                     right=r["right"], why=" ".join(m.why.splitlines()), where=m.where,
                     **({"guard": r["guard"]} if "guard" in r else {}), detail=r.get("detail", []))
                for n, r in results.items() for m in [MISTAKES[n]]]
        write_file(args.json, json.dumps(rows, indent=1))


if __name__ == "__main__":
    zero.run(main)
