"""Tests for memory.py: the memory timeline of one step (--timeline, --timeline-all), a real
limit per rank (--max-memory) and the largest model each stage trains within it
(--largest-model).

What the README claims, and the tests that check it:

- The timeline records what memory_breakdown() measures, at every event, and draws it:
  test_timeline_events_are_what_memory_breakdown_measures,
  test_timeline_svg_has_one_band_per_kind_and_stage, test_timeline_text_fits_100_columns,
  test_timeline_bad_input_is_one_line_and_exit_2.
- --max-memory is enforced, and running out is one line: test_max_memory_passes_what_fits_and_
  refuses_what_cannot, test_cuda_max_memory_refuses_a_run_that_cannot_fit (on a GPU); its report
  line: test_the_limit_line_never_prints_a_negative_size; out of memory however the library
  words it: test_out_of_memory_is_named_however_the_library_words_it.
- --largest-model finds each stage's wall: test_largest_model_finds_the_wall_of_each_stage (the
  guess and the bracket), test_peak_data_sees_a_peak_between_samples (what a trial held at the
  most), test_a_trial_out_of_memory_ends_only_that_trial,
  test_trial_reports_that_arrive_together_are_all_read,
  test_largest_model_refuses_what_it_cannot_measure.
"""
import contextlib
import io
import os
import re
import signal
import time

import pytest
import torch

import memory
import zero
from conftest import (CUDA_ENV, EARLY, MODEL, SMALL, TINY, Early, cuda_missing, losses,
                      run_py, scenario)

# ----------------------------------------------------------------------------------------------
# The timeline of one step (--timeline, --timeline-all): what it records, draws and prints

@scenario(2)
def timeline_runs(rank, world):
    # zero.main() itself, in the spawned ranks: --timeline-all, then --timeline on stage 3 in
    # bf16; memory_breakdown() is sampled right after every event the Meter records.
    sampled, runs, event = [], {}, zero.Meter.event

    def sample(meter, what, unit=None):
        event(meter, what, unit)
        if meter.timeline is not None:
            z = meter.zero
            sampled.append((z.stage, dict(meter.timeline[-1]), z.memory_breakdown()))
    zero.Meter.event = sample
    tmp = os.environ["ZERO_TEST_TMP"]
    for name, args in [("all", ["--timeline-all"]),
                       ("bf16", ["--bf16", "--stage", "3", "--timeline"])]:
        path, printed = os.path.join(tmp, f"{name}.svg"), io.StringIO()
        with contextlib.redirect_stdout(printed):
            zero.main([*args, path, *TINY])
        runs[name] = {"stdout": printed.getvalue(), "sampled": sampled[:],
                      "svg": open(path, encoding="utf-8").read() if rank == 0 else None}
        sampled.clear()
    zero.Meter.event = event
    return runs


@pytest.fixture(scope="module")
def timelines(ran):
    return ran(timeline_runs, 2)


def test_timeline_events_are_what_memory_breakdown_measures(timelines):
    for rank, runs in enumerate(timelines):
        for name, stages in [("all", range(4)), ("bf16", [3])]:
            sampled = runs[name]["sampled"]
            assert sorted({s for s, _, _ in sampled}) == list(stages)
            for entry_stage, entry, measured in sampled:
                assert {k: entry[k] for k in measured} == measured, (rank, name, entry)
                assert entry["cuda"] is None  # no GPU here: no second curve
            for stage in stages:
                events = [e for s, e, _ in sampled if s == stage]
                labels = " / ".join(e["event"] for e in events)
                assert events[0]["event"] == "before forward" and "optimizer step" in labels
                assert ("all-reduce of unit 1 launched" in labels) == (stage == 0), labels
                assert ("reduce-scatter of unit 1 landed" in labels) == (stage > 0), labels
                assert ("gradient buffer of unit 1 made" in labels) == (stage >= 2), labels
                assert ("all-gather unit 1 after the step" in labels) == (stage in (1, 2)), labels
                params, grads = [e["params"] for e in events], [e["grads"] for e in events]
                if stage == 3:  # the sawtooth: gathered and freed, back to the shard at the end
                    assert "gather unit 0" in labels and "free unit 0" in labels
                    assert max(params) > params[0] == params[-1]
                    assert sum(b > a for a, b in zip(params, params[1:])) >= 4
                else:
                    assert len(set(params)) == 1
                if stage >= 2:  # the full gradients of a unit or two, each reduce-scattered away
                    assert max(grads) > grads[0] == grads[-1]


