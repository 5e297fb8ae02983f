"""
memory.py: the memory tools. What a rank really holds, under a limit the operating system
enforces, over the events of one step, and how large a model each stage trains within a limit.

    torchrun --nproc_per_node=4 zero.py --stage 3 --max-memory 200MB    # a real limit per rank
    python zero.py --largest-model --world-size 4 --max-memory 200MB    # the wall of each stage
    torchrun --nproc_per_node=4 zero.py --stage 3 --timeline step.svg   # one step's bytes, drawn
    torchrun --nproc_per_node=4 zero.py --timeline-all stages.svg       # all four stages

What it is: --max-memory (RLIMIT_DATA on CPU, the CUDA allocator's share on a GPU, and the
peak data size a rank reached under it), --largest-model (a search that launches trials of N
ranks and brackets each stage's wall), --timeline (zero.py's Meter records every event of a
step; this file draws them, as text and as an SVG), and what every run of the demo uses: a
model this machine cannot hold is refused before it is built (check_fits), and where a rank
is (Progress) names the moment it runs out of memory.

What it uses of zero.py: train(), the Meter's records (meter.timeline), the formulas
(memory_formula), the demo GPT and the command line's parser (training_parser, check_args).
zero.py imports this file at the flags and the calls that need it.
"""
import argparse, bisect, contextlib, functools, html, itertools, os, signal, socket, sys, time
from collections import namedtuple
from multiprocessing import connection, get_context

import torch
import torch.distributed as dist

from zero import GPT, STAGE_NAMES, OutOfMemory, UsageError, bytes_per_parameter, check_args, \
    formula_symbols, gpu_each, log0, memory_formula, train, training_parser
from checkpoints import writable, write_file  # (the files: checkpoints.py's)

# ----------------------------------------------------------------------------------------------
# A real limit per rank: --max-memory SIZE, enforced by the operating system (or CUDA's
# allocator), so that "this stage fits in this much memory" is a fact and not a formula.

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _si(n):  # bytes, 4 significant digits: 1543808 -> "1.544M"
    unit, scale = next(((u, s) for u, s in (("G", 1e9), ("M", 1e6), ("k", 1e3)) if n >= s), ("", 1))
    return f"{n / scale:.4g}{unit}" if unit else f"{n:.0f}"


def memory_size(text):
    """--max-memory's type: '400MB', '2GiB', '1.5e9' (bytes) -> a number of bytes, at least
    1MB: what threads the runtime still starts need (their stacks count; below it one can abort
    the process, in glibc)."""
    number = text.strip().rstrip("BbIiKkMmGgTt ")
    with contextlib.suppress(ValueError, KeyError):  # (else: not a number and a unit)
        size = float(number) * UNITS[text.strip()[len(number):].strip().upper()]
        # (NaN fails it too; under 1MB the threads the runtime still starts have no room: their
        # stacks count)
        if 10**6 <= size < 2**62:
            return int(size)
    raise argparse.ArgumentTypeError(f"{text!r} is not a size from 1MB (the runtime's threads "
                                     "need it) to 4EiB, in B, kB-TB or KiB-TiB, like 400MB")


def _sizes(path="/proc/self/status"):
    """{field: bytes} of the sizes a /proc file lists in kB (Linux), read at one moment: this
    process's (VmData, VmSize, VmPeak...) or, from /proc/meminfo, the machine's (MemAvailable)."""
    with open(path) as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                if v.strip().endswith(" kB")}


def _available():  # the machine's available memory (MemAvailable), infinite where unknown
    with contextlib.suppress(OSError, KeyError):  # (not Linux; --max-memory's trials say why)
        return _sizes("/proc/meminfo")["MemAvailable"]
    return float("inf")


def limit_memory(size, device, watch=None):
    """From now on this rank may allocate `size` bytes beyond what it holds now (its runtime:
    Python, torch, the process group). CPU: RLIMIT_DATA, the limit Linux puts on a process's
    data (the heap and its private mappings, where torch's CPU tensors live), set `size` above
    what the process has; an allocation past it fails and torch raises its out-of-memory error;
    `watch` (a Watch) measures the data size from here. CUDA: torch.cuda.
    set_per_process_memory_fraction, the share of the GPU torch's caching allocator may take.
    Returns the runtime's resident bytes (CPU; 0 on CUDA)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, size / total), device)
        return 0
    import ctypes, resource
    w = torch.zeros(1, requires_grad=True)  # runtime, so before the limit: the first optimizer
    w.grad = torch.zeros(1)                 # imports ~65 MB of modules, the first parallel
    torch.optim.AdamW([w]).step()           # kernel starts the threads (their stacks count)
    torch.ones(256, 256) @ torch.ones(256, 256)
    # glibc: each allocation of 64 KiB or more gets a mapping of its own, given back when freed
    # (else the heap keeps freed tensors, and the limit counts them). The price: fresh pages, and
    # their faults, for every new tensor, so a limited run is slower than an unlimited one. And
    # one malloc arena for all threads: a thread's new arena maps 64 MB of address space for a
    # moment, which hides the data size's peak in the address space's (Watch.used). The price:
    # threads that allocate small objects at once wait for each other.
    with contextlib.suppress(OSError, AttributeError):  # (a C library without mallopt)
        ctypes.CDLL(None).mallopt(-3, 65536)  # M_MMAP_THRESHOLD
        ctypes.CDLL(None).mallopt(-8, 1)  # M_ARENA_MAX
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)  # (RLIM_INFINITY is -1: no min)
        new = _sizes()["VmData"] + size
        resource.setrlimit(resource.RLIMIT_DATA, (new if hard < 0 else min(new, hard), hard))
        if watch is not None:
            watch.start()
        return _sizes()["VmRSS"]
    except (OSError, ValueError) as e:
        raise UsageError(f"--max-memory on CPU needs Linux's RLIMIT_DATA and /proc ({e})") from None


def unlimit_memory():
    """Lift limit_memory's RLIMIT_DATA (CPU) to its hard limit: this rank is out of memory."""
    import resource
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_DATA, (resource.getrlimit(resource.RLIMIT_DATA)[1],) * 2)


