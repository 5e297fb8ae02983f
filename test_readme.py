"""Tests for README.md and docs/*.md: every command they show runs, and prints the lines the
text quotes, in their shape (numbers, bar lengths and spacing aside).

A command is a line `$ command` in a code block; the lines after it, up to the next `$` or the
end of the block, are what it printed (`...` skips lines). Commands the text shows without a `$`
are not run here: a multi-node launch, a SLURM script, code to paste. How each one runs:

- `torchrun ... zero.py | fsdp_demo.py | mistakes.py ARGS` and `python zero.py ...`: in the
  suite's pool of ranks (conftest.py), at the command's own world size, in the order of the text
  (one scenario a run of commands at one world size, each reading what the one before wrote), by
  the script's main(ARGS), from one working directory. A run the text shows at the default 30
  steps is shortened to 2 (`--steps 2`); fsdp_demo.py --bench, to its models at a tiny size.
- `--max-memory`, `--largest-model` (a limit that stays with the process; trials of their own)
  and `python gpu_check.py`: as processes of their own, all at once, started as the session
  starts (start_early), beside the rest of the suite. gpu_check.py without a
  GPU must say so and exit 2; with one it takes 10 minutes and is run by hand.
- `pip install` (what CI runs first) and `python -m pytest` (this suite) are not run again;
  of `pip install ... && command`, the command runs. Nor is a command marked `# benchmark` (the
  memory wall's search: trials of their own, half a minute), whose parts have tests of their
  own; `python test_readme.py` runs it too.

A command whose printed lines hold `error:` must fail (a non-zero exit code); any other must
succeed.
"""
import ast
import atexit
import contextlib
import glob
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import traceback

import pytest
import torch

import fsdp_demo
import zero
from conftest import ENV, HERE, TORCHRUN, scenario

DOCS = ["README.md", *sorted(os.path.relpath(p, HERE)
                             for p in glob.glob(os.path.join(HERE, "docs", "*.md")))]
SCRIPTS = ("zero.py", "fsdp_demo.py", "mistakes.py")


BLOCK = {}  # where -> (doc, the number of its code block): a block's commands run in order


def commands(doc):
    """[(where, command, [the lines it printed])] of one markdown file, in order."""
    found, inside, current, blocks = [], False, None, 0
    lines = open(os.path.join(HERE, doc), encoding="utf-8").read().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            inside, current, blocks = not inside, None, blocks + (not inside)
        elif inside and line.startswith("$ "):
            command, at = line[2:], i + 1
            while command.endswith("\\"):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            current = [f"{doc}:{at}", command, []]
            found.append(current)
            BLOCK[current[0]] = doc, blocks
        elif current is not None and line.strip() not in ("", "..."):
            current[2].append(line)
        i += 1
    return found


def kind(command):
    """'skip', 'process' or ('pool', world, script, argv) for one command (of `A && B`, B)."""
    words = shlex.split(command.split(" #")[0].split("&&")[-1])
    if words[0] == "pip" or words[:3] == ["python", "-m", "pytest"] or "# benchmark" in command:
        return "skip"
    if "gpu_check.py" in words or "--max-memory" in words or "--largest-model" in words:
        return "process"
    if words[0] == "torchrun":
        world = next(int(w.split("=")[1]) for w in words if w.startswith("--nproc_per_node="))
        at = next(i for i, w in enumerate(words) if w in SCRIPTS)
    else:
        assert words[0] == "python" and words[1] in SCRIPTS, command
        world, at = 1, 1
    script, argv = words[at], words[at + 1:]
    if "--steps" not in argv and not {"--estimate", "--consolidate", "--list"} & set(argv) \
            and script != "mistakes.py":
        argv += ["--steps", "2"]  # the default 30, shortened
    return "pool", world, script, argv


EVERY = [c for doc in DOCS for c in commands(doc)]


def segments():
    """[(world, block, [commands])]: the pool's commands, cut where the world size or the code
    block changes. The commands of one block run in order (one writes a checkpoint, the next
    resumes from it); the blocks are independent."""
    out = []
    for where, command, printed in EVERY:
        k = kind(command)
        if k[0] == "pool":
            if not out or out[-1][:2] != (k[1], BLOCK[where]):
                out.append((k[1], BLOCK[where], []))
            out[-1][2].append((where, k[2], k[3]))
    return out