def test_timeline_svg_has_one_band_per_kind_and_stage(timelines):
    import xml.etree.ElementTree as ET
    for name, stages in [("all", range(4)), ("bf16", [3])]:
        root = ET.fromstring(timelines[0][name]["svg"])
        ns = "{http://www.w3.org/2000/svg}"
        bands = [(int(p.get("data-stage")), p.get("class").split()[1])
                 for p in root.iter(ns + "path") if p.get("class", "").startswith("band ")]
        assert sorted(bands) == [(s, k) for s in stages for k in sorted(memory.STACK)]
        assert len([c for c in root.iter(ns + "circle") if c.get("class") == "peak"]) == len(stages)
        formula = [x for x in root.iter(ns + "line") if "formula" in x.get("class", "")]
        assert len(formula) == 3 * len(stages)
        assert not [x for x in root.iter(ns + "polyline") if x.get("class") == "cuda"]


def test_timeline_text_fits_100_columns(timelines):
    for name, stages in [("all", range(4)), ("bf16", [3])]:
        out = timelines[0][name]["stdout"]
        assert timelines[1][name]["stdout"] == ""  # rank 0 alone prints
        text = out[out.index("\nstage"):]
        assert max(len(line) for line in text.splitlines()) <= 100
        number = r" +(\d[\d.]*[kMG]?)"  # bytes as printed: 43.78k
        rows = [m for m in (re.match(r"([▶ ]) (.{34})" + 3 * number + " [░█▒| ]*$", line)
                            for line in text.splitlines()) if m]
        events = [e for s, e, _ in timelines[0][name]["sampled"]]
        assert [m[2].rstrip() for m in rows] == [e["event"][:34] for e in events]
        assert [m[3] for m in rows] == [memory._si(e["params"]) for e in events]
        assert sum(m[1] == "▶" for m in rows) == len(stages)
        assert out.count("  ▶ peak ") == len(stages) and "wrote " in out
    assert "model state per rank" in timelines[0]["bf16"]["stdout"]  # --timeline: the report too


UNWRITABLE_SVG = os.path.join(EARLY, "missing", "t.svg")
UNWRITABLE = Early("--timeline", UNWRITABLE_SVG)


def test_timeline_bad_input_is_one_line_and_exit_2(tmp_path):
    cases = [(["--timeline", str(tmp_path)], "is a directory"),
             (["--timeline", str(tmp_path / "t.svg"), "--steps", "1"], "--steps must be 2"),
             (["--timeline", "a.svg", "--timeline-all", "b.svg"], "choose one"),
             (["--timeline", "/proc/t.svg"], "cannot write /proc/t.svg"),  # (as root too)
             (["--timeline-all", str(tmp_path / "t.svg"), "--ckpt-dir", str(tmp_path)],
              "--ckpt-dir"),
             (["--timeline-all", str(tmp_path / "t.svg"), "--resume-from", str(tmp_path)],
              "from scratch: not with --ckpt-dir, --resume-from"),
             (["--timeline", "t.svg", "--estimate", "--params", "1e9", "--world-size", "8"],
              "--estimate and --timeline: choose one")]
    for args, message in cases:  # refused before any process group or training
        with pytest.raises(zero.UsageError, match=re.escape(message)):
            zero.main(args)
    out = UNWRITABLE.result()  # and from the command line
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("zero.py: error: cannot write ")
    assert "no such writable" in out.stderr
    assert "step " not in out.stdout and os.listdir(tmp_path) == []
    assert not os.path.exists(os.path.dirname(UNWRITABLE_SVG))


