"""
checkpoints.py: sharded checkpoints for zero.py's stages, readable at any stage and world size.

    torchrun --nproc_per_node=4 zero.py --ckpt-dir ckpt --ckpt-every 10   # write, and resume
    torchrun --nproc_per_node=2 zero.py --stage 3 --resume-from ckpt      # another N and stage
    python zero.py --consolidate ckpt --out model.safetensors             # one file for the model

What it is: the content of a checkpoint (each rank's part, in the model's coordinates, and how a
part is cut back into what a rank of another job owns), the files (written atomically, one job
per directory, rotated, checked against a manifest of sizes and hashes before anything is
loaded), consolidation into one plain state_dict (which --init-from reads back), and
interoperation with torch.distributed.checkpoint (DCP), which fsdp_demo.py's FSDP2 runs use.

What it uses of zero.py: the Unit layout (unit.flat, offset, stepped, master, pieces),
zero.layout() (the names and shapes each unit holds), zero.replicated(), zero.all_gather,
zero._all_ranks and zero.split_pieces. zero.py imports this file where a checkpoint is first
needed: opt.state_dict(), opt.full_state_dict(), --ckpt-dir, --resume-from, --consolidate,
--init-from.
"""
import contextlib, functools, hashlib, itertools, json, math, os, pathlib, re, shutil, \
    stat, sys, tempfile, warnings, zipfile

import torch
import torch.distributed as dist
import safetensors.torch
from safetensors import SafetensorError
from torch.utils._pytree import tree_map, tree_map_only

from zero import (UsageError, _all_ranks, all_gather, keep_writes, layout, replicated,
                  same_on_every_rank, split_pieces)


class CheckpointError(UsageError):
    """A checkpoint that does not fit (another model, a missing, truncated or corrupt file)."""


def _canonical(x):  # the same text for equal values (a tensor: by its str)
    return json.dumps(x, sort_keys=True, default=str)