def raise_if_out_of_memory(e, args, model, progress):
    """train()'s error e, if it is this rank running out of memory (--max-memory's or a real
    one): OutOfMemory, one line naming the rank, where it was (Progress) and the stage's
    formula. Any other error: nothing (train() raises it as it is)."""
    # glibc's "can't allocate memory" and "Cannot allocate memory", C++'s bad_alloc, and under a
    # limit oneDNN's "could not create a primitive" (refused its memory)
    if not (isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "allocate memory" in str(e)
            or "bad_alloc" in str(e) or args.max_memory and "create a primitive" in str(e)):
        return
    unlimit_memory()  # the line below needs memory too: under the limit it failed again
    world, psi = dist.get_world_size(), sum(p.numel() for p in model.parameters())
    G, need = args.shard_size or world, _formula(args, args.stage, psi, world)
    where = (f"step {progress.step}, " if progress.step else "") + progress.what
    limit = f" (--max-memory {_si(args.max_memory)}B)" if args.max_memory else ""
    raise OutOfMemory(f"rank {dist.get_rank()}: out of memory in {where}{limit}; stage {args.stage}"
                      f"'s formula: its model state alone is {_si(need)}B per rank (Ψ = {psi:,}, "
                      f"N = {world}" + (f", G = {G})" if G < world else ")")) from None


def report_limit(res, args):
    """The report's line under --max-memory: what the ranks used above their runtime. Not model
    state: at least the used peak less the sum of each kind's peak (peaks of other moments)."""
    state, used = sum((res["peak"] or {}).values()), res["used"]
    rest = (f"at least {_si(used - state)}B of it not model state" if used >= state else
            f"less than the model state ({_si(state)}B): it took memory the runtime had freed")
    # (the latter: small tensors, in the heap: VmData did not grow)
    runtime = f"; the runtime itself {_si(res['runtime'])}B" if res["runtime"] > 0 else ""
    log0(f"--max-memory {_si(args.max_memory)}B per rank: at most {_si(used)}B used above the "
         f"runtime, {rest}{runtime} (largest over the ranks)")