# ----------------------------------------------------------------------------------------------
# A real limit per rank (--max-memory), and the memory wall found by trying (--largest-model)

TOO_SMALL = Early("--stage", "0", "--d-model", "256", "--n-layer", "2", "--n-head", "4",
                  "--seq-len", "16", "--steps", "2", "--max-memory", "4MB", "--timeout", "30",
                  torchrun=2)


def test_max_memory_passes_what_fits_and_refuses_what_cannot(cli_runs):
    # Under --max-memory 300MB per rank the tiny model trains as without it (4 ranks, torchrun).
    # With 4MB, stage 0's 16Ψ = 26 MB cannot even be built: every rank says so in one line
    # (which rank, where, the formula), and the job ends (no rank waits for another).
    assert losses(cli_runs[1]["max-memory"]) == losses(cli_runs[1]["stage 3"])
    # (either branch of the line: a tiny model's state may fit in memory the runtime had freed)
    used = re.search(r"^--max-memory 300MB per rank: at most (\S+)B used above the runtime, "
                     r"(at least \S+B of it not model state|less than the model state \(\S+B\): "
                     r"it took memory the runtime had freed); the runtime itself (\S+)B "
                     r"\(largest over the ranks\)$", cli_runs[1]["max-memory"], re.M)
    assert used, cli_runs[1]["max-memory"][-1500:]
    out = TOO_SMALL.result()
    assert out.returncode != 0
    # (a rank whose partner ran out first may instead fail in the collective it waits in)
    lines = [line for line in out.stderr.splitlines() if line.startswith("zero.py: error: rank")
             and "a collective failed, another rank is gone" not in line]
    assert lines, out.stderr[-3000:]
    for line in lines:
        assert re.fullmatch(
            r"zero.py: error: rank [01]: out of memory in building the model "
            r"\(--max-memory 4MB\); stage 0's formula: its model state alone is 26\.\d+MB "
            r"per rank \(Ψ = 1,6\d\d,\d+, N = 2\)", line), line
    # no traceback from the ranks (torchrun prints its own)
    assert 'zero.py", line' not in out.stderr


def test_the_limit_line_never_prints_a_negative_size(one_rank, capsys):
    # A tiny model's state may take memory the runtime had freed: the data size grew less than
    # the model state (seen with torch 2.6). The line says so instead of "-530KB not model state"
    args = zero.training_parser("").parse_args(["--max-memory", "300MB"])
    for used, want in [(3_500_000, "at least 2.97MB of it not model state"),
                       (0, "less than the model state (530kB): it took memory the runtime")]:
        memory.report_limit({"peak": {"params": 530_000}, "used": used, "runtime": 1}, args)
        assert want in capsys.readouterr().out


def test_out_of_memory_is_named_however_the_library_words_it(one_rank):
    # Under --max-memory 1MB a trial's rank once failed in oneDNN ("could not create a
    # primitive": it could not allocate): out of memory, as torch's and glibc's words are; without
    # a limit that error is not presumed to be memory
    args = zero.training_parser("").parse_args(["--max-memory", "1MB"])
    model, progress = torch.nn.Linear(2, 2), memory.Progress()
    for error in (RuntimeError("could not create a primitive"), MemoryError(),
                  RuntimeError("std::bad_alloc")):
        with pytest.raises(zero.OutOfMemory, match=r"^rank 0: out of memory in building the "):
            memory.raise_if_out_of_memory(error, args, model, progress)
    args.max_memory = None
    assert memory.raise_if_out_of_memory(RuntimeError("could not create a primitive"), args,
                                         model, progress) is None


# In a process of its own: the limit stays with the process.
PEAK_BETWEEN_SAMPLES = Early("\n".join([
    "import torch, memory",
    "torch.set_num_threads(1)",
    "memory.limit_memory(200 * 10**6, torch.device('cpu'))",
    "watch = memory.Watch()",
    "watch.start()",
    "watch.note('before')",
    "x = torch.ones(40 * 10**6 // 4)  # 40 MB, made and freed between two samples",
    "del x",
    "watch.note('after')",
    "print(watch.data - watch.data0, watch.used())",
    "memory.unlimit_memory()  # out of memory: what reports it may allocate again",
    "print(torch.ones(300 * 10**6 // 4).numel())"]), script="-c")