def run_main(script, argv):
    """(exit code, what it printed) of script's main(argv), as zero.run would end it."""
    module = importlib.import_module(script[:-3])
    printed, saved = io.StringIO(), None
    if script == "fsdp_demo.py" and "--bench" in argv:  # its models, at a tiny size
        saved, module.BENCH_MODELS = module.BENCH_MODELS, [
            (name, dict(d_model=16, n_layer=2, n_head=2, seq_len=16, batch_size=2))
            for name, _ in module.BENCH_MODELS]
    code = 0
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            module.main(argv)
    except (zero.UsageError, zero.Diverged, zero.OutOfMemory) as e:
        code = {zero.UsageError: 2, zero.Diverged: 3}.get(type(e), 4)
        printed.write(f"{script}: error: {e}\n")
    except Exception:
        code = 1
        printed.write(traceback.format_exc())
    finally:
        if saved is not None:
            module.BENCH_MODELS = saved
    return code, printed.getvalue()


def make_segment(i, world, cmds):
    def segment(rank, world):
        folder = os.path.join(os.environ["ZERO_TEST_TMP"], "readme")
        os.makedirs(folder, exist_ok=True)
        cwd, out = os.getcwd(), {}
        os.chdir(folder)
        try:
            for where, script, argv in cmds:
                t0 = time.perf_counter()
                out[where] = run_main(script, argv)
                if rank == 0 and os.environ.get("ZERO_TEST_TIMES"):
                    print(f"  {where} {script} {' '.join(argv)}: "
                          f"{time.perf_counter() - t0:.2f} s", file=sys.__stderr__, flush=True)
        finally:
            os.chdir(cwd)
        return out
    segment.__name__ = segment.__qualname__ = f"segment_{i}"
    segment.__module__ = __name__
    return segment


SEGMENTS, previous = [], None
for i, (world, block, cmds) in enumerate(segments()):
    fn = make_segment(i, world, cmds)
    globals()[fn.__name__] = fn  # where the pool finds it (by its module and name)
    SEGMENTS.append(scenario(world, reads=SEGMENTS[-1:] if block == previous else [])(fn))
    previous = block


LAUNCHED = {}  # where -> (its process, the file its output goes to)


def start_early():
    """The commands that run as processes, started at once, as the session starts (conftest.py
    calls this once the tests are collected): they run beside the rest of the suite."""
    folder = tempfile.mkdtemp(prefix="readme-")
    for where, command, _ in EVERY:
        if kind(command) != "process" or "gpu_check.py" in command and torch.cuda.is_available():
            continue  # (gpu_check.py on a GPU: 10 minutes, run by hand)
        words = shlex.split(command.split(" #")[0].split("&&")[-1])
        words = [os.path.join(HERE, w) if w in SCRIPTS + ("gpu_check.py",) else w for w in words]
        words = [*TORCHRUN, *words[1:]] \
            if words[0] == "torchrun" else [sys.executable, *words[1:]]
        if "--max-memory" in words and "--steps" not in words and "--largest-model" not in words:
            words += ["--steps", "2"]  # the default 30, shortened
        out = open(os.path.join(folder, f"{len(LAUNCHED)}.out"), "w+", encoding="utf-8")
        LAUNCHED[where] = subprocess.Popen(words, cwd=folder, env=ENV, text=True, stdout=out,
                                           stderr=subprocess.STDOUT), out
    atexit.register(lambda: [p.kill() for p, _ in LAUNCHED.values() if p.poll() is None])


@pytest.fixture(scope="module")
def processes():
    """{where: (exit code, stdout + stderr)} of the commands that run as processes."""
    if not LAUNCHED:
        start_early()
    t0, done = time.perf_counter(), {}
    for where, (p, out) in LAUNCHED.items():
        code = p.wait(timeout=900)
        out.seek(0)
        done[where] = (code, out.read())
        if os.environ.get("ZERO_TEST_TIMES"):
            print(f"  process {where}: waited {time.perf_counter() - t0:.1f} s",
                  file=sys.__stderr__)
    return done


def shape(line):
    """A printed line as the text quotes it: numbers, bars and runs of spaces aside."""
    line = re.sub(r"[░█▒|]+", "▒", line)
    line = re.sub(r"\d[\d,]*(\.\d+)?(e[-+]?\d+)?", "#", line)
    return " ".join(line.split())


def check(where, printed, code, out):
    assert (code != 0) == any("error:" in line for line in printed), (where, code, out[-3000:])
    got = [shape(line) for line in out.splitlines()]
    at = 0
    for line in printed:  # each quoted line, in order
        want = shape(line)
        found = next((j for j in range(at, len(got)) if got[j] == want), None)
        assert found is not None, f"{where}: not printed: {line!r}\n--- printed:\n{out[-4000:]}"
        at = found + 1