def _wide(t):
    """t in float32, or kept in float64: the masters' precision."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


# ----------------------------------------------------------------------------------------------
# Checkpoints. A checkpoint must outlive its job's shape: it is written by N ranks at one stage
# and may be read by M ranks at another. So what a rank writes is stated in the coordinates of
# the model, not of the sharding: its 1/N of each unit's elements (stage 0 too: every rank holds
# everything, each writes 1/N of it), fp32 master values and each per-element optimizer state
# (Adam's m and v), plus the names and shapes of the parameters in each unit's flat order
# (layout()). Reading cuts what a rank owns now out of the parts that hold it, parameter by
# parameter, by name. The files: save_checkpoint() below.

def part_index(rank, world, G):
    """The part of a checkpoint rank `rank` writes: rank itself, unless G < N, where the N/G
    ranks holding one shard each write one Nth of it (units are padded to a multiple of N)."""
    return rank % G * (world // G) + rank // G


def checkpoint_part(zero):
    """opt.state_dict(): this rank's part of a checkpoint: elements [rank*S, (rank+1)*S) of each
    unit's fp32 master weights and per-element optimizer state, the optimizer scalars (Adam's
    step count) of each parameter it steps, and hyper-parameters, the layout; rank 0 also the
    frozen parameters and buffers. Every tensor a copy on the CPU, made piece by piece: a save
    holds no more device memory than training does, and loads where there is no GPU."""
    units, q = [], part_index(zero.rank, zero.world, zero.N)
    _written(zero)
    names = {p: n for n, p in zero.model.named_parameters()}
    state = {piece: zero.optimizer.state.get(piece, {}) for u in zero.units for piece in u.pieces}
    per_element = lambda v, piece: torch.is_tensor(v) and v.shape == piece.shape  # noqa: E731
    keys = list(dict.fromkeys(k for piece, st in state.items() for k, v in st.items()
                              if per_element(v, piece)))  # Adam's m and v
    # Scalars per parameter, by name: one that got no gradient in some steps was stepped fewer
    # times (Adam's step count, which its bias correction reads). A parameter absent: the
    # optimizer holds no state for it yet (never stepped), and its per-element state is zeros.
    # Each a copy: a later step must not change it.
    scalars = {names[p]: {k: v.to("cpu", copy=True) if torch.is_tensor(v) else v
                          for k, v in state[piece].items() if not per_element(v, piece)}
               for u in zero.units for piece, owners in zip(u.pieces, u.owners)
               if state[piece] for p in owners}
    for u in zero.units:
        # one Nth of the unit's elements, rounded up, as readers size a part (_reader,
        # _part_problem): part q is [q*S, (q+1)*S). Not flat's Nth, the same but for a unit of
        # no elements, which flat pads to one element a rank.
        S = -(-sum(p.numel() for p in u.params) // zero.world)
        lo = q * S - u.stepped.start  # where part q starts in what this rank steps (stage 0:
        # everything, so it writes 1/N; from stage 1: its shard, or with G < N one of its parts)
        units.append({"master": _slice_of(u.pieces, lo, S), "state": {k: _slice_of(
            [state[piece].get(k, torch.zeros_like(piece, device="cpu")) for piece in u.pieces],
            lo, S) for k in keys}})
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in zero.optimizer.param_groups]
    return {"rank": q, "units": units, "param_scalars": scalars, "hyper": hyper,
            "optimizer": type(zero.optimizer).__name__, "layout": layout(zero),
            "replicated": {n: t.detach().to("cpu", copy=True) for n, t in replicated(zero.model)}
            if zero.rank == 0 else {}}


def _slice_of(tensors, lo, S):
    """[S] on the CPU, a new tensor: elements [lo, lo + S) of `tensors` end to end (a unit's
    pieces, or their optimizer state), each sliced before it is copied."""
    starts = itertools.accumulate((t.numel() for t in tensors), initial=0)
    return _wide(torch.cat([t.detach()[max(lo - a, 0):max(lo + S - a, 0)].cpu()
                            for t, a in zip(tensors, starts)]))


def load_own_part(zero, state):
    """opt.load_state_dict(opt.state_dict()), on the same ranks, as with any torch optimizer.
    Every rank calls it: a rank may step more than the part it wrote (all of the model at stage
    0, N/G parts with hybrid sharding), and gets the rest from the ranks that wrote it."""
    q = part_index(zero.rank, zero.world, zero.N)
    with _agreed(zero.device):  # one rank's refusal is every rank's: none waits
        if not isinstance(state, dict) or state.get("rank") != q or state.get("layout") != \
                layout(zero) or state.get("optimizer") != type(zero.optimizer).__name__:
            raise CheckpointError("load_state_dict() takes this rank's state_dict() of this model "
                                  "and optimizer at this stage and N; else use load_checkpoint()")
        if problem := _part_problem(state, q, state["layout"]):  # (edited since state_dict())
            raise CheckpointError(f"load_state_dict(): this rank's state_dict {problem}")
        another_optimizer(state["optimizer"], state.get("hyper"), zero.optimizer)
    # the ranks that wrote what this rank steps: at stage 0 all of them; from stage 1 this one,
    # and with hybrid sharding its replicas (the ranks of its replica group). Their parts are
    # all-gathered from each one's own; the others' are not needed.
    ranks = range(zero.world) if zero.stage == 0 else range(zero.rank % zero.N, zero.world, zero.N)
    # Stage 0: every rank steps all, so the same states in one order (else one rank's edit gathers
    # exp_avg into exp_avg_sq's place); from stage 1, a rank lacks those of what it never stepped
    if zero.stage == 0:
        same_on_every_rank({f"unit {i}'s optimizer states": list(u["state"]) for i, u in
                            enumerate(state["units"])}, zero.device, "zero: load_state_dict(): ")

    def gather(t):  # [len(ranks), numel]: row j is rank ranks[j]'s t
        if len(ranks) == 1:  # this rank's own part only
            return t.view(1, -1)
        every = torch.empty(len(ranks) * t.numel(), dtype=t.dtype, device=zero.device)
        all_gather(every, t.to(zero.device), group=zero.replica_group)  # (stage 0: None, all ranks)
        return every.cpu().view(len(ranks), -1)
    units = tree_map(gather, state["units"])  # each tensor of each unit: master, each state
    parts = {part_index(r, zero.world, zero.N): {"units": tree_map(lambda t: t[j], units)}
             for j, r in enumerate(ranks)}  # (what _reader reads of a part: its units)
    # the scalars, hyper-parameters and state keys: this rank's, as its replicas'; the frozen
    # parameters and buffers: rank 0's own (none elsewhere), then broadcast
    load_values(zero, _reader(parts, state["layout"]), checkpoint_state_keys([state]),
                state["param_scalars"], state["hyper"], state["replicated"])
    for _, t in replicated(zero.model):  # only rank 0's part holds them
        dist.broadcast(t.data, src=0)


def _reader(parts, written):
    """read(name, lo, hi, key): elements [lo, hi) of a parameter (by name, flattened) of its
    master weights (key "master") or of an optimizer state, which the writer (its layout()
    `written`) cut into its world_size parts of each unit (parts[q]: part q; only those read
    need be there): a view where one part holds them all, else a copy. A part without state: the
    optimizer had none there (zeros)."""
    where = {}  # parameter name -> (writer's unit, offset in its flat, the unit's part size S)
    for i, params in enumerate(written["units"]):
        o, S = 0, -(-sum(math.prod(s) for _, s in params) // written["world_size"])
        for name, shape in params:
            where[name], o = (i, o, S), o + math.prod(shape)

    def read(name, lo, hi, key):
        i, o, S = where[name]
        if lo == hi:  # a parameter of no elements, in its part's dtype (its unit may hold none)
            return parts[0]["units"][i]["master"][:0]
        lo, hi, out = o + lo, o + hi, []
        for q in range(lo // S, -(-hi // S)):  # the ranks that wrote elements [lo, hi)
            unit = parts[q]["units"][i]
            t = unit["master"] if key == "master" else unit["state"].get(key, torch.zeros(S))
            out.append(t[max(lo - q * S, 0):hi - q * S])
        return out[0] if len(out) == 1 else torch.cat(out)
    return read


def load_values(zero, read, keys, scalars, hyper, frozen):
    """Load what read(name, lo, hi, key) gives, elements [lo, hi) of a parameter (by name,
    flattened) of its master weights (key "master") or of each per-element optimizer state in
    `keys`, into the elements this rank steps; `scalars` {name: optimizer scalars} for each
    parameter the optimizer has state for; `hyper` the param_groups without their params;
    `frozen` {name: tensor} of the frozen parameters and buffers (one absent: left as it is).
    Exact: each element's values are copied, not recomputed (a checkpoint of any stage and world
    size: the parts read by _reader; a DCP checkpoint: load_dcp)."""
    names = {p: n for n, p in zero.model.named_parameters()}
    state = {}
    with torch.no_grad():
        for u in zero.units:
            lo = u.stepped.start  # this rank's elements of the unit: [lo, lo + numel of master)
            # the masters and each state, in the masters' precision, on the CPU; padding 0
            values = {k: _wide(torch.zeros_like(u.master, device="cpu")) for k in ["master", *keys]}
            for p in u.params:
                a, b = max(u.offset[p], lo), min(u.offset[p] + p.numel(), lo + u.master.numel())
                if a < b:  # p has elements in this rank's range: fetch them by p's name
                    for k, t in values.items():
                        t[a - lo:b - lo] = read(names[p], a - u.offset[p], b - u.offset[p], k)
            u.master.copy_(values.pop("master"))
            u.shard.copy_(u.master)  # the same tensor, unless mixed precision
            if any(len({_canonical(scalars.get(names[p])) for p in o}) > 1 for o in u.owners):
                split_pieces(zero, [u])  # parameters of one piece stepped apart: one piece each
            chunks = (t.split([piece.numel() for piece in u.pieces]) for t in values.values())
            # (the parameters of a piece have the same scalars: its first one's)
            for piece, owners, *chunk in zip(u.pieces, u.owners, *chunks):
                if (n := names[owners[0]]) in scalars:  # the optimizer has state (it was stepped)
                    state[piece] = dict(zip(values, chunk)) | tree_map_only(
                        torch.Tensor, torch.clone, scalars[n])  # the scalars: copies
        for n, t in replicated(zero.model):  # (one absent: as it is; load_own_part broadcasts)
            t.copy_(frozen.get(n, t))
    # (the pieces now: split_pieces may have cut some)
    index = {piece: i for i, piece in enumerate(p for u in zero.units for p in u.pieces)}
    groups = [{**h, "params": g["params"]}  # the checkpoint's hyper-parameters, this one's params
              for h, g in zip(hyper, zero.optimizer.state_dict()["param_groups"])]
    zero.optimizer.load_state_dict({"state": {index[p]: st for p, st in state.items()},
                                    "param_groups": groups})
    zero.zero_grad()
    zero._gather_params()  # rebuild the full parameters from the shards (stages 1 and 2)


def check_checkpoint(zero, parts, written):
    """Raise CheckpointError, naming the first problem, unless the checkpoint (parts read and
    checked by read_checkpoint) fits this model and optimizer."""
    mine = layout(zero)
    another_model(*(dict(itertools.chain(*lay["units"])) for lay in (mine, written)), "parameter")
    another_model(mine["replicated"], written["replicated"], "frozen parameter or buffer")
    # Each part's rank, units and sizes were checked as it was read (read_checkpoint,
    # _part_problem); what is left is that every part holds the same optimizer states (or none:
    # a rank whose parameters never got a gradient has no state to write).
    keys = set(checkpoint_state_keys(parts))
    for r, part in enumerate(parts):
        for i, unit in enumerate(part["units"]):
            if set(unit["state"]) not in (keys, set()):
                raise CheckpointError(f"checkpoint part of rank {r}, unit {i}: optimizer state "
                                      f"{sorted(unit['state'])}, other parts have {sorted(keys)}")
    another_optimizer(parts[0].get("optimizer"), parts[0].get("hyper"), zero.optimizer)


def another_model(here, there, kind="tensor"):
    """Raise CheckpointError naming the first name whose shape differs between `here` and
    `there` ({name: shape as a list}), or that only one of them has."""
    for n in list(here) + list(there):
        if here.get(n) != there.get(n):
            raise CheckpointError(f"checkpoint is for another model: {kind} {n!r} is "
                                  f"{there.get(n, 'absent')} there, {here.get(n, 'absent')} here")


def another_optimizer(written, hyper, optimizer):
    """Raise CheckpointError unless `written`, the optimizer's class name that a checkpoint
    records, is optimizer's, and `hyper`, its hyper-parameters, holds those of each of the
    optimizer's groups (a dict each: load_values would fail after loading the weights)."""
    if written != (mine := type(optimizer).__name__):
        raise CheckpointError(f"checkpoint written with optimizer {written}, this run has {mine}")
    if type(hyper) is not list or list(map(type, hyper)) != [dict] * len(optimizer.param_groups):
        raise CheckpointError("the checkpoint's hyper-parameters are not a dictionary for each "
                              f"of the optimizer's {len(optimizer.param_groups)} group(s)")


def _written(zero):
    """In mixed precision the masters take what was written to the parameters since the last
    step (keep_writes, which step() runs first): a save between steps must hold it too."""
    if zero.mixed_precision and zero.stage < 3:  # (stage 3 refuses writes outside gathered())
        keep_writes(zero)


def full_state_dict(zero):
    """{name: full float32 tensor (float64 for a float64 parameter)} for every parameter (tied
    ones once, frozen ones too), on every rank; in mixed precision, the fp32 master values."""
    full = {}
    _written(zero)
    for unit in zero.units:  # one unit at a time: stage 3 never holds the whole model at once
        # stage 0: [N*S], every rank steps the whole unit; stages 1 and 2: the flat buffer holds
        # every rank's stepped shard; stage 3, or fp32 masters of their own: gather them
        flat = unit.master if zero.stage == 0 else unit.flat
        if zero.stage == 3 or zero.stage > 0 and zero.mixed_precision:
            flat = torch.empty_like(unit.flat, dtype=unit.master.dtype)
            all_gather(flat, unit.master, group=zero.group)  # [N*S] <- every rank's [S]
            zero.meter.sent("all_gather", flat)
        # each parameter a copy in float32 (float64 kept)
        full.update({p: _wide(unit.view(flat, p)).clone() for p in unit.params})
    return {n: full[p] if p in full else _wide(p.detach()).clone()
            for n, p in zero.model.named_parameters()}