def test_peak_data_sees_a_peak_between_samples():
    # Under --max-memory the data size is sampled at each block's forward and backward (note());
    # a tensor made and freed between two samples is missed there, not by Watch.used(), which
    # takes the peak from Linux's peak of the address space.
    out = PEAK_BETWEEN_SAMPLES.result()
    assert out.returncode == 0, out.stderr
    sampled, peak, beyond = map(int, out.stdout.split())
    assert sampled < 10**6 and 40 * 10**6 <= peak < 42 * 10**6, (sampled, peak)
    assert beyond == 75 * 10**6  # 300 MB, past the 200 MB limit once unlimit_memory() lifted it


def test_a_trial_out_of_memory_ends_only_that_trial():
    # --largest-model's trials: 2 ranks each, spawned; one that cannot fit reports its line and
    # ends, and the caller goes on. (What a trial that fits reports is what the report prints
    # under --max-memory: test_max_memory_passes_what_fits_and_refuses_what_cannot.)
    args = zero.training_parser("").parse_args([*MODEL, "--d-model", "128", "--batch-size", "2",
                                                "--max-memory", "1MB"])  # 3.4 MB of state a rank
    args.world_size = 2
    refused = memory._trial(args, 3, 2)
    assert not refused["ok"] and "out of memory" in refused["error"] and refused["layers"] == 2
    with torch.device("meta"):
        assert refused["psi"] == sum(p.numel() for p in zero.GPT(16, 128, 2, 4).parameters())


def test_trial_reports_that_arrive_together_are_all_read():
    # Two ranks run out of memory and report in the same instant, a third is still working:
    # wait() returns both pipes at once, and the first report ends the trial. Every ready report
    # is read, none raises (a KeyError here once ended --largest-model in a traceback), and the
    # rank that never reports is not waited for.
    import multiprocessing as mp
    pipes = [mp.Pipe(duplex=False) for _ in range(3)]
    for r in (0, 2):
        pipes[r][1].send({"ok": False, "error": f"rank {r}: out of memory in the forward"})
    for _ in range(50):  # both pipes readable before _collect looks
        if all(pipes[r][0].poll() for r in (0, 2)):
            break
        time.sleep(0.01)
    results = memory._collect(pipes, procs=[None] * 3, deadline=time.time() + 60)
    assert sorted(results) == [0, 2] and all("out of memory" in res["error"]
                                             for res in results.values())
    pipes[1][1].send({"ok": True})  # a normal trial: every rank reports, then it is over
    pipes[0][1].send({"ok": True})
    pipes[2][1].send({"ok": True})
    assert sorted(memory._collect(pipes, procs=[None] * 3, deadline=time.time() + 60)) == [0, 1, 2]


def test_a_trial_rank_that_dies_is_named_at_once(monkeypatch):
    # The parent kept each pipe's sending end open, so a rank killed outright (the OOM killer, a
    # segfault) was no EOF, and only a rank out of memory ended a trial early: it waited out its
    # deadline, then said "no answer". Rank 1 dies here while rank 0 fails in its wake (a closed
    # connection) and would wait on: the trial ends at once, naming rank 1's death first.
    import multiprocessing as mp

    def rank_fn(rank, world, port, argv, send):
        os.closerange(3, send.fileno())  # (forked: only its own pipe, as a spawned rank holds)
        os.closerange(send.fileno() + 1, 1 << 16)
        if rank == "1":
            os._exit(3)
        send.send({"ok": False, "error": "rank 0: RuntimeError: Connection closed by peer"})
        time.sleep(600)
    monkeypatch.setattr(memory, "get_context", lambda _: mp.get_context("fork"))
    monkeypatch.setattr(memory, "_trial_rank", rank_fn)  # (fork: the child's too)
    args = zero.training_parser("").parse_args(["--timeout", "1", "--max-memory", "1GB"])
    args.world_size = 2
    with pytest.raises(zero.UsageError, match=r"a trial failed .*: rank 1 died: exit code 3$"):
        memory._trial(args, 1, 2)


