"""What every test file shares: the rank processes that run the multi-rank scenarios, the
command-line helpers, and pytest's set-up.

A scenario is a function fn(rank, world) in a test file, decorated with @scenario(2, 4): the
world sizes it runs at. The tests right below it read what each rank returned with
ran(fn, world) (the `ran` fixture): [fn(0, world), fn(1, world), ...]. A scenario that raises
on some rank fails only the tests that read it, with that rank's traceback; the others run on.

The ranks are the processes of one pool, started once per session (a process costs seconds of
imports, a scenario a fraction of that). All the scenarios of one world size run in one launch:
N of the processes join a fresh gloo group and call them in turn. A scenario that reads what
another one wrote (reads=other) runs in a later launch where it must: the N = 4 ranks write a
checkpoint, the N = 2 ranks read it and write theirs, which N = 4 ranks read in a second launch.
A launch starts when a test first asks for one of its scenarios. Where a GPU is visible, the CUDA
cases (ids with "cuda") run the same scenarios on CUDA tensors in a second pool; elsewhere they
are skipped, saying what is missing. ZERO_TEST_TIMES=1 (with pytest -s) prints each scenario's
seconds: where the suite's time goes.

A test that runs a command end to end and only reads what it printed declares it Early: the
session runs those one after another in the background from the start, beside the pool, so that
no test waits for its own process with a core idle.
"""
import atexit
import contextlib
import copy
import functools
import gc
import io
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import zero

HERE = os.path.dirname(os.path.abspath(__file__))
DEVICE = torch.device("cpu")  # where a rank process computes: its GPU in a CUDA run
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
CUDA_ENV = dict(ENV, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""))  # GPUs shown
if "CUDA_VISIBLE_DEVICES" not in os.environ:
    del CUDA_ENV["CUDA_VISIBLE_DEVICES"]
MODEL = ["--n-layer", "2", "--d-model", "16", "--seq-len", "16"]  # the demo GPT, tiny
SMALL = ["--steps", "3", *MODEL, "--batch-size", "4", "--lr", "5e-3"]  # its loss falls in 3 steps
CKPT = ["--stage", "2", *MODEL, "--batch-size", "2"]  # the runs that write checkpoints


SELECTED = set()  # the test modules of this session's tests: only their scenarios run


def pytest_collection_modifyitems(config, items):
    SELECTED.update(item.module.__name__ for item in items)


def pytest_collection_finish(session):
    # A test module's slow processes of its own (start_early()) start now, beside the suite
    for module in dict.fromkeys(item.module for item in session.items):
        if hasattr(module, "start_early"):
            module.start_early()
    run_early(session.items)  # and the processes declared Early
    freeze_modules()


def pytest_runtest_teardown(item):
    freeze_modules()


MODULES = [0]  # how many modules were imported at the last freeze_modules()


def freeze_modules():
    """After new imports (torch, torch._dynamo with the first optimizer, FSDP2's modules): what is
    alive now moves out of the garbage collector's sight (gc.freeze), once the garbage is gone.
    Imports leave hundreds of thousands of objects that live as long as the process, and each
    full collection would walk them all again: a gc.collect() of the tests, or of fsdp_demo's
    compare(), took half a second in a rank process."""
    if len(sys.modules) > MODULES[0]:
        MODULES[0] = len(sys.modules)
        gc.collect()
        gc.freeze()


def pytest_configure(config):
    # zero.py silences torch 2.13's renaming of the two collectives at import; pytest resets the
    # warning filters for every test, so the same filter goes here
    config.addinivalue_line("filterwarnings", f"ignore:{zero.RENAMED}:FutureWarning")


# ----------------------------------------------------------------------------------------------
# Scenarios: where each one runs

SCENARIOS = {}  # (module, name) -> (world sizes, the scenarios it reads, chained, CUDA worlds)


def scenario(*worlds, reads=(), chain=False, cuda=()):
    """Register fn(rank, world) to run on each of `worlds` ranks (and on CUDA tensors at the
    world sizes in `cuda`, where a GPU is visible). reads: the scenarios (one, or a list) whose
    files it reads, which then run first at every world size they run at; chain: at each world
    size after the first, it reads what it wrote at the one before."""
    def register(fn):
        SCENARIOS[fn.__module__, fn.__name__] = (
            worlds, [reads] if callable(reads) else list(reads), chain, cuda)
        return fn
    return register