def fit_problem(model, state):
    """(the first reason the plain state_dict `state` does not fit `model`: a key, a shape, a
    kind of dtype; or None), and for each of the model's tensors its first key in `state` (a
    tied one may have two: its other in the third)."""
    want = model.state_dict(keep_vars=True)  # key -> the model's own tensor (no reads)
    key_of = {t: key for key, t in reversed(want.items()) if key in state}
    twin = {t: key for key, t in want.items() if key in state and key != key_of[t]}
    return next(filter(None, itertools.chain(
        (f"no {key!r} in it" for key, t in want.items() if t not in key_of),
        (f"{key!r} is not in the model" for key in state if key not in want),
        (f"{key!r} is not a tensor" if not torch.is_tensor(s := state[key]) else
         f"{key!r} is {tuple(s.shape)} {s.dtype} there, {tuple(t.shape)} {t.dtype} here"
         if s.shape != t.shape or s.is_floating_point() != t.dtype.is_floating_point else None
         for t, key in key_of.items()),
        (f"{key!r} is tied to {key_of[t]!r} here, but not {tuple(t.shape)} there"
         for t, key in twin.items() if getattr(state[key], "shape", None) != t.shape))), None), \
        key_of, twin


def load_full_state_dict(zero, state):
    """opt.load_full_state_dict(state): load a plain state_dict, e.g. pretrained weights as
    torch.load(path, mmap=True, weights_only=True) gives them, into a wrapped model. Each rank
    copies only the elements of its own shard of each unit (and the frozen parameters and
    buffers, which every rank holds whole), so of a memory-mapped file it reads only those
    pages; stages 0-2 then all-gather the rest, as after a step. Keys, shapes and kinds of dtype
    (floating or not) must fit the model; a tied parameter needs one of its names (given two,
    their values must be equal: each rank compares its own elements)."""
    problem, key_of, twin = fit_problem(zero.model, state)
    if problem:
        raise ValueError(f"zero: load_full_state_dict: does not fit the model: {problem}")

    def own(u, key):  # this rank's shard of the unit, the parameters end to end (by key(p)): of
        # each (a view of the mapped file's tensor) just the elements in it are read
        mine = _slice_of([state[key(p)].reshape(-1) for p in u.params], u.my_slice.start, u.S)
        return torch.nn.functional.pad(mine, (0, u.S - len(mine)))  # then the padding, 0
    # Tied values compared first, on every rank: a refused load changes nothing
    differs = {key_of[p] + " and " + twin[p] for u in zero.units if any(p in twin for p in u.params)
               and not torch.equal(own(u, key_of.get), own(u, lambda p: twin.get(p, key_of[p])))
               for p in u.params if p in twin}
    if any(max(row) for row in _all_ranks([len(differs)], zero.device)):
        raise ValueError("zero: load_full_state_dict: tied here, different there: "
                         f"{', '.join(sorted(differs)) or 'on another rank'}")
    with torch.no_grad():
        for u in zero.units:
            mine = own(u, key_of.get).to(zero.device, u.master.dtype)
            if u.stepped == u.my_slice:  # stages 1-3: the master is this rank's shard
                u.master.copy_(mine)
            else:  # stage 0 steps the whole unit: each rank read 1/N of it, gather the rest
                all_gather(u.master, mine, group=zero.group)
                zero.meter.sent("all_gather", u.master, u)
            u.shard.copy_(u.master)  # the same tensor, unless mixed precision
        for _, t in replicated(zero.model):
            if t in key_of:  # (a buffer that is not persistent is not in a state_dict)
                t.copy_(state[key_of[t]])
    zero._gather_params()  # stages 1 and 2: the full parameters from every rank's shard


# ----------------------------------------------------------------------------------------------
# Checkpoint files: sharded, atomic, and readable at any stage and world size
#
#   DIR/step_00000010/rank_00000.pt ... rank_00003.pt   each rank's state_dict(), in parallel
#   DIR/step_00000010/manifest.json                     rank 0, last: stage, N, Ψ, names and
#                                                       shapes, every file's size and sha256
#
# A checkpoint is complete when its manifest exists. A save writes into step_00000010.partial,
# every file fsync'ed, the manifest only after every rank's file is on disk, and then the
# directory takes its name in one rename (_commit, as save_dcp does for DCP), so a job killed in
# the middle of a save leaves the previous checkpoint as it was and a .partial directory that
# loading skips (and rotation deletes). The newest `keep` complete ones are kept, and
# always the one just written. Only the names save_checkpoint writes (step_ and the step in 8 or
# more digits) are checkpoints: anything else in DIR is never read, nor deleted.
#
# One job per DIR (ckpt_dir_lock): two jobs in one directory delete each other's checkpoints.
# The manifest is data, not instructions: a reader opens only the files a writer of its
# world_size would have written (rank_<r>.pt, r < N), only if they are regular files, and checks
# that each one holds the part of its own rank.

FORMAT = "zero.py sharded checkpoint, version 1"


def writable(folder):
    """Whether this process can make a file in `folder`, tried (os.access says yes to root even
    where nobody can write, in /proc)."""
    with contextlib.suppress(OSError):
        tempfile.TemporaryFile(dir=folder).close()
        return True
    return False