class Progress:
    """Where this rank is (which block's forward or backward, which step), for out-of-memory."""
    what = "building the model"
    step = None
    forward = ()  # (Watch: the data size as each block's forward started, in the last forward)

    def note(self, what, block=None):  # block: i at the forward of blocks.i
        self.what = what

    def track(self, model):
        def backward_next(name, module, args, output):
            if torch.is_grad_enabled() and torch.is_tensor(output) and output.requires_grad:
                output.register_hook(lambda g: self.note(f"the backward of {name}"))
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(
                lambda m, a, i=i: self.note(f"the forward of blocks.{i}", block=i))
            block.register_forward_hook(functools.partial(backward_next, f"blocks.{i}"))

    def used(self):  # bytes allocated above the runtime at the most (Watch): unknown
        return -1

    def per_block(self):
        """Bytes one more block adds to what a rank holds beyond its model state: what the data
        size grew by from one block's forward to the next in the last forward (activations kept
        for backward; at stage 3 each sample also holds the block's unit and the one prefetched,
        the same from block to block), on average. 0 where unknown: not under --max-memory on
        CPU (Progress; on CUDA the search then takes the excess as flat, from the trials that
        fitted)."""
        f = self.forward
        return max(0, (f[-1] - f[0]) // (len(f) - 1)) if len(f) > 1 else 0


class Watch(Progress):
    """Progress, and under --max-memory on CPU the data size (VmData: what RLIMIT_DATA
    counts) at each of its moments, from start() on (train() calls it as it sets the limit):
    the largest seen (data), and as each block's forward starts in the last forward (forward):
    from one block to the next it grows by what a block keeps for backward (per_block)."""

    def start(self):  # what used() starts from: the data size now, and the address space
        self.vm, self.forward = _sizes(), []
        self.data = self.data0 = self.now = self.vm["VmData"]

    def note(self, what, block=None):
        super().note(what)
        self.now = _sizes()["VmData"]
        self.data = max(self.data, self.now)
        # blocks.i: the list from i on replaced; blocks.0 starts a new forward, the next block
        # appends (in place, not rebuilt: up to 4,096 blocks)
        if block is not None and torch.is_grad_enabled():
            self.forward[block:] = [self.now]

    def used(self):
        """The most data this rank had since the limit was set (its peak), less the data then.
        Linux keeps no peak of it, but keeps one of the whole address space (VmPeak): data plus
        what is not (code, mapped files, the space malloc's arenas reserve). Training maps and
        unmaps data only (limit_memory lets malloc make no new arena), so where what is not data
        is the same at the end as when the limit was set, the peak of the address space less it
        is the peak of the data. Sampling alone (note(), at each block's forward and backward)
        misses the peaks in between: for the demo GPT at stage 3 under 200MB, by 6 MB, two of
        its blocks; this peak put a run that fitted at 199.4 MB, and the next block out of
        memory. Where it cannot be used (the address space did not grow past its peak from
        before the limit, or what is not data changed), what was sampled."""
        vm, not_data = _sizes(), lambda vm: vm["VmSize"] - vm["VmData"]  # noqa: E731
        usable = vm["VmPeak"] > self.vm["VmPeak"] and not_data(vm) == not_data(self.vm)
        return max(self.data, vm["VmPeak"] - not_data(vm) if usable else 0) - self.data0


# ----------------------------------------------------------------------------------------------
# The memory wall: --largest-model finds, by trying, the largest demo GPT that each stage trains
# within --max-memory: how much larger a model ZeRO trains on the same ranks.

def check_largest_model_args(args):
    """zero.py --largest-model: bad input is a UsageError before anything runs."""
    # (--world-size 2 at least: the stages compared differ only with 2 ranks or more)
    if args.max_memory is None or (args.world_size or 0) < 2:
        raise UsageError("--largest-model needs --max-memory and --world-size 2 at least")
    if "RANK" in os.environ:
        raise UsageError("--largest-model launches its own ranks: run it without torchrun")
    if args.ckpt_dir or args.resume_from or args.init_from:
        raise UsageError("--largest-model trains demo models of its own: not with --ckpt-dir, "
                         "--resume-from, --init-from")


def _psi(args, layers):  # the demo GPT's parameters: one block's, then one block's more per block
    one, per_block = _one_block(args.seq_len, args.d_model, args.n_head)
    return one + (layers - 1) * per_block


@functools.lru_cache(maxsize=None)  # (--largest-model's search asks again and again)
def _one_block(seq_len, d_model, n_head):  # Ψ of a 1-block demo GPT, and of its block
    with torch.device("meta"):  # counted on the meta device (no memory)
        model = GPT(seq_len, d_model, 1, n_head)
    return tuple(sum(p.numel() for p in m.parameters()) for m in (model, model.blocks[0]))


def _formula(args, stage, psi, world=None):  # the model state per rank by the formula, bytes
    return sum(memory_formula(stage, psi, world or args.world_size, *bytes_per_parameter(args),
                              args.shard_size).values())


def check_fits(args, world, device):
    """Refuse, in one line before it is built, a demo model whose state (the stage's formula)
    and logits per rank exceed the memory there is: a floor, not a forecast (CPU: what is
    available, shared by the local ranks; a GPU: its own, shared by the ranks on it)."""
    psi = _psi(args, args.n_layer)
    need = _formula(args, args.stage, psi, world) + 8 * args.batch_size * args.seq_len * 256
    # have: the memory there is: the machine's available memory (infinite where it is not known,
    # not Linux: no floor to hold the model against), on a GPU the GPU's own
    ranks, have = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), _available()
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
        ranks = -(-ranks // torch.cuda.device_count())
    if need * ranks > have:
        raise UsageError(f"this model needs at least {_si(need)}B per rank (stage {args.stage}'s "
                         f"formula, Ψ = {psi:,}, and logits) x {ranks} rank(s): over {_si(have)}B")


def largest_model(args):
    """--largest-model: for each stage, the largest demo GPT (more blocks of --d-model) that
    trains 2 steps within --max-memory on every one of --world-size ranks, found by trying.
    Each trial is a fresh job of N processes on this machine; one that runs out of memory ends
    that trial only. The search starts where the formula puts the wall and brackets it:
    wall_guess() says where, from what the trials that fitted measured."""
    N, rows, walls, lo, t0, tried = args.world_size, [], [], 0, time.time(), {}
    cuda = args.device == "cuda" or args.device is None and args.backend != "gloo" and gpu_each(N)
    # on CPU tensors (as choose_device would put them) the N ranks share this machine's memory:
    # with less than they may take, the kernel would stop the trials, not the limit
    if not cuda and N * args.max_memory > (free := _available()):
        raise UsageError(f"--largest-model: {N} ranks x --max-memory {_si(args.max_memory)}B is "
                         f"more than this machine's available memory ({_si(free)}B)")

    def model_state(stage, layers):
        """The formula's, and in mixed precision step()'s fp32 copy of the gradients stepped
        (unit.step_grad): model state that grows with the model as the formula's does."""
        psi = _psi(args, layers)
        copy = 4 * psi / (1 if stage == 0 else args.shard_size or N) if args.bf16 else 0
        return _formula(args, stage, psi) + copy
    # A SIGTERM ends this process through its finally blocks (exit 143): _trial's kills the
    # trial's ranks
    old = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        # rows: the table's; walls: each stage's largest trial that fitted (a Fit); tried: every
        # trial, by (stage, blocks)
        for stage in range(4):
            fitted = []

            def fits(layers):  # (each probe is one not tried yet: between lo and hi, below)
                tried[stage, layers] = res = _trial(args, stage, layers)
                print(f"  stage {stage}, {layers:>4} blocks, Ψ = {res['psi']:>13,}: " +
                      (f"trained, {_si(res['state'] + res['rest'])}B at the most" if res["ok"]
                       else res["error"].split(" (--max-memory")[0]), flush=True)
                if res["ok"]:  # what it held beyond the formula: in model state, and in all
                    transient = res["state"] - model_state(stage, layers)
                    fitted.append(Fit(layers, transient + res["rest"], transient, res["per_block"]))
                return res["ok"]
            # lo: the most blocks known (or, from the previous stage, taken) to fit, below the cap
            hi, up, down, lo = None, 0, 0, min(lo, MAX_LAYERS - 1)  # hi: the fewest that do not
            while (hi is None or hi - lo > 1) and lo < MAX_LAYERS:
                guess = wall_guess(fitted, walls, lambda n: model_state(stage, n), args.max_memory)
                if guess <= lo:  # the guess is at or below what fits: try above, 1, 2, 4... more
                    layers, up = lo + 2 ** up, up + 1
                elif hi is not None and guess >= hi:  # at or above what did not: 1, 2, 4... less
                    layers, down = hi - 2 ** down, down + 1
                else:
                    layers, up, down = guess, 0, 0
                layers = max(lo + 1, min(layers, MAX_LAYERS if hi is None else hi - 1))
                lo, hi = (layers, hi) if fits(layers) else (lo, layers)
                # lo, taken from the stage before, must fit here too (a later stage holds less
                # than an earlier one, mostly): where it does not, the search goes below it
                if hi == lo + 1 and lo and (stage, lo) not in tried and not fits(lo):
                    lo, hi, down = 0, lo, 0
            rows.append((stage, tried.get((stage, lo)), tried.get((stage, hi))))  # None: not tried
            walls += [max(fitted)] if fitted else []
    finally:
        signal.signal(signal.SIGTERM, old)  # (the handler is --largest-model's only)
    print_memory_wall(args, rows)
    print(f"{len(tried)} trials in {time.time() - t0:.0f} s")
    if not walls:
        raise OutOfMemory(f"--largest-model: not even 1 block of d_model {args.d_model} trains "
                          f"within --max-memory {_si(args.max_memory)}B at any stage")


# What a trial that fitted measured, beyond the formula's model state (bytes): at the most, all
# it held (excess) and the model state alone (transient: buffers the formula does not count),
# and what one more block adds to the rest (per_block: activations).
Fit = namedtuple("Fit", "layers excess transient per_block")
MAX_LAYERS = 4096  # --largest-model stops doubling here


def wall_guess(fitted, walls, formula, limit):
    """Where the wall should be: the most blocks whose formula (model state alone) plus the
    excess (what a rank holds beyond it: transient buffers the formula does not count,
    activations, the backend's buffers) stays within the limit. The excess:
    - measured by this stage's largest trial that fitted, plus what a block adds (the per-block
      growth that trial measured in its forward) for each block more;
    - before any at this stage, the previous stage's the same way, with this stage's transient
      buffers guessed to grow from the previous stage's as they grew from the one before; with
      one stage before it (stage 0, whose model state is the formula's), by half that stage's
      excess (a run of the README's command: 6.3 MB against 17.5 MB). Where activations are
      most of the excess, half of it overestimates the growth: the guess falls under the wall,
      which costs one trial more at most (it fits, and measures this stage's own);
    - before any trial at all, none, on half the limit: the model whose formula is half the
      limit, which leaves half of it for the excess, and measures it."""
    if not (fitted or walls):  # no trial yet: one that measured no excess, on half the limit
        fitted, limit = [Fit(0, 0, 0, 0)], limit / 2
    # excess: what the last trial held beyond the formula, at its blocks, and (from a stage
    # before) the growth guessed for this stage
    last = max(fitted) if fitted else walls[-1]
    excess = last.excess + (0 if fitted else walls[-1].excess / 2 if len(walls) == 1 else
                            max(walls[-1].transient - walls[-2].transient, 0))
    need = lambda n: formula(n) + excess + last.per_block * (n - last.layers)  # noqa: E731
    # need grows with n: bisect_right says how many of 0, 1, 2... blocks fit; the last of them,
    # 1 at the least
    return max(bisect.bisect_right(range(MAX_LAYERS + 1), limit, key=need) - 1, 1)


def _trial(args, stage, layers):
    """One job: N ranks, `layers` blocks, stage `stage`, 2 steps, each rank under --max-memory.
    Returns what rank 0 measured, or the first error a rank reported."""
    # then the rest as given, or by default (stage 0 shards nothing: no --shard-size)
    argv = [f"--stage={stage}", f"--n-layer={layers}", "--steps=2"] + ["--bf16"] * args.bf16 + [
        f"--{name.replace('_', '-')}={getattr(args, name)}" for name in ("d_model", "n_head",
            "seq_len", "batch_size", "max_memory", "timeout", "seed", "backend", "device", "data",
            "shard_size") if getattr(args, name) is not None and (stage or name != "shard_size")]
    with socket.create_server(("127.0.0.1", 0)) as s:  # a free port, for the ranks to meet
        port = str(s.getsockname()[1])
    # (connection.Pipe: what every multiprocessing context's Pipe() returns; the ranks: spawned)
    pipes = [connection.Pipe(duplex=False) for _ in range(args.world_size)]
    procs = [get_context("spawn").Process(target=_trial_rank, args=(
        str(r), str(args.world_size), port, argv, send)) for r, (_, send) in enumerate(pipes)]
    for p, (_, send) in zip(procs, pipes):
        p.start()
        send.close()  # the rank holds it now: one that dies is its pipe's EOF (_collect)
    try:
        results = _collect(pipes, procs, time.time() + 120 + 4 * args.timeout)
    finally:
        for p in procs:
            p.kill()
            p.join()
    # the ranks' reports of failure, a rank that died first (the others fail in its wake); where
    # none failed but a rank never answered, that one
    failed = sorted((results[r] for r in sorted(results) if not results[r]["ok"]),
                    key=lambda f: " died: " not in f["error"]) or [
        {"ok": False, "error": "no answer before the deadline"}] * (len(results) < args.world_size)
    oom = [f for f in failed if "out of memory" in f["error"] or "MemoryError" in f["error"]]
    if failed and not oom:
        raise UsageError(f"--largest-model: a trial failed for another reason than memory "
                         f"(stage {stage}, {layers} blocks): {failed[0]['error']}")
    return {**(oom or [results[0]])[0], "psi": _psi(args, layers), "layers": layers}


def _collect(pipes, procs, deadline):
    """{rank: its report} from the trial's pipes, until every rank has reported, one has run out
    of memory or died (its trial is over: the others only wait for it) or the deadline passes.
    Several ranks may report at once (wait() returns all that are ready): every one is read."""
    results, waiting, over = {}, {recv: r for r, (recv, _) in enumerate(pipes)}, False
    while waiting and not over and time.time() < deadline:
        for recv in connection.wait(list(waiting), timeout=1):
            r = waiting.pop(recv)
            try:
                results[r] = recv.recv()
            except EOFError:  # (the rank is gone: reaped, its exit code is known)
                procs[r].join(timeout=10)
                # (exit code -9: SIGKILL, as the kernel's OOM killer sends)
                results[r] = dict(ok=False, error=f"rank {r} died: exit code {procs[r].exitcode}")
            over = over or not results[r]["ok"] and any(
                what in results[r]["error"] for what in ("out of memory", " died: "))
    return results


def _trial_rank(rank, world, port, argv, send):
    # (rank, world, port: strings, as the environment holds them)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=rank, LOCAL_RANK=rank,
                      WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    # the trials are quiet: what they measure comes back through `send`
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.dup2(1, 2)  # (stderr to the same)
    try:
        res = train(check_args(training_parser("").parse_args(argv)), quiet=True)
        send.send({"ok": True, "state": sum(res["peak"].values()), "runtime": res["runtime"],
                   "rest": res["used"] - sum(res["peak"].values()), "per_block": res["per_block"]})
    except BaseException as e:  # the trial's one line: OutOfMemory's, else an error's first
        first = (str(e).strip().splitlines() or [""])[0]
        send.send({"ok": False, "error": first if isinstance(e, OutOfMemory) else
                   f"rank {rank}: {type(e).__name__}: {first[:200]}"})
    os._exit(0)


def print_memory_wall(args, rows):
    """The table. rows: (stage, its largest trial that fitted, the one that did not), each
    None where there is none."""
    N, G = args.world_size, args.shard_size or args.world_size
    print(f"\nthe memory wall: the largest demo GPT each stage trains (2 steps) with at most "
          f"{_si(args.max_memory)}B\nper rank (--max-memory) on N = {N} ranks"
          + (f" (G = {G})" if G < N else "") + f";\nblocks of d_model {args.d_model}, "
          f"{args.n_head} heads, {args.batch_size} row(s) x {args.seq_len} bytes per rank, "
          + ("bf16 + fp32 AdamW" if args.bf16 else "fp32 AdamW") + "\n")
    print("stage blocks    Ψ trained   formula  measured     rest | blocks    Ψ refused   formula")

    def columns(stage, res):  # a trial's blocks, Ψ and formula
        return f"{res['layers']:>6} {res['psi']:>12,} {_si(_formula(args, stage, res['psi'])):>8}B"
    for stage, ok, no in rows:
        left = f"{columns(stage, ok)} {_si(ok['state']):>8}B {_si(ok['rest']):>7}B" if ok else \
            f"{'none':>6} {'':>12} {'':>9} {'':>9} {'':>8}"
        print(f"{stage:<6}{left} | " + (columns(stage, no) if no else "     -"))
    best = {stage: ok for stage, ok, _ in rows if ok}
    runtime = [b["runtime"] for b in best.values() if b["runtime"]]
    print("\nformula: the model state by the ZeRO paper's formula (arXiv:1910.02054, Figure 1);\n"
          "measured: the most model state a rank held (zero.py's own count); rest: the most a "
          "rank\nallocated above its runtime (CPU: the peak data size, from Linux's peak address "
          "space),\nless that model state: activations, the backend's buffers, temporaries, "
          "Python's objects." + (f"\nRuntime (Python, torch, the backend), not counted in "
                                 f"--max-memory: {_si(max(runtime))}B per rank" if runtime else ""))
    if 0 in best and 3 in best:
        print(f"stage 3 trains {best[3]['psi'] / best[0]['psi']:.1f}x the parameters of stage 0 "
              "on the same ranks")


# ----------------------------------------------------------------------------------------------
# The timeline (--timeline, --timeline-all): the model-state bytes after every event of one
# step, as Meter.event sees them, drawn as stacked bands (an SVG file) and as text (the
# terminal). It shows what the tables only sum up: stage 0 holds everything all step long,
# stage 1 cuts the optimizer band, stage 2's gradients rise and fall unit by unit during
# backward, stage 3's parameters are a sawtooth of gathers and frees.

STACK = ("optimizer", "params", "grads")  # bottom to top: the steady band under the moving ones
COLORS = {"optimizer": "#59a14f", "params": "#4e79a7", "grads": "#f28e2b"}
CHARS = {"optimizer": "░", "params": "█", "grads": "▒"}


class Timeline(list):
    """The moments of one step, as zero.py's Meter sees them (Meter.event calls record()), each
    {"event": what happened, params, grads, optimizer: bytes this rank holds after it (with what
    is in flight), "cuda": torch.cuda.memory_allocated, activations included, or None}."""

    def record(self, zero, what, unit):
        i = None if unit is None else unit.index
        # "reduction launched" and "landed": "all-reduce of unit 3 launched" (the stage's kind)
        reduction = f"{'all-reduce' if zero.stage == 0 else 'reduce-scatter'} of unit {i}"
        label = {"gather": f"gather unit {i}", "free": f"free unit {i}",
                 "gradient buffer": f"gradient buffer of unit {i} made",
                 "gradient buffer dropped": f"gradient buffer of unit {i} dropped",
                 "all-gather after the step": f"all-gather unit {i} after the step"}.get(
            what, what.replace("reduction", reduction))
        cuda = torch.cuda.memory_allocated(zero.device) if zero.meter.cuda else None
        self.append({"event": label, **{k: zero.meter.now[k] for k in STACK}, "cuda": cuda})


def start_timeline(zero):
    """From now on every Meter.event appends its moment to zero.meter.timeline; the first one
    measures everything."""
    zero.meter.timeline = Timeline()
    zero.meter.event("before forward")


def stop_timeline(zero):
    timeline, zero.meter.timeline = zero.meter.timeline, None
    return timeline


# What one run's picture needs: the events of its recorded step (a Timeline), and of each kind
# the formula's bytes per rank and its symbol (12Ψ/N). groups: ", G = 2" under hybrid sharding;
# name: the stage's short name ("data parallel", "ZeRO-2").
Panel = namedtuple("Panel", "stage name step world psi groups dtype events formula symbols")


def timeline_panel(res, args):
    """One run's Panel, from what train() returned (res) and its args."""
    s, N, G = res["stage"], res["world"], args.shard_size or res["world"]
    return Panel(stage=s, name=STAGE_NAMES[s].split(":")[0], step=args.steps, world=N,
                 psi=res["psi"], groups=f", G = {G}" if G < N else "", events=res["timeline"],
                 dtype="bf16 mixed precision" if args.bf16 else "fp32",
                 formula=memory_formula(s, res["psi"], N, *bytes_per_parameter(args), G),
                 # (hybrid: the symbols say 1/G)
                 symbols=formula_symbols(s, "N" if G == N else "G", *bytes_per_parameter(args)))


def _total(e):
    return sum(e[k] for k in STACK)


def _edges(e):  # where each kind's band starts and ends, stacked: 0, optimizer, + params, + grads
    return [0, *itertools.accumulate(e[k] for k in STACK)]


def _peak(events):  # the first event after which the most is held
    return max(range(len(events)), key=lambda j: _total(events[j]))


def _top(panels, cuda):  # the top of the byte axis all panels share
    return max(max(sum(p.formula.values()), _total(e), cuda and e["cuda"] or 0)
               for p in panels for e in p.events)


def timeline_text(panels, width=100):
    """The panels as text on one scale, one row per event: the bytes of each kind after it and a
    stacked bar; ▶ marks the peak, | the formula's total. At most `width` columns wide."""
    bar, top, out = width - 62, _top(panels, cuda=False), []
    col = lambda b: round(b * bar / top)  # noqa: E731
    for p in panels:
        ev, formula, peak = p.events, sum(p.formula.values()), _peak(p.events)
        c = max(col(formula), 1)  # the formula's total: a | in (or after) each bar
        out += [f"stage {p.stage}, {p.name}: model-state bytes "
                f"of rank 0 after each event of step {p.step} (N = {p.world}{p.groups})",
                f"  bar: {' '.join(CHARS[k] + ' ' + k for k in STACK)}, 1 column = "
                f"{_si(top / bar)}B, | the formula's total ({_si(formula)}B)",
                f"  {'event':<34} {'params':>7} {'grads':>7} {'optim':>7}"]
        for j, e in enumerate(ev):
            edge = _edges(e)
            row = "".join(CHARS[k] * (col(b) - col(a)) for k, a, b in zip(STACK, edge, edge[1:]))
            row = row[:c - 1].ljust(c - 1) + "|" + row[c:]
            out.append(f"{'▶' if j == peak else ' '} {e['event'][:34]:<34} {_si(e['params']):>7} "
                       f"{_si(e['grads']):>7} {_si(e['optimizer']):>7} {row}")
        out.append(f"  ▶ peak {_si(_total(ev[peak]))}B at event {peak + 1} of {len(ev)}: "
                   f"{ev[peak]['event']}")
        if ev[0]["cuda"] is not None:
            most = max(ev, key=lambda e: e["cuda"])
            out.append(f"  torch.cuda.memory_allocated (activations too): most "
                       f"{_si(most['cuda'])}B at {most['event']}")
        out.append("")
    return "\n".join(out)


def _tag(name, inner="", **attrs):
    """One SVG element: attributes by keyword (class_ for class, _ for -), floats to 0.1."""
    at = "".join(f' {k.strip("_").replace("_", "-")}="{round(v, 1) if isinstance(v, float) else v}"'
                 for k, v in attrs.items())
    return f"<{name}{at}>{inner}</{name}>" if inner else f"<{name}{at}/>"


def timeline_svg(panels):
    """The panels side by side on one byte axis: per panel one band (a <path>) per kind, stacked,
    the formula's level of each kind (stacked the same way) dashed, the peak marked, and on
    CUDA torch.cuda.memory_allocated as a curve. Hover over the bands for each event. Each panel
    is a group (<g>) moved to its place: in it x and y count from the panel's top left corner."""
    W, H, GAP, L, T = 300, 240, 40, 70, 78  # a panel's width and height, gap, left, top margins
    top = _top(panels, cuda=True) * 1.08
    y = lambda b: H - H * b / top  # noqa: E731  (bytes: the height in a panel)
    # between two lines of the byte axis: the least 1, 2 or 5 x 10^e bytes, at most 6 of them
    tick = min(m * 10**e for e in range(20) for m in (1, 2, 5) if m * 10**e * 6 >= top)
    p0, right = panels[0], L + len(panels) * (W + GAP)
    title = (f"Model-state bytes of rank 0 after each event of one training step (N = "
             f"{p0.world}, Ψ = {p0.psi:,}, {p0.dtype} AdamW)")
    cuda = any(e["cuda"] is not None for p in panels for e in p.events)
    keys = [(COLORS[k], "■", k) for k in STACK[::-1]] + [("black", "╌╌", "formula, stacked"),
                                                         ("red", "●", "peak")]
    keys += [("black", "━━", "torch.cuda.memory_allocated (activations included)")] * cuda
    # the legend: one line of text, a coloured mark before each key, em spaces between (SVG
    # collapses plain spaces)
    legend = "\u2003".join(_tag("tspan", mark, fill=color) + f" {key}" for color, mark, key in keys)
    svg = [_tag("text", title, x=L, y=20, font_size=14), _tag("text", legend, x=L, y=48)]
    for b in range(0, int(top) + 1, tick):  # the byte axis, shared by every panel
        svg += [_tag("line", x1=L, x2=right - GAP, y1=T + y(b), y2=T + y(b), stroke="#ddd"),
                _tag("text", f"{_si(b)}B", x=L - 5, y=T + y(b) + 4, text_anchor="end")]
    for i, p in enumerate(panels):
        ev, dx, edges = p.events, W / len(p.events), [_edges(e) for e in p.events]
        svg.append(f'<g transform="translate({L + i * (W + GAP)},{T})">')
        for b, k in enumerate(STACK):  # a band of kind k: along its top edge, back along its bottom
            outline = [(j + h, edges[j][b + 1]) for j in range(len(ev)) for h in (0, 1)]
            outline += [(j + h, edges[j][b]) for j in reversed(range(len(ev))) for h in (1, 0)]
            d = "M" + " L".join(f"{a * dx:.1f},{y(v):.1f}" for a, v in outline) + " Z"
            svg.append(_tag("path", class_=f"band {k}", data_stage=p.stage, fill=COLORS[k], d=d))
        # the formula's levels (its edges, stacked as the bands are) of kind k at height h,
        # labelled right, left, right: apart where two lines are close
        for k, h in zip(STACK, map(y, _edges(p.formula)[1:])):
            at = dict(x=2) if k == "params" else dict(x=W - 2, text_anchor="end")
            svg += [_tag("line", class_=f"formula {k}", x2=W, y1=h, y2=h, stroke_dasharray="4 2",
                         stroke="black"), _tag("text", f"{k} {p.symbols[k]}", y=h - 3, **at)]
        xy = " ".join(f"{(j + .5) * dx:.1f},{y(e['cuda'] or 0):.1f}" for j, e in enumerate(ev))
        svg += [_tag("polyline", class_="cuda", points=xy, fill="none", stroke="black",
                     stroke_width=2)] * cuda  # (on CUDA only)
        for j, e in enumerate(ev):  # the event under the pointer
            sizes = ", ".join(f"{k} {e[k]:,}" for k in ("params", "grads", "optimizer"))
            hover = _tag("title", f"{j + 1}. {html.escape(e['event'])}: {sizes}")
            svg.append(_tag("rect", hover, x=j * dx, width=dx, height=H, fill="transparent"))
        j = _peak(ev)
        peak = f"peak {_si(_total(ev[j]))}B at event {j + 1}: {html.escape(ev[j]['event'])}"
        svg += [_tag("circle", class_="peak", cx=(j + .5) * dx, cy=y(_total(ev[j])), r=4,
                     fill="red"), _tag("text", peak, y=H + 30)]
        for j in [j for j, e in enumerate(ev) if e["event"] == "optimizer step"]:
            svg += [_tag("line", x1=j * dx, x2=j * dx, y2=H, stroke="#444", stroke_dasharray="1 3"),
                    _tag("text", "step", x=j * dx - 3, y=H - 4, text_anchor="end")]
        svg += [_tag("text", f"stage {p.stage}: {p.name}", y=-8, font_size=13),
                _tag("text", f"{len(ev)} events of step {p.step}, in order", y=H + 15),
                _tag("rect", width=W, height=H, fill="none", stroke="#999"), "</g>"]
    width = max(right, L + 8 * len(title), L + sum(30 + 7 * len(text) for _, _, text in keys))
    return "\n".join([f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
                      f'height="{T + H + 40}" font-family="sans-serif" font-size="11">',
                      '<rect width="100%" height="100%" fill="white"/>', *svg, "</svg>", ""])


def show_timeline(panels, path):
    """Rank 0 prints the timeline as text and writes it as an SVG file to `path`."""
    if dist.get_rank() == 0:
        print("\n" + timeline_text(panels), flush=True)
        write_file(path, timeline_svg(panels))
        print(f"wrote {path}: {len(panels)} panel(s), open it in a browser", flush=True)


def train_every_stage(args):
    """--timeline-all: train stages 0-3 in turn, in this one process group with the same args,
    recording the last step of each; rank 0 draws the four side by side."""
    panels = []
    for stage in range(4):
        res = train(argparse.Namespace(**{**vars(args), "stage": stage}), quiet=True)
        panels.append(p := timeline_panel(res, args))
        # (from scratch, to the last step: its number is the number of steps)
        log0(f"stage {stage}: loss {res['losses'][0]:.4f} -> {res['losses'][-1]:.4f}; step "
             f"{p.step}: {len(p.events)} events, peak {_si(max(map(_total, p.events)))}B")
    show_timeline(panels, args.timeline_all)


def check_timeline_args(args):
    """--timeline, --timeline-all: bad input is a UsageError before anything runs; else the
    last step is the one recorded."""
    path = args.timeline or args.timeline_all
    if args.steps < 2:
        raise UsageError("--timeline records a step after the first: --steps must be 2 or more")
    if args.timeline_all and (args.ckpt_dir or args.resume_from):
        raise UsageError("--timeline-all trains from scratch: not with --ckpt-dir, --resume-from")
    # (writable() is False for a directory that is not there, or a file)
    if not writable(folder := os.path.dirname(path) or ".") or os.path.isdir(path):
        raise UsageError(f"cannot write {path}: " + ("it is a directory" if os.path.isdir(path)
                                                     else f"no such writable directory {folder!r}"))
    if not path.endswith(".svg"):
        raise UsageError(f"{path}: the timeline is an SVG picture: name it FILE.svg")
    args.record_step = args.steps  # the last step's events