def plan(modules):
    """([(world, [scenario keys])], {(key, world): index}): the launches of the scenarios of these
    test modules (and those they read), in the order they run. Each world size has one launch,
    in the order 4, 2, 1, 3, and a later one where a scenario reads what runs after it."""
    wanted, todo = set(), [k for k in SCENARIOS if k[0] in modules]
    while todo:
        key = todo.pop()
        if key not in wanted:
            wanted.add(key)
            todo += [(r.__module__, r.__name__) for r in SCENARIOS[key][1]]
    launches, at = [(w, []) for w in (4, 2, 1, 3)], {}  # at: (key, world) -> index of its launch
    for key, (worlds, reads, chain, _) in [(k, v) for k, v in SCENARIOS.items() if k in wanted]:
        for k, world in enumerate(worlds):
            deps = ([((r.__module__, r.__name__), w) for r in reads
                     for w in SCENARIOS[r.__module__, r.__name__][0]]
                    + [(key, worlds[k - 1])] * (chain and k > 0))
            need = max([at[d] + (d[1] != world) for d in deps], default=0)
            i = next((i for i in range(need, len(launches)) if launches[i][0] == world), None)
            if i is None:
                launches.append((world, []))
                i = len(launches) - 1
            launches[i][1].append(key)
            at[key, world] = i
    return launches, at


# ----------------------------------------------------------------------------------------------
# The rank processes: one pool for the session, a fresh gloo group for each launch

ZERO_SETTINGS = ("PIECE", "DIRECT")  # zero.py's module settings that scenarios change


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def destroy_group():
    time.sleep(0.05)  # torch 2.6: as in zero.run, gloo's threads let go of their tensors first
    dist.destroy_process_group()


def _rank_process(conn, transport):
    """A process of the pool. Each task: join a new process group as `rank` of `world`, call each
    scenario in turn, from zero.py's own settings, and save what it returned; after each, say so
    (None), or send its traceback. The group: gloo on CPU tensors, or for a CUDA run (transport
    "cuda-gloo" or "cuda-nccl") that backend on the GPU zero.setup gives this rank (NCCL: its
    own; gloo: local rank modulo the GPUs, so N ranks share one GPU where there is one)."""
    global DEVICE
    import importlib
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    if transport == "cpu":  # CPU runs on the CPU, wherever GPUs are visible
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    defaults = {name: copy.deepcopy(getattr(zero, name)) for name in ZERO_SETTINGS}
    freeze_modules()
    while (task := conn.recv()) is not None:
        rank, world, port, keys, shared, folder = task
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          ZERO_TEST_TMP=shared)
        backend = "nccl" if transport == "cuda-nccl" else "gloo"
        DEVICE = (torch.device("cpu") if transport == "cpu"
                  else zero.choose_device(backend, "cuda")[1])
        dist.init_process_group(backend, timeout=timedelta(seconds=60))
        for module, name in keys:
            for setting, value in defaults.items():
                setattr(zero, setting, copy.deepcopy(value))
            try:
                t0 = time.perf_counter()
                out = getattr(importlib.import_module(module), name)(rank, world)
                if rank == 0 and os.environ.get("ZERO_TEST_TIMES"):
                    print(f"scenario N{world} {name}: {time.perf_counter() - t0:.2f} s",
                          file=sys.__stderr__, flush=True)
                torch.save(out if transport == "cpu" else on_cpu(out),
                           os.path.join(folder, f"{module}.{name}.{rank}.pt"))
                freeze_modules()
                conn.send(None)
            except BaseException:
                conn.send(traceback.format_exc())
        destroy_group()
    os._exit(0)  # (a pool's process has nothing to tear down: the pool is done with it)


class ScenarioFailed(Exception):
    """A scenario raised on some rank: every test that reads it fails with this, and its text."""