def _atomic_write(path, write):
    """write(f) into a temporary file, then rename it to path. If the writing or the rename
    fails, the temporary file is removed and path is as it was."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            mode = os.fstat(f.fileno()).st_mode  # a new file's (the umask's)
            write(f)
        with open(tmp, "rb") as f:  # what is renamed: write() may have put another file there
            os.fchmod(f.fileno(), mode)  # (safetensors' save_file does, of mode 0600)
            os.fsync(f.fileno())  # the bytes are on disk before the name says they are there
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(os.path.dirname(path))  # and so is the rename


def _exchange(a, b):
    """Swap the names of directories a and b in one step: Linux's renameat2(RENAME_EXCHANGE),
    so that b is at every moment either the old directory or the new one, whole. Where the
    system has no such call: two renames, between which b is briefly missing (its old contents
    whole at a)."""
    import ctypes
    libc, AT_FDCWD, RENAME_EXCHANGE = ctypes.CDLL(None), -100, 2
    if not hasattr(libc, "renameat2") or libc.renameat2(
            AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        # (a file system or kernel without it, EINVAL or ENOSYS; any real error, the renames raise)
        os.rename(b, a + ".old")
        os.rename(a, b)
        os.rename(a + ".old", a)


def _commit(tmp, path, marker, info, keep=None):
    """Rank 0, once every rank's files are in directory tmp: the marker that makes it a complete
    checkpoint (info as JSON: zero.py's manifest.json, DCP's complete.json), then tmp takes the
    name path, then _rotate(keep) if keep is not None. A checkpoint of that step there already:
    the names swapped in one step (_exchange), so that the old one stays whole until the new one
    is complete, and the old one, now at tmp, goes. A rotation that fails leaves more
    checkpoints, never fewer: not an error."""
    _atomic_write(os.path.join(tmp, marker), lambda f: f.write(_json_lines(info).encode()))
    (_exchange if os.path.exists(path) else os.rename)(tmp, path)
    _fsync_dir(os.path.dirname(path))
    shutil.rmtree(tmp, ignore_errors=True)  # the old one, if it was swapped there
    if keep is not None:
        with contextlib.suppress(OSError, CheckpointError):
            _rotate(os.path.dirname(path), info["step"], keep)


def write_file(path, text):
    """Write `text` into the file `path` whole or not at all (_atomic_write): a failure (a full
    disk...) leaves no file and is a UsageError, one line naming it."""
    try:
        _atomic_write(path, lambda f: f.write(text.encode()))
    except OSError as e:
        raise UsageError(f"{path}: cannot be written ({_reason(e)})") from None


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
    digits = name[5:]  # (a non-ASCII digit, which int() reads too, fails the name's test)
    return int(digits) if digits.isdecimal() and name == f"step_{int(digits):08d}" else None


def _steps(root):
    """{step: directory} of the complete checkpoints under root."""
    try:
        names = os.listdir(root) if os.path.isdir(root) else []
    except OSError as e:
        raise CheckpointError(f"{root}: cannot be listed ({e.strerror})") from None
    return {s: os.path.join(root, name) for name in names if (s := _step_of(name)) is not None and
            any(os.path.exists(os.path.join(root, name, m)) for m in ("manifest.json", DCP_MARKER))}


def latest_checkpoint(root):
    """The newest complete checkpoint directory under root, or None."""
    return max(_steps(root).items(), default=(None, None))[1]  # (step, directory): the highest


def choose_checkpoint(root, device):
    """latest_checkpoint(root) as rank 0 sees it, on every rank (a collective). Each rank listing
    root on its own could resume two ranks from two checkpoints, when one completes between their
    listings."""
    with _agreed(device):  # (rank 0's CheckpointError, on every rank: it cannot list root)
        mine = max(_steps(root), default=-1) if dist.get_rank() == 0 else -1
    step = _all_ranks([mine], device)[0][0]  # rank 0's, on every rank
    return None if step < 0 else os.path.join(root, f"step_{step:08d}")


@contextlib.contextmanager
def _agreed(device, catch=(), say=None, kind=CheckpointError, undo=lambda: None):
    """Run the block on every rank, then agree: every rank's error (a UsageError's message, or
    say(e) for an exception of a class in the tuple `catch`) goes to every rank, in one small
    all-gather, and if any rank had one, every rank runs undo() and raises kind(the first one).
    So all raise together: none is left waiting alone in a collective, and none goes on, to
    change anything or believing that what the block did is done, where another rank failed."""
    error = ""
    try:
        yield
    except (UsageError, *catch) as e:  # (a CheckpointError too)
        error = str(e) if isinstance(e, UsageError) else say(e)
    # every rank's message ("": none), 512 bytes of it, to every rank
    raw = error.encode(errors="backslashreplace")[:512]  # (a path's bytes not UTF-8: escaped)
    for row in _all_ranks(list(raw.ljust(512, b"\0")), device, dtype=torch.uint8):
        if any(row):  # the first rank's that has one
            undo()
            raise kind(bytes(row).rstrip(b"\0").decode(errors="replace")) from None


def _reason(e):
    """What went wrong, in one line: an OSError's strerror (a full disk...), DCP's the last
    line of the first rank's traceback it carries, else the first line of the message."""
    lines = str(e).strip().splitlines() or [type(e).__name__]
    # ("unexpected pos": torch.save's zip writer found a write cut short)
    return (e.strerror if isinstance(e, OSError) and e.strerror else "a write was cut short (no "
            "space left on the device?)" if "unexpected pos" in str(e) else
            (lines[-1] if isinstance(e, _dcp_error()) else lines[0])[:300])


def _lock_holder(fd):
    """' (process PID)' if /proc/locks names the process that holds a flock on fd's file."""
    st = os.fstat(fd)
    file = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    # /proc/locks: "1: FLOCK  ADVISORY  WRITE 5833 fe:00:2146937 0 EOF"
    with contextlib.suppress(OSError, IndexError, StopIteration), open("/proc/locks") as f:
        return next(f" (process {x[4]})" for x in map(str.split, f)
                    if x[1] == "FLOCK" and x[5] == file)
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
    what, shared = f"checkpoint directory {root}", os.path.join(root, ".zero-shared")
    looked = lambda: dist.get_rank() == 0 and os.remove(shared)  # noqa: E731
    with contextlib.ExitStack() as held:
        with _agreed(device, (OSError,), lambda e: f"{what}: {e.strerror or e}", UsageError):
            if any("\udc80" <= c <= "\udcff" for c in root):  # (Python's escapes of such bytes)
                raise UsageError(f"{what}: its name's bytes are not UTF-8: torch cannot read there")
            if os.path.exists(root) and not os.path.isdir(root):
                raise UsageError(f"{what}: exists and is not a directory")
            os.makedirs(root, exist_ok=True)
            if not (os.access(root, os.R_OK) and writable(root)):
                raise UsageError(f"{what}: not writable")
            if dist.get_rank() == 0:
                fd = os.open(root, os.O_RDONLY)
                held.callback(os.close, fd)  # the lock goes with the last descriptor of its file
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise UsageError(f"{what}: in use by another job{_lock_holder(fd)}; one job "
                                     "per directory") from None
                except OSError as e:
                    print(f"warning: {what} cannot be locked ({e.strerror}): make sure that no "
                          "other job uses it", file=sys.stderr, flush=True)
                pathlib.Path(shared).touch()  # removed once every rank looked for it
        # One directory on every rank: a node's own disk would fail the first save, after training
        with _agreed(device, kind=UsageError, undo=looked):
            if not os.path.isfile(shared):
                raise UsageError(f"{what}: not the one rank 0 sees (each node's own disk?): "
                                 "--ckpt-dir must be one directory that every rank reaches")
        looked()
        yield


def _rotate(root, step, keep):
    """Rank 0, after a save: delete the checkpoints, complete or not, older than the newest `keep`
    complete ones, but never the one just written (`step`, even if older), the temporary
    files that saves killed midway left in the checkpoints kept, and the STEP.partial
    directories of saves killed midway (_partial: this one's is renamed by now)."""
    # the newest `keep` (the one just written among them, unless removed since; keep=0: none)
    kept = sorted(_steps(root), reverse=True)[:keep]
    oldest = min(kept, default=step)  # the oldest kept
    for name in os.listdir(root):
        s = _step_of(name.removesuffix(".partial"))
        if s is not None and (name.endswith(".partial") or s < oldest and s != step):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for s in {*kept, step}:  # the ones kept: _atomic_write's NAME.tmp<pid> files
        for leftover in pathlib.Path(root, f"step_{s:08d}").glob("*.tmp[0-9]*"):
            leftover.unlink()  # (an error ends the rotation, which _commit lets pass)


def save_checkpoint(opt, root, step, extra=None, keep=2):
    """Write opt's checkpoint for `step` under root (every rank calls this; a collective). If a
    rank cannot write (a full disk...), every rank raises CheckpointError, what this save wrote
    is removed, and the checkpoints written before are as they were."""
    # Refused on every rank alike (rank 0 failing alone at its manifest leaves the others waiting)
    for name, value in (("step", step), ("keep", keep)):
        if not _count(value):
            raise ValueError(f"zero: save_checkpoint's {name} must be an int >= 0, not {value!r}")
    # (rank 0 writes it into the manifest, where a load reads a dict: {**extra} copies a mapping
    # and refuses anything else, a list or a str, with a TypeError)
    try:
        json.dumps(extra := {**(extra or {})})
    except (TypeError, ValueError) as e:
        raise ValueError(f"zero: save_checkpoint's extra must be a JSON dict: {e}") from None
    path, tmp = _partial(root, step, opt.device)
    # the part this rank writes: its rank, if G = N
    name = os.path.join(tmp, f"rank_{part_index(opt.rank, opt.world, opt.N):05d}.pt")
    # if any rank failed (each is done writing by then): what this save wrote goes, removed by
    # rank 0 and each node's first rank (each node's disk)
    local0 = opt.rank == 0 or os.environ.get("LOCAL_RANK", "0") == "0"
    undo = lambda: local0 and shutil.rmtree(tmp, ignore_errors=True)  # noqa: E731
    # (torch.save reports some failed writes as RuntimeError)
    with _agreed(opt.device, (OSError, RuntimeError), _not_saved(step, opt.rank, name), undo=undo):
        os.makedirs(tmp, exist_ok=True)
        _atomic_write(name, lambda f: torch.save(opt.state_dict(), f))
        size, digest = os.path.getsize(name), bytes.fromhex(_sha256(name))  # 32 bytes
    # Rank 0 lists every file's size and hash in the manifest: one small all-gather, and it is
    # also the barrier that makes every rank's file durable before the manifest is written.
    files = {f"rank_{part_index(r, opt.world, opt.N):05d}.pt": [n, bytes(sha256).hex()]
             for r, (n, *sha256) in enumerate(_all_ranks([size, *digest], opt.device))}
    # a tied parameter's or a shared buffer's first name (named_*() give each tensor once), as
    # layout() lists them
    first = {id(t): n for n, t in [*opt.model.named_parameters(), *opt.model.named_buffers()]}
    keys = [[k, first.get(id(t), k)] for k, t in opt.model.state_dict(keep_vars=True).items()]
    manifest = {"format": FORMAT, "step": step, **layout(opt), "extra": extra,
                "optimizer": type(opt.optimizer).__name__, "keys": keys, "files": files}
    # Rank 0 writes it; nobody goes on (or dies) believing a save is complete before it is.
    manifest_path = os.path.join(tmp, "manifest.json")
    with _agreed(opt.device, (OSError,), _not_saved(step, opt.rank, manifest_path), undo=undo):
        if opt.rank == 0:  # complete: it takes its name (an old one of this step's), rotation
            _all_there(tmp, {name: n for name, (n, _) in files.items()}, step)
            _commit(tmp, path, "manifest.json", manifest, keep)