@pytest.mark.parametrize("doc", DOCS)
def test_every_command_runs_and_prints_what_the_text_quotes(doc, ran, processes):
    results = {}
    for fn, (world, _, _) in zip(SEGMENTS, segments()):
        results.update(ran(fn, world)[0])
    results.update(processes)
    checked, old = 0, set()  # torch < 2.9: FSDP2's commands on the CPU, and the rest of their block
    for where, command, printed in EVERY:
        if not where.startswith(f"{doc}:") or kind(command) == "skip" or where not in results:
            continue
        if fsdp_demo.NO_CPU_FSDP2 and (BLOCK[where] in old or "fsdp_demo.py" in command and (
                "--bench" in command or not re.search(r"--stage [01]\b", command))):
            old.add(BLOCK[where])  # (fsdp_demo.py refuses them, in one line: test_fsdp_demo.py)
            continue
        code, out = results[where]
        check(where, printed, code, out)
        checked += 1
    assert checked or doc != "README.md"


def test_the_readme_is_a_guide_not_a_book():
    words = 0
    for doc in DOCS:
        text = open(os.path.join(HERE, doc), encoding="utf-8").read()
        words += len(text.split())
        assert "previous run" not in text and "earlier run" not in text, doc
    assert len(open(os.path.join(HERE, "README.md"), encoding="utf-8").read().splitlines()) <= 450
    assert words <= 9000, words
    for doc in DOCS:  # every page of docs/ is linked from the README
        assert doc == "README.md" or doc in open(os.path.join(HERE, "README.md")).read(), doc


def test_the_readme_says_where_part_i_is():
    """The README's line numbers of Part I and of ZeRO-1's end are zero.py's."""
    text = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    lines = open(os.path.join(HERE, "zero.py"), encoding="utf-8").read().splitlines()
    start = next(i for i, line in enumerate(lines, 1) if "PART I: THE ALGORITHM" in line)
    wrap = next(i for i, line in enumerate(lines, 1) if line.startswith("def wrap("))
    end = next(i for i in range(wrap, len(lines)) if not lines[i].strip())  # wrap's last line
    zero1 = next(n.end_lineno for n in ast.parse("\n".join(lines)).body
                 if isinstance(n, ast.ClassDef) and n.name == "ZeRO1")  # its last line
    quoted = set(re.findall(r"Part I[^(]*\(lines (\d+)-(\d+)\)", text))
    assert quoted == {(str(start), str(end))}, (quoted, start, end)
    by = re.search(r"ZeRO-1 is\s+complete by line (\d+)", text)
    assert by and zero1 <= int(by[1]), (zero1, by)


def _key(line):
    return re.findall(r"\d[\d,.]*", line)[:2]


def update(docs):
    """python test_readme.py [DOC ...]: run every command the docs show, as a user would (each
    its own process, in one scratch directory, in the order of the text), and write back each
    quoted line as the fresh output's line of the same shape: numbers, times and bars as they
    are now. A quoted line whose shape the output no longer has is left, and said."""
    scratch, stale = tempfile.mkdtemp(prefix="readme-"), 0
    for doc in docs:
        path = os.path.join(HERE, doc)
        lines = open(path, encoding="utf-8").read().split("\n")
        for where, command, printed in commands(doc):
            if kind(command) == "skip" and "# benchmark" not in command:
                continue
            words = shlex.split(command.split(" #")[0].split("&&")[-1])
            words = [os.path.join(HERE, w) if w in SCRIPTS + ("gpu_check.py",) else w
                     for w in words]
            words = [*TORCHRUN, *words[1:]] \
                if words[0] == "torchrun" else [sys.executable, *words[1:]]
            print(f"{where}: {command}", flush=True)
            out = subprocess.run(words, cwd=scratch, env=ENV, capture_output=True, text=True)
            got, at, i = (out.stdout + out.stderr).splitlines(), 0, int(where.split(":")[1])
            for line in printed:
                i = lines.index(line, i)
                same = [j for j in range(at, len(got)) if shape(got[j]) == shape(line)]
                # of the lines of that shape, the one with the same first two numbers ("step
                # 30", a table's "3 8" row) where there is one
                found = next((j for j in same if _key(got[j]) == _key(line)),
                             same[0] if same else None)
                if found is None:
                    stale += 1
                    print(f"  not printed now: {line}")
                    continue
                lines[i], at = got[found], found + 1
        open(path, "w", encoding="utf-8").write("\n".join(lines))
    return stale


if __name__ == "__main__":
    sys.exit(1 if update(sys.argv[1:] or DOCS) else 0)