class Pool:
    """Rank processes started once and reused by every launch: each costs seconds of imports
    (torch, and torch._dynamo with the first optimizer), which a process per launch would pay
    again and again."""

    def __init__(self, size, transport="cpu"):
        self.size, self.transport, self.procs, self.conns = size, transport, [], []
        self.folder = tempfile.mkdtemp(prefix="zero-results-")
        self.failed = {}  # (key, world) -> what went wrong

    def start(self):
        ctx = mp.get_context("spawn")
        for _ in range(self.size):
            here, there = ctx.Pipe()
            self.procs.append(ctx.Process(target=_rank_process, args=(there, self.transport),
                                          daemon=True))
            self.procs[-1].start()
            there.close()
            self.conns.append(here)

    def launch(self, world, keys, shared):
        """Run the scenarios `keys` in turn on `world` ranks, which find the directory `shared`
        in $ZERO_TEST_TMP. One that fails on some rank (an error, or a rank gone) is recorded in
        self.failed, the ranks are started anew and the scenarios after it run on."""
        while keys:
            if not self.procs or not all(proc.is_alive() for proc in self.procs):
                self.close(kill=True)
                self.start()
            folder = os.path.join(self.folder, f"N{world}")
            os.makedirs(folder, exist_ok=True)
            port = _free_port()
            try:
                for r in range(world):
                    self.conns[r].send((r, world, port, keys, str(shared), folder))
            except OSError:
                pass  # a rank process has ended: _wait says so
            done, error = self._wait(world, keys)
            if error is None:
                return
            self.failed[keys[done], world] = error
            self.close(kill=True)  # the other ranks may wait for the failed one in a collective
            keys = keys[done + 1:]

    def _wait(self, world, keys):
        """(how many of keys every rank finished, None) once all are done, or at the first
        failure (index of the failed scenario, what went wrong). A limit only for a rank that
        hangs outside any collective: 1200 s with no answer."""
        answered = [0] * world
        while min(answered) < len(keys):
            waiting = [r for r in range(world) if answered[r] < len(keys)]
            ready = wait_for_any([self.conns[r] for r in waiting]
                                 + [self.procs[r].sentinel for r in waiting], timeout=1200)
            if not ready:
                return min(answered), f"no answer from ranks {waiting} in 1200 s"
            for r in waiting:
                try:
                    if not self.conns[r].poll():
                        if not self.procs[r].is_alive():
                            raise EOFError
                        continue
                    message = self.conns[r].recv()
                except (EOFError, OSError):
                    self.procs[r].join(1)
                    return answered[r], (f"rank {r}: the rank process ended, exit code "
                                         f"{self.procs[r].exitcode} "
                                         "(negative: killed by that signal)")
                if message is not None:
                    return answered[r], f"rank {r}: {message}"
                answered[r] += 1
        return len(keys), None

    def results(self, key, world):
        if (key, world) in self.failed:
            raise ScenarioFailed(f"{key[1]} at N = {world} failed:\n{self.failed[key, world]}")
        folder = os.path.join(self.folder, f"N{world}")
        return [torch.load(os.path.join(folder, f"{key[0]}.{key[1]}.{r}.pt"), weights_only=False)
                for r in range(world)]

    def close(self, kill=False):
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(0 if kill else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs, self.conns = [], []


def on_cpu(x):
    """x with every tensor in it moved to the CPU (dicts, lists and tuples opened)."""
    if torch.is_tensor(x):
        return x.cpu()
    if isinstance(x, dict):
        return type(x)({k: on_cpu(v) for k, v in x.items()})
    return type(x)(on_cpu(v) for v in x) if isinstance(x, (list, tuple)) else x


# The CUDA runs: each (transport, N) is one launch of N ranks on CUDA tensors, in a pool of its own
# that starts only when a CUDA case runs and a GPU is visible. N ranks share one GPU over gloo
# (NCCL refuses two ranks on one GPU); NCCL runs where there is a GPU per rank, and with one rank
# on any GPU (what `python zero.py` does on a one-GPU machine).
CUDA_RUNS = [("cuda-nccl", 1), ("cuda-gloo", 2), ("cuda-gloo", 4), ("cuda-nccl", 2),
             ("cuda-nccl", 4)]


def run_id(run):
    transport, world = run
    return f"N{world}" if transport == "cpu" else f"{transport}-N{world}"


def cuda_missing(transport="cuda-gloo", world=1):
    """Why a CUDA run of `world` ranks over `transport` cannot run here; None if it can."""
    if not torch.cuda.is_available():
        built = torch.version.cuda or torch.version.hip
        return "no CUDA GPU: " \
               f"{'none is visible' if built else 'this torch is built without CUDA'} " \
               f"(torch {torch.__version__})"
    if transport == "cuda-nccl" and not dist.is_nccl_available():
        return f"NCCL: this torch ({torch.__version__}) is built without it"
    if transport == "cuda-nccl" and torch.cuda.device_count() < world:
        return (f"NCCL needs a GPU per rank: {world} ranks, "
                f"{torch.cuda.device_count()} GPU(s) visible "
                "(the cuda-gloo cases share one)")
    return None


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ranks"))  # what one launch of the ranks leaves for the next


@pytest.fixture(scope="session")
def ran(shared):
    """ran(fn, world, transport="cpu"): every rank's result of scenario fn at N = world. The
    launches run, in plan order, up to the one that holds it."""
    launches, at = plan(SELECTED)
    pools, done = {}, set()

    def results(fn, world, transport="cpu"):
        key = (fn.__module__, fn.__name__)
        if world not in SCENARIOS[key][0 if transport == "cpu" else 3]:
            raise KeyError(f"{fn.__name__} does not run at N = {world} ({transport})")
        if transport != "cpu":
            missing = cuda_missing(transport, world)
            if missing:
                pytest.skip(missing)
        if transport not in pools:
            pools[transport] = Pool(4, transport)
        pool = pools[transport]
        if transport == "cpu":
            for i in range(at[key, world] + 1):
                if i not in done and launches[i][1]:
                    done.add(i)
                    pool.launch(*launches[i], shared)
        elif (transport, world) not in done:  # a CUDA run: every scenario it runs, in one launch
            done.add((transport, world))
            folder = os.path.join(shared, run_id((transport, world)))
            os.makedirs(folder, exist_ok=True)
            pool.launch(world, [k for k, (_, _, _, cuda) in SCENARIOS.items() if world in cuda],
                        folder)
        return pool.results(key, world)
    yield results
    for pool in pools.values():
        pool.close()


# ----------------------------------------------------------------------------------------------
# The model most scenarios train, and its single-process reference

V, D, H, B, T = 13, 6, 11, 3, 5  # vocab, width, hidden, rows per rank, tokens per row
STEPS = 2
CASES = {
    # Units: emb, block 0, block 1, norm, head. The head's weight is the embedding's, so the tied
    # parameter sits in one unit and is used by two. Two micro-batches per step and clipping
    # (max norm small enough that it really clips).
    "adamw": dict(optimizer=functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
                  accum=2, clip=0.05, units="each"),
    # Units: the two blocks; the root unit holds emb (tied to the head), norm and the head's bias.
    "sgd": dict(optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
                accum=1, clip=None, units="blocks"),
    # AdamW and clipping hardly notice a gradient off by a constant factor; plain SGD does. Two
    # micro-batches, default units (the blocks, found by default_units).
    "sgd-accum": dict(optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                      accum=2, clip=None, units=None),
}


class Net(nn.Module):
    """Awkward on purpose: 401 trainable parameters (divisible by neither 2 nor 4) in units of
    uneven size, the output head tied to the embedding, a frozen layer and a buffer."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)  # ranks build different weights: wrap must broadcast rank 0's
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))
                                    for _ in range(2))
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.rand(D) + 0.5)

    def forward(self, x):  # x: [rows, T] token ids -> logits [rows, T, V]
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(self.frozen(h) * self.scale))


def global_batch(step, micro, world):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randint(V, (world * B, T), generator=g)
    return x, (x * 7 + 3) % V  # a learnable target


def run_steps(model, optimizer, clip, case, rows, world, steps, start=0, after_step=lambda: None,
              no_sync=True):
    """The training loop, the same for zero.py (rows: this rank's) and the reference (rows: all).
    zero.py's micro-batches but the last run in no_sync() (no_sync=False: every backward
    reduces)."""
    for step in range(start, start + steps):
        for micro in range(case["accum"]):
            x, y = (t[rows].to(DEVICE) for t in global_batch(step, micro, world))
            deferred = no_sync and hasattr(optimizer, "no_sync") and micro < case["accum"] - 1
            with optimizer.no_sync() if deferred else contextlib.nullcontext():
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) / case["accum"]
                loss.backward()
        if case["clip"]:
            clip(case["clip"])
        optimizer.step()
        after_step()
        optimizer.zero_grad()


@functools.lru_cache(maxsize=None)  # the same few references serve many tests (they only read them)
def reference(case, world, steps=STEPS):
    model = Net(seed=100)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = CASES[case]["optimizer"](params)
    clip = functools.partial(torch.nn.utils.clip_grad_norm_, params)
    run_steps(model, optimizer, clip, CASES[case], slice(None), world, steps)
    return {n: p.detach() for n, p in model.named_parameters()}


def wrapped(rank, stage, case, seed, **kwargs):
    model = Net(seed=seed + rank).to(DEVICE)
    units = {"blocks": list(model.blocks),
             "each": [model.emb, *model.blocks, model.norm, model.head],
             None: None}[CASES[case]["units"]]
    return model, zero.wrap(model, stage, CASES[case]["optimizer"], units=units, **kwargs)


def unit_layout(opt):
    return {"psi": opt.psi, "S": [u.S for u in opt.units],
            "root": [not u.modules for u in opt.units],
            "emb": [any(p is opt.model.emb.weight for p in u.params) for u in opt.units],
            # the tensors the optimizer steps
            "pieces": len(opt.optimizer.param_groups[0]["params"])}


# ----------------------------------------------------------------------------------------------
# The command line: in this process (zero.main, which raises where the command line prints one
# line), or end to end

TINY = ["--d-model", "16", "--n-layer", "2", "--n-head", "2", "--seq-len", "16",
        "--batch-size", "2", "--steps", "3"]


def losses(stdout):
    return [float(x) for x in re.findall(r"^step +\d+ \| loss (\d+\.\d+)", stdout, re.M)]


def main_printed(main, argv):
    """What main(argv) prints (in this process: no launch, no process group for these)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(argv)
    return printed.getvalue()


def main_refused(main, argv):
    """(the message of the UsageError main(argv) raised, or None; what it printed)."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            main(argv)
    except zero.UsageError as e:
        return str(e), printed.getvalue()
    return None, printed.getvalue()


def command(*args, torchrun=0, script=os.path.join(HERE, "zero.py"), torchrun_args=()):
    """The command line of script (zero.py) with args: a process of its own, or torchrun's with
    that many ranks."""
    return [*([*TORCHRUN, f"--nproc_per_node={torchrun}", *torchrun_args] if torchrun
              else [sys.executable]), script, *args]


# torchrun on one machine, each launch on a free port: recent torch's default; older torch (2.6,
# tried) gives every launch port 29500, and two at once meet in one store (the suite runs some
# side by side)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def run_py(*args, env=ENV, **how):
    """command(*args, **how) run to its end (on the CPU: env hides the GPUs)."""
    return subprocess.run(command(*args, **how), capture_output=True, text=True, timeout=300,
                          env=env, cwd=HERE)


class Early:
    """A process whose output a test reads, declared where its test file is imported, with
    run_py's arguments. Once the tests are collected, the session runs the early processes of
    its test files one after another in the background, beside the rank pool: a test then finds
    its process done where it would have waited for it, one core idle. result(): the
    CompletedProcess, once it has ended (started now if it had not been). fixture: a process of
    conftest.py's, run where a test uses that fixture."""
    declared = []

    def __init__(self, *args, env=ENV, fixture=None, **how):
        self.module, self.fixture = sys._getframe(1).f_globals["__name__"], fixture
        self.words, self.env, self.proc, self.done = command(*args, **how), env, None, None
        self.lock = threading.Lock()
        Early.declared.append(self)

    def start(self):
        with self.lock:  # (the background's thread, or a test's)
            if self.proc is None:
                self.files = [tempfile.TemporaryFile("w+", encoding="utf-8") for _ in "12"]
                self.proc = subprocess.Popen(self.words, stdout=self.files[0],
                                             stderr=self.files[1], env=self.env, cwd=HERE)
        return self.proc

    def result(self):
        if self.done is None:
            try:
                code = self.start().wait(timeout=300)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise
            for f in self.files:
                f.seek(0)
            self.done = subprocess.CompletedProcess(self.words, code,
                                                    *(f.read() for f in self.files))
        return self.done


def run_early(items):
    """Run the early processes these tests read, one after another, in a thread of their own."""
    used = {name for item in items for name in item.fixturenames}
    todo = [e for e in Early.declared if e.module in SELECTED or e.fixture in used]
    threading.Thread(target=lambda: [e.start().wait() for e in todo], daemon=True).start()
    atexit.register(lambda: [e.proc.kill() for e in todo if e.proc and e.proc.poll() is None])


def launcher_script(path, body):
    """A launcher script at `path` that imports zero.py from here and runs `body`."""
    with open(path, "w") as f:
        f.write(f"import os, signal, sys\nsys.path.insert(0, {HERE!r})\nimport zero\n\n{body}")
    return str(path)


@pytest.fixture(scope="module")
def one_rank():
    """A gloo group of one in this process, for zero.main and the checkpoint functions."""
    made = not dist.is_initialized()
    if made:
        zero.setup("gloo", "cpu")
    assert dist.get_world_size() == 1
    yield
    if made:
        destroy_group()


EARLY = tempfile.mkdtemp(prefix="zero-early-")  # the early processes' files, gone at exit
atexit.register(shutil.rmtree, EARLY, True)
MISSING = os.path.join(EARLY, "none.pt")
REFUSED = {  # bad command lines, end to end: name -> (its process, what stderr must name)
    "argument": (Early("--stage", "7", fixture="refused"), "argument --stage"),
    # found once the process group exists and the model is built; WORLD_SIZE without RANK (not
    # torchrun's): a group of one, where it waited for ranks that could not come, till --timeout
    "after setup": (Early(*SMALL, "--init-from", MISSING, fixture="refused",
                          env=dict(ENV, WORLD_SIZE="2")), f"--init-from {MISSING}"),
    "fsdp_demo.py": (Early("--stage", "1", "--bf16", script=os.path.join(HERE, "fsdp_demo.py"),
                           fixture="refused"), "--bf16"),
    "mistakes.py": (Early("no-such-mistake", script=os.path.join(HERE, "mistakes.py"),
                          fixture="refused"), "no mistake named 'no-such-mistake'")}


@pytest.fixture(scope="session")
def refused():
    """Bad command lines run end to end, each a process of its own: {name: (exit code, stdout,
    stderr, what stderr must name)}. The rest are checked in-process (zero.main), where the
    check is about the message."""
    done = {}
    for name, (process, message) in REFUSED.items():
        out = process.result()
        done[name] = (out.returncode, out.stdout, out.stderr, message)
    return done


def full_checkpoint(path):
    """{(key, parameter name): full tensor} of every per-element value in a checkpoint (master
    weights and optimizer state), assembled here from the parts, independently of zero.py's
    reader, plus the optimizer's scalars of each parameter ("scalars": {name: {key: value}})."""
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    parts = [torch.load(os.path.join(path, f), weights_only=True)
             for f in sorted(manifest["files"])]
    full = {}
    for i, params in enumerate(manifest["units"]):
        for key in ["master"] + list(parts[0]["units"][i]["state"]):
            get = ((lambda unit: unit["master"]) if key == "master"
                   else (lambda unit, key=key: unit["state"][key]))
            flat = torch.cat([get(part["units"][i]) for part in parts])  # [N*S]
            o = 0
            for name, shape in params:
                n = math.prod(shape)
                full[key, name], o = flat[o:o + n].view(shape), o + n
    full["scalars"] = {n: s for part in parts for n, s in part["param_scalars"].items()}
    return full


# Several command lines in one torchrun launch (a launch costs seconds of imports per rank; each
# line below is a zero.main call with the arguments the command line would get, in processes that
# torchrun started, as `torchrun zero.py ARGS` runs it). Rank 0 prints a line "=== name" first.
CLI_RUNS = [(f"stage {stage}", ["--stage", str(stage), *SMALL]) for stage in range(4)] + [
    ("tradeoffs", ["--tradeoffs", *SMALL]),  # test_tradeoffs.py: the stages' runs again
    ("max-memory", ["--stage", "3", *SMALL, "--max-memory", "300MB"])]  # last: the limit stays
CLI_DRIVER = """
def main():  # as a user writes it: zero.run(main) calls it without argv
    for name, argv in {runs!r}:
        if os.environ["RANK"] == "0":
            print("=== " + name, flush=True)
        zero.main(argv)


zero.run(main)
"""


CLI = Early(script=launcher_script(os.path.join(EARLY, "runs.py"),
                                   CLI_DRIVER.format(runs=CLI_RUNS)),
            torchrun=4, fixture="cli_runs")


@pytest.fixture(scope="session")
def cli_runs():
    out = CLI.result()
    parts = re.split(r"^=== (.+)\n", out.stdout, flags=re.M)[1:]
    return out, dict(zip(parts[::2], parts[1::2]))


def assert_trains_like(got, want, cuda=False, tol=1e-5, what=""):
    """{name: tensor} of two runs that must have trained alike: every element within tol (0:
    bit for bit). On a GPU (cuda) kernels need not be bit-reproducible (an embedding's backward
    adds with atomics, in any order), and AdamW's first steps, almost sign(gradient) * lr, turn
    a rounding apart into a step apart wherever a gradient is near zero: there the largest
    difference may be a few steps (lr 1e-2 here), the mean one must stay below 1e-3."""
    assert list(got) == list(want), what
    for name, t in want.items():
        diff = (got[name].float() - t.float()).abs()
        if cuda:
            assert diff.max() <= 5e-2 and diff.mean() <= 1e-3, (what, name, diff.max(), diff.mean())
        else:
            assert diff.max() <= tol, f"{what} {name}: differs by {diff.max():.2e}"