def _all_there(tmp, sizes, step):
    """Rank 0, before it commits a save: each file {name: size} the ranks wrote is in tmp, as
    long as written. One missing: the ranks wrote into directories of their own, one on each
    node's disk, and the checkpoint would be complete nowhere."""
    for name, size in sizes.items():
        if not os.path.isfile(file := os.path.join(tmp, name)) or os.path.getsize(file) < size:
            raise CheckpointError(f"step {step} not saved: {file}, which another rank wrote, is "
                                  "not there for rank 0: --ckpt-dir must be shared by every rank")


def _partial(root, step, device):
    """(root/step_<step>, where a save of it is written: the same + .partial). Every rank calls
    it; rank 0 first removes what a save of this step killed midway left there."""
    path = os.path.join(root, f"step_{step:08d}")
    if dist.get_rank() == 0:
        shutil.rmtree(path + ".partial", ignore_errors=True)
    _all_ranks([0], device)  # (a barrier)
    return path, path + ".partial"


def _not_saved(step, rank, file):
    """say(e) for a save's _agreed: the one line every rank raises (`file`: where e names none)."""
    return lambda e: (f"step {step} not saved: rank {rank}: {getattr(e, 'filename', None) or file}"
                      f": {_reason(e)}; the checkpoints written before it are intact")


def _count(x, least=0):
    return type(x) is int and x >= least  # an int, and not a bool


def _is_shape(x):
    return isinstance(x, list) and all(map(_count, x))


def _pair(x, first, second):  # [a, b], where first(a) and second(b)
    return isinstance(x, list) and len(x) == 2 and first(x[0]) and second(x[1])


def _manifest_problem(m, dcp=False):
    """What is wrong with a manifest's contents, or None. Everything a reader uses is checked.
    dcp: a DCP checkpoint's marker (read_dcp), of which step, stage, world_size and extra."""
    n, units, replicated, files = map(m.get, ("world_size", "units", "replicated", "files"))
    for key, ok, want in [("step", _count(m.get("step")), "a step number"),
                          ("stage", _count(m.get("stage")) and m["stage"] < 4, "0, 1, 2 or 3"),
                          ("world_size", _count(n, 1), "a number of ranks"),
                          ("shard_size", "shard_size" not in m or _count(n, 1) and _count(
                              g := m["shard_size"], 1) and n % g == 0, "a divisor of world_size"),
                          ("files", dcp or type(files) is dict and files, "a non-empty dictionary"),
                          ("extra", isinstance(m.get("extra"), dict), "a dictionary")]:
        if not ok:
            shown = repr(m[key]) if key in m else "missing"  # (a long value: its start)
            return f"{key!r} is {shown[:100] + '...' * (len(shown) > 100)}, not {want}"
    if dcp:
        return None
    text = lambda x: isinstance(x, str)  # noqa: E731
    if not (isinstance(units, list) and all(isinstance(u, list) and all(
            _pair(p, text, _is_shape) for p in u) for u in units)):
        return "'units' is not a list, per unit, of [name, shape] (a shape: a list of ints >= 0)"
    if not (isinstance(replicated, dict) and all(map(_is_shape, replicated.values()))):
        return "'replicated' is not a dictionary {name: shape}"
    if m.get("psi") != (psi := sum(math.prod(s) for u in units for _, s in u)):
        return f"'psi' is {m.get('psi')!r}, its units hold {psi} elements"
    names = {name for u in units for name, _ in u} | set(replicated)
    if not (isinstance(m.get("keys"), list) and all(
            _pair(k, text, lambda x: text(x) and x in names) for k in m["keys"])):
        return "'keys' is not a list of [state_dict key, name of a parameter or buffer]"
    if set(files) != {f"rank_{r:05d}.pt" for r in range(n)}:  # (a dict's keys: each once)
        return (f"'files' must be exactly rank_00000.pt ... rank_{n - 1:05d}.pt (world_size {n}), "
                f"not {', '.join(map(repr, sorted(files)))[:200]}")
    for file, entry in files.items():  # [size, sha256: 64 hex digits]
        if not _pair(entry, _count, lambda h: text(h) and re.fullmatch("[0-9a-f]{64}", h)):
            return f"'files' entry {file}: not [size, sha256 in hex]"