@pytest.mark.parametrize("excess", ["none", "growing", "steep", "stage3_heavier"])
def test_largest_model_finds_the_wall_of_each_stage(monkeypatch, capsys, excess):
    # The search (a guess from the formula and what the trials that fitted measured, then a
    # bracket) and the table, with stand-in trials that fit exactly when the formula's model state
    # plus an excess is within the limit, and report that excess as the real trials measure it
    # (peak_data): none; one modeled on the README's run (a rest that grows with the blocks,
    # transient buffers that grow with the stage); or a steeper one, which the first guess of
    # each stage misses. Each stage's row must name the largest model that fits and the next
    # one, which does not, in few trials.
    limit, MB = 10**6, 10**6 / 200  # the README's 200 MB, scaled to 1 MB

    with torch.device("meta"):  # Ψ grows by one block's parameters per block
        one, two = (sum(p.numel() for p in zero.GPT(16, 16, n, 2).parameters()) for n in (1, 2))

    def psi_of(layers):
        return one + (layers - 1) * (two - one)

    def transient(stage):  # model state beyond the formula (buffers in flight, gathered units)
        return {"none": [0] * 4, "growing": [0, 6.3, 12.9, 19.5], "steep": [0, 12, 30, 60],
                "stage3_heavier": [0, 6.3, 12.9, 80]}[excess][stage] * MB

    def rest(stage, layers):  # the README's run: 10.6 MB + 0.5 MB a block (stage 3: 3.4 MB more)
        if excess == "none":
            return 0
        if excess in ("steep", "stage3_heavier"):  # (stage 3 then holds more than stage 2)
            return (30 + 1.0 * layers) * MB
        return (10.6 + 0.5 * layers + 3.4 * (stage == 3)) * MB

    def need(stage, layers):
        return (sum(zero.memory_formula(stage, psi_of(layers), 4).values())
                + transient(stage) + rest(stage, layers))
    calls = []

    def trial(args, stage, layers):
        calls.append((stage, layers))
        f = sum(zero.memory_formula(stage, psi_of(layers), 4).values())
        return {"ok": need(stage, layers) <= limit, "psi": psi_of(layers), "layers": layers,
                "state": f + transient(stage), "runtime": 0, "rest": rest(stage, layers),
                "per_block": rest(stage, layers + 1) - rest(stage, layers),
                "error": ("" if need(stage, layers) <= limit
                          else "rank 0: out of memory in the forward")}
    monkeypatch.setattr(memory, "_trial", trial)
    zero.main(["--largest-model", "--max-memory", "1MB", "--world-size", "4", *MODEL])
    out = capsys.readouterr().out
    rows = {int(m[0]): (int(m[1]), int(m[2])) for m in
            re.findall(r"^(\d) +(\d+) +[\d,]+ +\S+ +\S+ +\S+ \| +(\d+) ", out, re.M)}
    assert sorted(rows) == [0, 1, 2, 3]
    for stage, (fits, refused) in rows.items():
        assert (need(stage, fits) <= limit < need(stage, refused)
                and refused == fits + 1), (stage, fits, refused)
    assert (rows[2][0] > rows[1][0] > rows[0][0]
            and (rows[3][0] > rows[2][0]) == (excess != "stage3_heavier"))
    assert re.search(r"stage 3 trains \d+\.\dx the parameters of stage 0", out)
    # A trial to measure, then 2 a stage where the guess is right (none, and the README's excess:
    # 9, a third of the 27 the search before this one made); more where the first guesses miss by
    # several blocks, and where stage 3 fits less than the wall it starts from
    assert (len(calls) == len(set(calls))
            <= {"steep": 16, "stage3_heavier": 20}.get(excess, 9)), calls
    assert re.search(rf"^{len(calls)} trials in \d+ s$", out, re.M)