def _part_problem(part, r, manifest):
    """What is wrong with the part of rank r (its own rank field, its units' sizes), or None."""
    if not isinstance(part, dict):
        return "not a checkpoint part"
    if part.get("rank") != r:
        return f"holds the part of rank {part.get('rank')!r}, not of rank {r} (swapped or renamed?)"
    if not isinstance(units := part.get("units"), list) or len(units) != len(manifest["units"]):
        return f"does not hold the {len(manifest['units'])} unit(s) the manifest lists"
    for i, (unit, params) in enumerate(zip(units, manifest["units"])):
        size = -(-sum(math.prod(s) for _, s in params) // manifest["world_size"])
        state = unit.get("state") if isinstance(unit, dict) else None
        tensors = [unit.get("master"), *state.values()] if isinstance(state, dict) else [None]
        if not all(torch.is_tensor(t) and t.dim() == 1 and t.numel() == size for t in tensors):
            return f"unit {i}: not {size} elements of master weights and of each optimizer state"
    # {parameter name: its optimizer scalars}, {name: a frozen parameter's or a buffer's value}
    for k, cls in [("param_scalars", dict), ("replicated", torch.Tensor)]:
        if not (isinstance(d := part.get(k), dict) and all(isinstance(v, cls) for v in d.values())):
            return f"{k!r} is not a dictionary of {cls.__name__}s"
    if r == 0 and {n: [*t.shape] for n, t in part["replicated"].items()} != manifest["replicated"]:
        return "its frozen parameters and buffers are not the ones the manifest lists"


def _regular_size(file, missing):
    """The size of `file`, a regular file: opening a FIFO (or a device) could wait for ever."""
    try:
        if stat.S_ISREG((st := os.stat(file)).st_mode):  # (one stat: the kind and the size)
            return st.st_size
        why = "not a regular file"
    except OSError as e:
        why = missing if isinstance(e, FileNotFoundError) else e.strerror
    raise CheckpointError(f"{file}: {why}")


def _read_json(file, missing, format, problem):
    """The dictionary in `file`, a regular file of JSON (a manifest, DCP's marker), whose
    "format" is `format` and in which problem(it) finds none; else a CheckpointError that says
    what is wrong (`missing`: what a missing file means)."""
    _regular_size(file, missing)
    try:
        d = json.loads(pathlib.Path(file).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: unreadable ({e})") from None
    if what := (problem(d) if isinstance(d, dict) and d.get("format") == format
                else f"not a {format!r} file"):
        raise CheckpointError(f"{file}: {what}")
    return d


# What reading contents that got past the checks raises (files that another program wrote?)
_LAYOUT_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError)


def _failed(path, what="not laid out as zero.py writes checkpoints"):
    """say(e) for _agreed, or an error's line: path, what failed, and e's type and _reason."""
    return lambda e: f"{path}: {what} ({type(e).__name__}: {_reason(e)})"


def read_checkpoint(path, verify=None):
    """The manifest and every rank's part of the checkpoint in directory `path`, each part
    checked against the manifest's size (and sha256, for the ranks in `verify`; None: all) and
    read with torch.load(weights_only=True): a file cannot run code. mmap: a part's bytes are
    read from disk only where they are used. No process group needed. Anything wrong, in the
    manifest or in a part, is a CheckpointError that says what."""
    if path is None:
        raise CheckpointError("no checkpoint path was given (None: no complete checkpoint found?)")
    manifest = _read_json(os.path.join(path, "manifest.json"), "missing: no manifest.json, not a "
                          "complete checkpoint", FORMAT, _manifest_problem)
    n, parts = manifest["world_size"], []
    for r in range(n):  # (_manifest_problem checked that the files are rank_00000.pt ...)
        name = f"rank_{r:05d}.pt"
        file, (size, digest) = os.path.join(path, name), manifest["files"][name]
        found = _regular_size(file, f"missing (rank {r} of {n} wrote it)")
        try:
            if found != size:
                problem = f"{found} bytes, the manifest says {size}: truncated or overwritten"
            elif (verify is None or r in verify) and _sha256(file) != digest:
                problem = "its sha256 differs from the manifest's: the file is corrupt"
            else:
                parts.append(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
                problem = _part_problem(parts[r], r, manifest)
        except Exception as e:  # an OSError; weights_only refuses all but tensors and containers
            problem = f"cannot be read ({_reason(e)})"
        if problem:
            raise CheckpointError(f"{file}: {problem}")
    return manifest, parts


def load_checkpoint(opt, path):
    """Load the checkpoint in directory `path` into opt, whatever stage and world size wrote it,
    and return its manifest (step, extra). Every rank calls this; if any rank finds a problem,
    every rank raises CheckpointError and nothing has changed. Each rank checks the hashes of
    1/N of the files (rank r: files r, r+N, ...), so the whole checkpoint is read once, not N
    times. The optimizer's hyper-parameters (lr...) are the checkpoint's. A DCP checkpoint
    (fsdp_demo.py's, of FSDP2): load_dcp."""
    _one_checkpoint(path, opt.device)
    if path is not None and is_dcp(path):
        return load_dcp(opt, path)
    # Agree before anyone changes anything (or waits alone in a collective): _agreed
    with _agreed(opt.device, _LAYOUT_ERRORS, _failed(path)):
        manifest, parts = read_checkpoint(path, verify=range(opt.rank, 1 << 30, opt.world))
        check_checkpoint(opt, parts, manifest)
    load_values(opt, _reader(parts, manifest), checkpoint_state_keys(parts),
                checkpoint_scalars(parts), parts[0]["hyper"], parts[0]["replicated"])
    return manifest


def _one_checkpoint(path, device):
    """Raise on every rank unless all read the same checkpoint at `path` (None: none), by the
    hash of its manifest.json (DCP: its marker): copies on each node's own disk may be of other
    steps, and a part of each would be loaded."""
    with _agreed(device, (OSError,), lambda e: f"{path}: {e.strerror or e}"):  # (a node's own)
        marker = next((os.path.join(path, name) for name in ("manifest.json", DCP_MARKER,
                       ".metadata") if path and os.path.isfile(os.path.join(path, name))), None)
        mine = hashlib.sha256(pathlib.Path(marker).read_bytes() if marker else b"").digest()
    for r, row in enumerate(_all_ranks(list(mine), device)):
        if bytes(row) != mine:
            raise CheckpointError(f"{path}: rank {r} reads another checkpoint there than this "
                                  "rank (each node's own copy?): every rank must load the same one")


def checkpoint_tensors(manifest, parts, key="master"):
    """(name, tensor in its shape) of each parameter of a checkpoint (read_checkpoint), one at a
    time, of the master weights or of the optimizer state `key`: a view of a memory-mapped part,
    or a copy where two parts hold it. What consolidate() and fsdp_demo.py stream."""
    read = _reader(parts, manifest)
    for name, shape in itertools.chain(*manifest["units"]):
        yield name, read(name, 0, math.prod(shape), key).view(shape)


def checkpoint_state_keys(parts):  # the per-element optimizer states: Adam's exp_avg, exp_avg_sq
    return list(dict.fromkeys(k for part in parts for unit in part["units"] for k in unit["state"]))


def checkpoint_scalars(parts):  # {name: optimizer scalars}: Adam's step count
    return {n: s for part in parts for n, s in part["param_scalars"].items()}


def consolidate(path, out, kind):
    """Write the sharded checkpoint in `path` as the full model, {key: fp32 (or fp64) tensor; a
    frozen one or a buffer as held} for every key of the model's state_dict(), to `out` in one
    format (`kind`): "pt", a torch.save file (what model.load_state_dict() and --init-from
    take); "safetensors", what Hugging Face and inference engines load (safetensors.torch.
    load_file); "dcp", a DCP directory (dcp.load, FSDP2's, and dcp_to_torch_save read it). One
    process, no process group, any stage and world size. Each tensor is a view of the
    memory-mapped parts (a copy where two parts hold it), written from there: no moment holds
    the whole model in memory. A checkpoint that is not right is a CheckpointError, an output
    that cannot be written a UsageError; neither leaves a file. Returns the manifest, and
    "fp64": whether masters are."""
    manifest, parts = read_checkpoint(path)
    try:
        masters = dict(checkpoint_tensors(manifest, parts))
        own = {n: _own_storage(t) for n, t in (masters | parts[0]["replicated"]).items()}
        # a tied weight: one tensor under both keys, as in state_dict() (.pt writes it once);
        # safetensors wants a copy under each key but the first
        first = {name: key for key, name in reversed(manifest["keys"])}
        state = {key: own[name].clone() if kind == "safetensors" and key != first[name] else
                 own[name] for key, name in manifest["keys"]}
    except _LAYOUT_ERRORS as e:
        raise CheckpointError(_failed(path)(e)) from None
    # (the safetensors format has complex64, not complex128: save_file would fail with a KeyError)
    wide = [k for k, t in state.items() if t.dtype == torch.cdouble and kind == "safetensors"]
    if wide:
        raise UsageError(f"--out {out}: safetensors holds no complex128 ({wide[0]}): a .pt or DCP")
    tmp = out.rstrip(os.sep) + ".partial"  # (a DCP directory is written there, then renamed)
    try:
        if kind != "dcp":  # (safetensors' save_file takes the name of the file it writes)
            _atomic_write(out, lambda f: torch.save(state, f) if kind == "pt" else
                          safetensors.torch.save_file(state, f.name))
        else:
            import torch.distributed.checkpoint as dcp
            shutil.rmtree(tmp, ignore_errors=True)
            with warnings.catch_warnings():  # save_state_dict is deprecated, but takes no_dist
                warnings.simplefilter("ignore")  # on every torch (dcp.save: from 2.7 on)
                dcp.save_state_dict(state, dcp.FileSystemWriter(tmp), no_dist=True)  # no group
            _commit(tmp, out.rstrip(os.sep), DCP_MARKER, {"format": DCP_FORMAT, "optimizer": None,
                    **{k: manifest[k] for k in ("step", "stage", "world_size", "extra")}})
    except (OSError, RuntimeError, SafetensorError, _dcp_error()) as e:
        if kind == "dcp":
            shutil.rmtree(tmp, ignore_errors=True)
        raise UsageError(f"{getattr(e, 'filename', None) or out}: cannot be written "
                         f"({_reason(e)})") from None
    return {**manifest, "fp64": any(t.dtype == torch.float64 for t in masters.values())}


def _own_storage(t):
    """t, in a storage of its own that shares its memory (a slice of the memory-mapped part's
    storage): torch.save writes a tensor's whole storage, which for a view is the whole part."""
    s, at = t.untyped_storage(), t.storage_offset() * t.element_size()
    return torch.empty(0, dtype=t.dtype).set_(s[at:at + t.numel() * t.element_size()], 0, t.shape)


# ----------------------------------------------------------------------------------------------
# The same run under FSDP2 and back: torch.distributed.checkpoint (DCP). fsdp_demo.py writes its
# checkpoints with DCP, as torchtitan does; zero.py continues them (load_dcp), and fsdp_demo.py
# continues zero.py's (its Torch.load_checkpoint). Keys, as torch.distributed.checkpoint's
# state_dict API gives them: model.<key> for each key of the model's state_dict(), and
# optimizer.state.<name>.<exp_avg | exp_avg_sq | step> for each parameter, by name.
#
#   DIR/step_00000010/__0_0.distcp ... __3_0.distcp   each rank's shards, DCP's own files
#   DIR/step_00000010/.metadata                       DCP's index: each tensor's shape, and which
#                                                     file holds which of its rows (a pickle)
#   DIR/step_00000010/complete.json                   step, stage, N, hyper-parameters, data
#
# Both sides agree on the model's coordinates, names and shapes, not on how a rank's shard is
# cut: FSDP2 cuts every parameter on dim 0, zero.py one flat buffer per unit. So a reader asks
# DCP for whole tensors by name and cuts its own elements out of them (load_values).
# DCP writes in place, so a save goes into step_00000010.partial, then complete.json, then one
# rename: a directory without complete.json is torn (a save killed midway) and is never chosen.
# DCP's .metadata is a pickle, unlike zero.py's parts: load DCP checkpoints that you trust.
# DCP keeps no hash of its files: a truncated file is found (read_dcp), a changed byte is not.

DCP_FORMAT = "zero.py DCP checkpoint, version 1"
DCP_MARKER = "complete.json"


def is_dcp(path):
    return not os.path.exists(os.path.join(path, "manifest.json")) and any(
        os.path.exists(os.path.join(path, f)) for f in (".metadata", DCP_MARKER))


def checkpoint_path(path):
    """path itself if it is a checkpoint of either format, else the newest complete one in it."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: {'not a' if os.path.exists(path) else 'no such'} directory "
                              "(a checkpoint, or one that holds checkpoints)")
    if os.path.exists(os.path.join(path, "manifest.json")) or is_dcp(path):
        return path
    if (found := latest_checkpoint(path)) is None:
        raise CheckpointError(f"{path}: not a checkpoint, and no complete checkpoint in it")
    return found


def _dcp_error():
    # DCP's own error, raised by dcp.save and dcp.load for what failed on any rank (a missing
    # key...), is a BaseException, not an Exception: caught by name, or one rank dies alone
    from torch.distributed.checkpoint.api import CheckpointException
    return CheckpointException


def save_dcp(state, root, step, info, device, keep=2):
    """dcp.save(state) as checkpoint `step` under root, in fsdp_demo.py's training: every rank
    calls it (a collective), and writes its own shards. info: what complete.json records."""
    import torch.distributed.checkpoint as dcp
    (path, tmp), rank = _partial(root, step, device), dist.get_rank()
    with _agreed(device, (OSError, RuntimeError, _dcp_error()), _not_saved(step, rank, tmp)):
        dcp.save(state, checkpoint_id=tmp)  # rank 0 writes .metadata, after every rank's files
        if rank == 0:
            _all_there(tmp, _dcp_ends(dcp.FileSystemReader(tmp).read_metadata()), step)
            _commit(tmp, path, DCP_MARKER, {"format": DCP_FORMAT, "step": step, **info}, keep)


def read_dcp(path):
    """complete.json, and {key: a meta tensor (its shape and dtype)} of every tensor, of the DCP
    checkpoint in `path`, checked: no marker, or a file that DCP's index names missing or short,
    is a torn checkpoint. Reads the index only, no tensor."""
    from torch.distributed.checkpoint import FileSystemReader
    info = _read_json(os.path.join(path, DCP_MARKER), "missing: the DCP checkpoint is torn (a "
                      "save killed midway?)", DCP_FORMAT, lambda d: _manifest_problem(d, dcp=True))
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # (DCP's index missing or not one)
        raise CheckpointError(_failed(path, "torn or not a DCP checkpoint")(e)) from None
    for name, end in sorted(_dcp_ends(metadata).items()):
        file = os.path.join(path, name)
        if (size := _regular_size(file, "missing: the DCP checkpoint is torn")) < end:
            raise CheckpointError(f"{file}: {size} bytes, DCP's index needs {end}: truncated")
    return info, {k: torch.empty(v.size, dtype=v.properties.dtype, device="meta")
                  for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")}


def _dcp_ends(metadata):
    """{file: its length that DCP's index (metadata) needs}: of its items, the one that ends
    last (sorted by their ends, each file's last one is the one the dictionary keeps)."""
    items = sorted(metadata.storage_data.values(), key=lambda item: item.offset + item.length)
    return {item.relative_path: item.offset + item.length for item in items}


def check_dcp(model, optimizer, info, tensors, path):
    """Raise CheckpointError unless the DCP checkpoint (read_dcp) is one of this model, with
    this optimizer's per-parameter state. Returns {parameter name: [its optimizer's keys]}."""
    keys = {n: [k[len(f"optimizer.state.{n}."):] for k in tensors
                if k.startswith(f"optimizer.state.{n}.")] for n, _ in model.named_parameters()}
    if not info.get("optimizer") or not any(keys.values()):
        raise CheckpointError(f"{path}: no optimizer state: --init-from its dcp_to_torch_save .pt")
    here = {k: list(t.shape) for k, t in model.state_dict(keep_vars=True).items()}
    another_model(here, {k.removeprefix("model."): list(t.shape) for k, t in tensors.items()
                         if k.startswith("model.")})
    another_optimizer(info["optimizer"], info.get("hyper"), optimizer)
    return keys


def load_dcp(zero, path):
    """load_checkpoint() for a DCP checkpoint, whatever FSDP2's N, stage and mesh that wrote it.
    Each rank asks DCP only for the tensors of the parameters its elements are in (DCP then reads
    only their rows' bytes, from each writer's file), and cuts its elements out of them."""
    import torch.distributed.checkpoint as dcp
    # every rank, before any change (_agreed); any other exception: DCP's, a file it cannot read
    with _agreed(zero.device, (Exception, _dcp_error()), _failed(path, "cannot be read")):
        info, tensors = read_dcp(path)
        keys = check_dcp(zero.model, zero.optimizer, info, tensors, path)
        names = {p: n for n, p in zero.model.named_parameters()}
        mine = [names[p] for u in zero.units for p in u.params  # those this rank steps some of
                if u.offset[p] < u.stepped.stop and u.offset[p] + p.numel() > u.stepped.start]
        want = [f"model.{n}" for n in [*mine, *(n for n, _ in replicated(zero.model))]]
        want += [f"optimizer.state.{n}.{k}" for n in mine for k in keys[n]]
        loaded = {k: torch.empty_like(tensors[k], device="cpu") for k in want}
        with warnings.catch_warnings():  # load_state_dict is deprecated, but takes no_dist on
            warnings.simplefilter("ignore", FutureWarning)  # every torch (dcp.load: from 2.7)
            dcp.load_state_dict(loaded, dcp.FileSystemReader(path), no_dist=True)  # this rank only
    per_element = {k for n, ks in keys.items() for k in ks
                   if tensors[f"optimizer.state.{n}.{k}"].shape == tensors[f"model.{n}"].shape}
    # Adam's step count: a tensor of shape [] per parameter
    scalars = {n: {k: loaded[f"optimizer.state.{n}.{k}"] for k in ks if k not in per_element}
               for n, ks in keys.items() if f"model.{n}" in loaded and ks}

    def read(name, lo, hi, key):
        t = loaded[f"model.{name}" if key == "master" else f"optimizer.state.{name}.{key}"]
        return t.reshape(-1)[lo:hi]
    # (info["hyper"]: check_dcp's another_optimizer found a dict for each of the groups)
    load_values(zero, read, sorted(per_element), scalars, info["hyper"],
                {n: loaded[f"model.{n}"] for n, _ in replicated(zero.model)})
    return info


def consolidate_command(args):
    """zero.py --consolidate DIR --out OUT: the format is OUT's name (.pt, .safetensors, .dcp or
    an existing directory, which must be empty or a DCP checkpoint). Bad input is a UsageError
    (or CheckpointError) before anything is written."""
    if not (out := args.out):
        raise UsageError("--consolidate needs --out FILE (.pt, .safetensors, or .dcp)")
    name = out.rstrip(os.sep)  # (out/: a directory)
    kind = ("safetensors" if name.endswith(".safetensors") else
            "pt" if name.endswith((".pt", ".pth")) else
            "dcp" if name.endswith(".dcp") or name != out or os.path.isdir(out) else None)
    where = os.path.dirname(name) or "."
    if problem := ("name a .pt or .safetensors file, or a .dcp directory" if kind is None else
                   "is a directory" if os.path.isdir(out) and kind != "dcp" else
                   "ends in /: .pt and .safetensors are files" if name != out and kind != "dcp" else
                   "is a file" if os.path.isfile(name) and kind == "dcp" else
                   "a directory that is neither empty nor a DCP checkpoint"
                   if os.path.isdir(out) and os.listdir(out) and not is_dcp(out) else
                   f"no directory {where}" if not os.path.isdir(where) else
                   f"cannot write in {where}" if not writable(where) else None):
        raise UsageError(f"--out {out}: {problem}")
    path = checkpoint_path(args.consolidate)  # it, or the newest complete checkpoint in it
    if is_dcp(path):
        raise CheckpointError(f"{path}: a DCP checkpoint, not zero.py's: use dcp_to_torch_save")
    if os.path.realpath(name).startswith(os.path.join(os.path.realpath(args.consolidate), "")):
        raise UsageError(f"--out {out}: inside the checkpoints it reads, {args.consolidate}")
    m = consolidate(path, out, kind)
    print(f"wrote {out} ({kind}): {len(m['keys'])} tensors, Ψ = {m['psi']:,}, step {m['step']} "
          f"(written at stage {m['stage']} by {m['world_size']} rank(s), "
          f"{'fp64' if m['fp64'] else 'fp32'} master weights)")


def resume(opt, args, world, device, log):
    """zero.train's start with --ckpt-dir or --resume-from: load the newest complete checkpoint
    in --ckpt-dir, whatever stage and world size wrote it, as rank 0 sees it (choose_checkpoint);
    where there is none, --resume-from's, of either format (zero.py's or FSDP2's DCP). The data
    position is the step: get_batch() draws step k's global batch from a generator seeded by k.
    The checkpoint's hyper-parameters are loaded with its state, then --lr is applied: the
    command line has the last word. Returns (the first step to train, the checkpoint or None)."""
    found = choose_checkpoint(args.ckpt_dir, device) if args.ckpt_dir else None
    with _agreed(device):  # (checkpoint_path's CheckpointError: on every rank)
        found = found or (checkpoint_path(args.resume_from) if args.resume_from else None)
    if not found:
        return 1, None
    # fsdp_demo.py's optimizer loads and saves its own (DCP, through torch's state_dict API)
    manifest = getattr(opt, "load_checkpoint", functools.partial(load_checkpoint, opt))(found)
    # (no shape shows --n-head: the same weights with other heads would be another model)
    if (heads := manifest["extra"].get("n_head", args.n_head)) != args.n_head:
        raise UsageError(f"{found}: written with --n-head {heads!r}, not {args.n_head}")
    loaded_lr = opt.optimizer.param_groups[0]["lr"]
    for group in opt.optimizer.param_groups:
        group["lr"] = args.lr
    N, G = manifest["world_size"], manifest.get("shard_size", 0)  # (G 0: none recorded)
    log(f"resumed from {found}: step {manifest['step']}, written at stage {manifest['stage']} "
        f"by {N} rank(s)" + " of FSDP2 (DCP)" * (manifest["format"] == DCP_FORMAT) +
        f" in groups of {G} (hybrid)" * (G not in (0, N)) + (f"; its hyper-parameters loaded, "
        f"then --lr {args.lr:g} applied (it had {loaded_lr:g})" if loaded_lr != args.lr else ""))
    if (data := manifest["extra"].get("data")) != (position := data_position(args, world)):
        log(f"note: the data stream differs from the checkpoint's ({data}, now {position}): "
            "training goes on, on other batches")
    return manifest["step"] + 1, found


def save(opt, args, step, world):
    """zero.train's checkpoint after a step in --ckpt-dir (fsdp_demo.py's optimizer saves its
    own, DCP). Returns the directory written."""
    getattr(opt, "save_checkpoint", functools.partial(save_checkpoint, opt))(
        args.ckpt_dir, step, extra={"data": data_position(args, world), "n_head": args.n_head})
    return os.path.join(args.ckpt_dir, f"step_{step:08d}")


def data_position(args, world):
    """What decides which rows step k trains on; equal in a resumed run means the same batches."""
    # (a data file by its name, size and sampled hash: another file of the same name differs)
    return {"seed": args.seed, "global_rows": world * args.batch_size, "seq_len": args.seq_len,
            "grad_accum": args.grad_accum, "data": "{} ({:,} bytes, sampled sha256 {})".format(
                os.path.basename(args.data), *_sampled(args.data)) if args.data else "corpus"}


def read_state_dict(path, device=None):
    """--init-from: a plain state_dict file (what --consolidate writes, or
    torch.save(model.state_dict())), memory-mapped: its pages are read only where used. Given
    a device, on every rank (a collective): where one rank cannot read it, or reads a copy that
    differs from rank 0's (nodes' own disks), every rank stops."""
    if device is not None:
        with _agreed(device):
            state = read_state_dict(path)
        same_on_every_rank({f"--init-from {path} (bytes, sampled sha256)": _sampled(path)}, device)
        return state
    if os.path.exists(path) and not os.path.isfile(path):  # (a FIFO: reading could wait for ever)
        raise UsageError(f"--init-from {path}: " + (
            "a directory; it takes a .pt or .safetensors file (--consolidate or dcp_to_torch_save "
            "makes one)" if os.path.isdir(path) else "not a regular file"))
    try:  # (torch.load reads safetensors files too, but only from torch 2.12; both memory-map)
        state = (safetensors.torch.load_file(path) if path.endswith(".safetensors") else
                 torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    except Exception as e:  # a missing file, or one that is not a state_dict file of tensors
        # (the loader's message, its lines as one; torch's for a file not a zip: mmap's)
        old = os.path.isfile(path) and not path.endswith(".safetensors") and \
            not zipfile.is_zipfile(path)  # (torch 1.5's torch.save, or not torch's at all)
        why = "not the zip file torch.save writes: cut short, or not torch's; a legacy-format " \
            "one: torch.load it and save it again" if old else \
            f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        raise UsageError(f"--init-from {path}: not a readable state_dict file ({why})") from None
    if not isinstance(state, dict):
        raise UsageError(f"--init-from {path}: holds a {type(state).__name__}, not a state_dict")
    return state


def _sampled(path, pieces=64, piece=1 << 14):
    """path's size and the sha256 of its last MiB and `pieces` pieces spread over the rest, which
    tell two copies apart without reading either whole (a torch file's last bytes, its zip
    directory, hold a CRC-32 of every tensor's bytes)."""
    with open(path, "rb") as f:
        size, digest = os.fstat(f.fileno()).st_size, hashlib.sha256()
        for k in range(pieces):
            f.seek(k * max(size - piece, 0) // pieces)
            digest.update(f.read(piece))
        f.seek(max(size - (1 << 20), 0))
        digest.update(f.read())
    return size, digest.hexdigest()[:12]