def test_largest_model_stops_at_its_cap_at_every_stage(monkeypatch, capsys):
    # every model fits: each stage stops at MAX_LAYERS blocks (the later stages started one
    # above the earlier stage's wall, so past the cap)
    calls = []

    def trial(args, stage, layers):
        calls.append((stage, layers))
        return {"ok": True, "psi": 1000 * layers, "layers": layers, "state": 1000, "runtime": 0,
                "rest": 0, "per_block": 0, "error": ""}
    monkeypatch.setattr(memory, "_trial", trial)
    monkeypatch.setattr(memory, "MAX_LAYERS", 8)
    zero.main(["--largest-model", "--max-memory", "1MB", "--world-size", "2", *MODEL])
    assert calls == [(stage, 8) for stage in range(4)], calls


def test_largest_model_refuses_what_it_cannot_measure(monkeypatch, capsys):
    # One rank (the stages do not differ there), a limit the ranks together cannot have on this
    # machine, a SIGTERM (the trial's ranks are killed on the way out: exit 143), and a limit in
    # which no stage trains even 1 block (the table, then one line and exit code 4).
    monkeypatch.delenv("RANK", raising=False)
    before = signal.getsignal(signal.SIGTERM)
    for args, message in [(["--max-memory", "200MB", "--world-size", "1"],
                           "--world-size 2 at least"),
                          (["--max-memory", "1000TB", "--world-size", "2"],
                           "more than this machine's available memory"),
                          (["--max-memory", "200MB", "--world-size", "2", "--resume-from", "d"],
                           "trains demo models of its own: not with --ckpt-dir"),
                          (["--max-memory", "200MB", "--world-size", "2", "--estimate"],
                           "--estimate and --largest-model: choose one")]:
        with pytest.raises(zero.UsageError, match=message):
            zero.main(["--largest-model", *args, *MODEL])
    killed = []

    def trial(args, stage, layers):
        if stage == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        killed.append(stage)  # (what _trial's finally does with the ranks, it does on SIGTERM too)
        return {"ok": False, "psi": 1, "layers": layers,
                "error": "rank 0: out of memory in the forward"}
    monkeypatch.setattr(memory, "_trial", trial)
    with pytest.raises(SystemExit) as e:
        zero.main(["--largest-model", "--max-memory", "2MB", "--world-size", "2", *MODEL])
    assert e.value.code == 143 and set(killed) == {0}
    assert signal.getsignal(signal.SIGTERM) == before  # (the handler is --largest-model's only)
    monkeypatch.setattr(memory, "_trial", lambda args, stage, layers: trial(args, 0, layers))
    with pytest.raises(zero.OutOfMemory,
                       match="not even 1 block of d_model 16 trains within --max-memory 2MB"):
        zero.main(["--largest-model", "--max-memory", "2MB", "--world-size", "2", *MODEL])
    assert re.search(r"^3 +none .*\| +1 ", capsys.readouterr().out, re.M)


def test_cuda_max_memory_refuses_a_run_that_cannot_fit():
    # --max-memory SIZE on CUDA caps this process's share of the GPU
    # (torch.cuda.set_per_process_memory_fraction): a run that cannot fit in 1 MB stops with one
    # line on stderr (exit code 4), while one with room enough trains.
    missing = cuda_missing()
    if missing:
        pytest.skip(missing)
    out = run_py("--device", "cuda", "--max-memory", "1MB", *SMALL, env=CUDA_ENV)
    assert out.returncode == 4 and out.stderr.count("\n") == 1, out.stderr
    assert ("out of memory" in out.stderr.lower()
            and "Traceback" not in out.stderr + out.stdout), out.stderr
    fits = run_py("--device", "cuda", "--max-memory", "4GB", *SMALL, env=CUDA_ENV)
    assert fits.returncode == 0 and len(losses(fits.stdout)) == 3, fits.stderr
