"""Tests for fsdp_demo.py: PyTorch's own implementation of each stage (DDP,
ZeroRedundancyOptimizer, FSDP2's fully_shard, HSDP) trains exactly like zero.py's, measured the
same way; and a run moves between zero.py and FSDP2 through each one's checkpoints.

What the README claims, and the tests that check it:

- PyTorch's counterparts train like zero.py: test_pytorch_counterpart_trains_like_zero,
  test_hybrid_pytorch_counterpart_trains_like_zero, test_fsdp_demo_compare_end_to_end (and from
  pretrained weights, --init-from), test_fsdp_demo_bf16; bad input is one line:
  test_fsdp_demo_bad_input (also FSDP2 on the CPU where torch is older than 2.9).
- They are measured the same way: test_dispatcher_count_agrees_with_zero_own_count,
  test_pytorch_memory_and_communication, test_bench_prints_every_stage_against_pytorch (no
  timing asserted: only that the ratio is the one of the two times printed).
- Moving to FSDP and back (a zero.py checkpoint continues under FSDP2, an FSDP2 DCP checkpoint
  under zero.py, at another N and stage): test_a_run_moves_between_zero_and_fsdp2_with_the_same_
  losses, test_moving_keeps_every_weight_and_adam_value, test_moving_refuses_bad_input_in_one_line.
"""
import argparse
import contextlib
import io
import math
import os
import re
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import checkpoints
import conftest
import fsdp_demo
import zero
from conftest import MODEL, SMALL, full_checkpoint, losses, main_printed, main_refused, scenario

# PyTorch's FSDP2 on the CPU needs torch 2.9 or newer (fsdp_demo.NO_CPU_FSDP2 says why, or is
# None): with an older torch the scenarios run DDP and ZeroRedundancyOptimizer only, FSDP2's own
# scenarios are not run, and the tests that read FSDP2's runs are skipped, saying why.
OLD = fsdp_demo.NO_CPU_FSDP2
needs_fsdp2 = pytest.mark.skipif(OLD is not None, reason=str(OLD))
STAGES = [0, 1, *(pytest.param(stage, marks=needs_fsdp2) for stage in (2, 3))]


def fsdp2_scenario(*worlds, **kwargs):  # a scenario that runs FSDP2: none where torch is too old
    return (lambda fn: fn) if OLD else scenario(*worlds, **kwargs)


# ----------------------------------------------------------------------------------------------
# PyTorch's own implementations train exactly like zero.py

@scenario(2, 4)
def fsdp_scenarios(rank, world):
    import fsdp_demo
    args = zero.training_parser("").parse_args(SMALL + ["--grad-accum", "2"])
    out = {}
    for stage in range(2 if OLD else 4):
        args.stage = stage
        with contextlib.redirect_stdout(io.StringIO()):  # compare() prints both reports
            theirs, ours = fsdp_demo.compare(args, keep_params=True)
        out[stage] = {"theirs": theirs, "ours": ours}
    if world == 4 and not OLD:
        # the command lines of fsdp_demo.py, as zero.run(fsdp_demo.main) runs them
        out["--compare"] = main_printed(fsdp_demo.main, ["--stage", "3", "--compare", *SMALL])
        out["--bf16"] = main_printed(fsdp_demo.main, ["--stage", "3", "--bf16", *SMALL])
    if world == 2 and not OLD:
        # pretrained weights: FSDP2 loads rank 0's file with set_model_state_dict (broadcast from
        # rank 0), zero.py reads each rank's own shards of the memory-mapped file
        path = os.path.join(os.environ["ZERO_TEST_TMP"], "pretrained.pt")
        if rank == 0:
            torch.manual_seed(123)
            other = zero.GPT(16, 16, 2, 4)  # SMALL's model, other weights: 3x the usual scale,
            with torch.no_grad():           # so that its first loss is not a fresh model's (at
                for p in other.parameters():  # 10x the logits are so large that float32's
                    p.mul_(3)                 # rounding differs between the sides by ~1e-4)
            torch.save(other.state_dict(), path)
        dist.barrier()
        out["--init-from"] = main_printed(fsdp_demo.main, ["--stage", "2", "--compare", *SMALL,
                                                           "--init-from", path])
    return out


@scenario(2)
def fsdp_bad_input(rank, world):
    import fsdp_demo
    # --init-from a state_dict that does not fit (a key missing, a tie's values apart): refused
    # on every rank as zero.py refuses it (a traceback before; the untied one trained silently)
    path = os.path.join(os.environ["ZERO_TEST_TMP"], "bad-init-{}.pt")
    if rank == 0:
        state = zero.GPT(16, 16, 2, 4).state_dict()  # MODEL's
        torch.save({**state, "head.weight": state["head.weight"] + 1}, path.format("untied"))
        torch.save({k: v for k, v in state.items() if k != "wpe.weight"}, path.format("missing"))
    dist.barrier()
    return [(args, *main_refused(fsdp_demo.main, args)) for args in BAD_FSDP] + [
        (name, *main_refused(fsdp_demo.main, ["--stage", stage, *SMALL, "--init-from",
                                              path.format(name)]))
        for name in BAD_INIT for stage in ["0"] + ["3"] * (not OLD)]


BAD_INIT = {"untied": "tied here, different there: wte.weight and head.weight",
            "missing": "does not fit the model: no 'wpe.weight' in it"}


BAD_FSDP = {("--stage", "5"): "--stage",
            ("--stage", "1", "--bf16"): "--bf16 is FSDP2's MixedPrecisionPolicy: stages 2 and 3 "
                                        "only",
            ("--compare", "--bench"): "--bench and --compare: choose one",
            ("--repeats", "5"): "--repeats is for --bench",
            # HSDP's mesh needs G to divide N: refused on every rank, not a traceback on some
            **({} if OLD else {("--stage", "3", "--shard-size", "3", *MODEL):
                               "--shard-size 3 must divide the world size 2"})}


@fsdp2_scenario(2)
def small_bench(rank, world):
    import fsdp_demo
    saved, fsdp_demo.BENCH_MODELS = fsdp_demo.BENCH_MODELS, [
        ("tiny", dict(d_model=16, n_layer=2, n_head=2, seq_len=16, batch_size=2))]
    try:
        return main_printed(fsdp_demo.main, ["--bench", "--repeats", "1", "--steps", "2"])
    finally:
        fsdp_demo.BENCH_MODELS = saved


@needs_fsdp2
def test_bench_prints_every_stage_against_pytorch(ran):
    # --bench on a tiny model: no timing is asserted, only that every stage is run against its
    # counterpart, that the ratio is the one of the two times printed (within their rounding,
    # whatever the times are), and that the bytes in the table are the measured ones the formula
    # predicts.
    import fsdp_demo
    out = ran(small_bench, 2)[0]
    rows = [line.split() for line in out.splitlines() if line.startswith("tiny ")]
    assert [int(r[1]) for r in rows] == [0, 1, 2, 3]
    for row, name in zip(rows, fsdp_demo.PYTORCH_NAMES):
        assert " ".join(row[2:-8]) == name
        ms_torch, ms_zero, ratio = map(float, row[-8:-5])
        assert all(math.isfinite(x) and x >= 0 for x in (ms_torch, ms_zero, ratio))
        # each column is rounded (ms to 0.05, the ratio to 5e-4): ratio x ms_torch is
        # ms_zero to within
        assert abs(ratio * ms_torch - ms_zero) <= 0.05 * (1 + ratio) + 5e-4 * ms_torch + 1e-4
    state_torch, state_zero, sent_torch, sent_zero, formula = (
        [int(r[k].replace(",", "")) for r in rows] for k in range(-5, 0))
    # the formula, plus the squared norm for clipping (stages 1, 2: 2 x 1/2 x 4 bytes) and the
    # per-step check that ranks agree (2 x 1/2 x 16 bytes)
    for stage in range(3):
        assert sent_zero[stage] - formula[stage] == (0 if stage == 0 else 4) + 16
    check = next(line for line in out.splitlines() if line.startswith("per-step check"))
    assert re.search(r"all_reduce\): \d+\.\d+ ms, \d+\.\d% of the tiny model's stage-0 step", check)
    assert sent_zero[3] < formula[3]  # stage 3 gathers its root unit once per step, not twice
    assert state_zero[3] <= state_torch[3]
    assert "zero.reduce_scatter" in out.splitlines()[-1]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"N{w}")
def fsdp_ranks(request, ran):
    return request.param, ran(fsdp_scenarios, request.param)


@pytest.mark.parametrize("stage", STAGES)
def test_pytorch_counterpart_trains_like_zero(fsdp_ranks, stage):
    world, results = fsdp_ranks
    for res in results:
        theirs, ours = res[stage]["theirs"], res[stage]["ours"]
        assert len(ours["losses"]) == 3 and ours["losses"][-1] < ours["losses"][0]
        assert max(abs(a - b) for a, b in zip(theirs["losses"], ours["losses"])) <= 1e-5
        assert list(theirs["full"]) == list(ours["full"])
        for name, t in ours["full"].items():
            assert (theirs["full"][name] - t).abs().max().item() <= 1e-5, name


# On gloo with CPU tensors zero.py's reduce_scatter and all_gather run as all_to_all and
# broadcasts (zero.DIRECT): the dispatcher sees those calls, with the same bytes.
DIRECT_CALLS = {"reduce_scatter": "all_to_all", "all_gather": "broadcast"}


@pytest.mark.parametrize("stage", STAGES)
def test_dispatcher_count_agrees_with_zero_own_count(fsdp_ranks, stage):
    # fsdp_demo counts PyTorch's bytes at the dispatcher; on zero.py's run it must see exactly
    # what zero.py counted itself, or the side-by-side numbers are not measured the same way.
    world, results = fsdp_ranks
    ours = results[0][stage]["ours"]
    assert zero.DIRECT
    calls = {DIRECT_CALLS.get(k, k): v for k, v in ours["comm"].items()}
    assert ours["comm_seen"] == calls and sum(ours["comm"].values()) > 0


@needs_fsdp2
def test_pytorch_memory_and_communication(fsdp_ranks):
    world, results = fsdp_ranks
    res = results[0]
    psi = res[0]["ours"]["psi"]
    for stage in range(4):
        theirs = res[stage]["theirs"]
        assert theirs["psi"] == psi
        # FSDP2 (stages 2, 3) shards parameters between steps; DDP and ZeroRedundancyOptimizer don't
        assert theirs["mem"]["params"] == (4 * psi if stage < 2
                                           else pytest.approx(4 * psi / world, rel=0.02))
        # sharded from stage 1
        assert theirs["mem"]["optimizer"] < 8 * psi * (0.6 if stage else 1.01)
    # DDP all-reduces 2Ψ(N-1)/N x 4 bytes per step (no_sync() for the first micro-batch); FSDP2
    # with reshard_after_forward=True gathers twice and reduce-scatters once per micro-batch:
    # 3Ψ(N-1)/N x 4 bytes each
    ring = 4 * psi * (world - 1) / world
    assert res[0]["theirs"]["comm"]["all_reduce"] == pytest.approx(2 * ring, rel=0.01)
    assert sum(res[3]["theirs"]["comm"].values()) == pytest.approx(2 * 3 * ring, rel=0.02)


@needs_fsdp2
def test_fsdp_demo_compare_end_to_end(ran, shared):
    # fsdp_demo.py --compare --stage 3 at N = 4: PyTorch's FSDP2, then zero.py's stage 3,
    # side by side
    out = ran(fsdp_scenarios, 4)[0]["--compare"]
    assert "zero.py vs PyTorch, stage 3" in out and "largest parameter difference" in out
    diff = float(re.search(r"largest loss difference (\S+)", out).group(1))
    assert diff <= 1e-5
    # what FSDP2's bytes mean on gloo, said under its report and beside the comparison's bytes
    assert "its reduce_scatter_tensor, which FSDP2 calls, all-reduces the whole input" in out
    assert "on gloo FSDP2's reduce-scatters\n   send twice their ring cost" in out
    # and from a pretrained file (N = 2): the same losses on both sides, not those of fresh weights
    loaded = ran(fsdp_scenarios, 2)[0]["--init-from"]
    assert float(re.search(r"largest loss difference (\S+)", loaded).group(1)) <= 1e-5
    first = [float(x) for x in re.findall(r"^ +1 +(\d+\.\d+) +(\d+\.\d+)", loaded, re.M)[0]]
    # both sides' first loss is the file's model's own on that run's first global batch (2 ranks'
    # rows), and not a fresh model's
    a = zero.training_parser("").parse_args(SMALL)
    pretrained, fresh = (zero.GPT(a.seq_len, a.d_model, a.n_layer, a.n_head) for _ in range(2))
    pretrained.load_state_dict(torch.load(os.path.join(shared, "pretrained.pt"), weights_only=True))
    data = zero.demo_data()
    batches = [zero.get_batch(data, 1, 0, r, 2, a.batch_size, a.seq_len, a.seed) for r in range(2)]
    with torch.no_grad():
        want, other = (sum(F.cross_entropy(m(x).flatten(0, 1), y.flatten()).item()
                           for x, y in batches) / 2
                       for m in (pretrained, fresh))
    assert (first[0] == first[1]
            and abs(first[0] - want) < 1e-4 < 1e-2 < abs(want - other)), (first, want, other)


@needs_fsdp2
def test_fsdp_demo_bf16(ran):
    out = ran(fsdp_scenarios, 4)[0]["--bf16"]
    assert "bfloat16 compute" in out and len(losses(out)) == 3
    assert "--bf16: FSDP2's parameters are its fp32 shards" in out  # why its rows are not 2Ψ/N


def test_fsdp_demo_bad_input(ran, refused, monkeypatch):
    # end to end, once: fsdp_demo.py's own command line, one line on stderr and exit code 2
    code, out, err, message = refused["fsdp_demo.py"]
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"fsdp_demo.py: error: {message}") and "Traceback" not in err + out
    # and each bad input, as fsdp_demo.main raises it on every rank
    for answers in ran(fsdp_bad_input, 2):
        assert [args for args, _, _ in answers] == list(BAD_FSDP) + [
            name for name in BAD_INIT for _ in range(1 if OLD else 2)]
        for args, message, printed in answers:
            assert {**BAD_FSDP, **BAD_INIT}[args] in message and "\n" not in message and \
                printed == "", (args, message)
    # and PyTorch's FSDP2 on the CPU, where torch is too old for it (< 2.9): refused before a run
    monkeypatch.setattr(fsdp_demo, "NO_CPU_FSDP2", "too old")
    for argv in (["--stage", "2"], ["--bench"]):
        with pytest.raises(zero.UsageError, match=r"^too old: --stage 0 or 1 \(no --bench\)"):
            fsdp_demo.main([*argv, "--device", "cpu"])


@fsdp2_scenario(4)
def hybrid_pytorch(rank, world):
    # FSDP2 on a 2-D mesh (replicate x shard, HSDP), against zero.py's stage 3 in groups of 2
    import fsdp_demo
    args = zero.training_parser("").parse_args(SMALL + ["--stage", "3", "--shard-size", "2"])
    theirs, ours = fsdp_demo.compare(args, keep_params=True)
    # G = 1: HSDP's replicate group is every rank (the default group, in PyTorch's mesh)
    args.shard_size, args.steps = 1, 1
    with contextlib.redirect_stdout(io.StringIO()):
        one = zero.train(args, fsdp_demo.pytorch(args, world), quiet=True)
    return {"theirs": theirs, "ours": ours, "one": one["comm"]}


@needs_fsdp2
def test_hybrid_pytorch_counterpart_trains_like_zero(ran):
    for res in ran(hybrid_pytorch, 4):
        theirs, ours = res["theirs"], res["ours"]
        assert max(abs(a - b) for a, b in zip(theirs["losses"], ours["losses"])) <= 1e-5
        for name, t in ours["full"].items():
            assert (theirs["full"][name] - t).abs().max().item() <= 1e-5, name
        # sharded over G = 2, not N = 4: twice the 1/N memory, and bytes that cross groups
        assert ours["comm"]["all_reduce across groups"] > 0
        assert ours["mem"]["params"] > 0
        seen = {DIRECT_CALLS.get(k, k): v for k, v in ours["comm"].items()}
        assert ours["comm_seen"] == pytest.approx(seen)  # the dispatcher saw what zero.py counted
        across = "all_reduce across groups"  # and in PyTorch's run, HSDP's all-reduce of shards
        assert theirs["comm"][across] == pytest.approx(ours["comm"][across])
        assert res["one"][across] > 0 and not res["one"].get("all_reduce")  # labelled so at G = 1


# ----------------------------------------------------------------------------------------------
# Moving to FSDP and back: a zero.py checkpoint continues under FSDP2, an FSDP2 one (DCP) under
# zero.py, at another N and stage. The N = 4 ranks write one of each after step 1; the N = 2 ranks
# continue them and write theirs, which N = 4 ranks continue in a later launch.

MOVE = [*MODEL, "--lr", "5e-3", "--seed", "3"]  # the global batch: 8 rows at any N


def move_args(world, stage, steps, **kwargs):
    args = zero.training_parser("").parse_args([*MOVE, "--stage", str(stage), "--steps", str(steps),
                                                "--batch-size", str(8 // world)])
    return argparse.Namespace(**{**vars(args), "ckpt_every": None, **kwargs})


@fsdp2_scenario(4, 2)
def moving_write(rank, world):
    # N = 4: zero.py at stage 1 and FSDP2 at stage 3 (DCP) each write a checkpoint after step 1;
    # N = 2: zero.py at stage 0 and FSDP2 at stage 2
    import fsdp_demo
    tmp = os.environ["ZERO_TEST_TMP"]
    ours, theirs = (1, 3) if world == 4 else (0, 2)
    with contextlib.redirect_stdout(io.StringIO()):
        zero.train(move_args(world, ours, 1, ckpt_dir=os.path.join(tmp, f"zero{world}")),
                   quiet=True)
        zero.train(move_args(world, theirs, 1, ckpt_dir=os.path.join(tmp, f"fsdp{world}")),
                   fsdp_demo.pytorch(move_args(world, theirs, 1), world), quiet=True)
        if world == 4:  # HSDP (a 2-D mesh: 2 groups of 2) continues zero.py's stage-1 run, as does
            # zero.py's stage 3 in groups of 2. (Here, in the first launch of N = 4: a 2-D mesh
            # made again after a new process group, in a later launch, found a group of the old
            # one by name, in torch 2.13.)
            path = checkpoints.latest_checkpoint(os.path.join(tmp, "zero4"))
            theirs, ours = fsdp_demo.compare(move_args(world, 3, 3, resume_from=path, shard_size=2))
            return {"first": theirs["first"], "theirs": theirs["losses"], "ours": ours["losses"]}


@fsdp2_scenario(2, 4, reads=moving_write)
def moving(rank, world):
    """Each direction continued for 2 steps on both sides (fsdp_demo.compare: FSDP2, then zero.py
    at the same stage), and the state each side holds right after loading."""
    import fsdp_demo
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    tmp, other, out = os.environ["ZERO_TEST_TMP"], 6 - world, {}
    stage = 2 if world == 2 else 3
    for source in ("zero", "fsdp"):
        path = checkpoints.latest_checkpoint(os.path.join(tmp, f"{source}{other}"))
        args = move_args(world, stage, 3, resume_from=path)
        with contextlib.redirect_stdout(io.StringIO()):
            theirs, ours = fsdp_demo.compare(args)
        out[source] = {"first": theirs["first"], "theirs": theirs["losses"], "ours": ours["losses"]}
    # FSDP2 right after loading zero.py's checkpoint: every weight and Adam value, gathered whole
    args = move_args(world, stage, 1)
    with torch.device("meta"):
        model = zero.GPT(args.seq_len, args.d_model, args.n_layer, args.n_head)
    optimizer = fsdp_demo.parallelize(model, args, conftest.DEVICE)[1]
    fsdp_demo.Torch(model, optimizer, world).load_checkpoint(
        checkpoints.latest_checkpoint(os.path.join(tmp, f"zero{other}")))
    full = StateDictOptions(full_state_dict=True)
    state = get_optimizer_state_dict(model, optimizer, options=full)["state"]
    out["fsdp_loaded"] = {**{("master", n): t
                             for n, t in get_model_state_dict(model, options=full).items()},
                          **{(k, n): v for n, st in state.items() for k, v in st.items()}}
    # zero.py right after loading FSDP2's: saved again at once, for the test to read
    with torch.device("meta"):
        model = zero.GPT(args.seq_len, args.d_model, args.n_layer, args.n_head)
    opt = zero.zero_build(move_args(world, 1, 1))(model, conftest.DEVICE)[1]
    found = checkpoints.latest_checkpoint(os.path.join(tmp, f"fsdp{other}"))
    checkpoints.load_checkpoint(opt, found)
    checkpoints.save_checkpoint(opt, os.path.join(tmp, f"resaved{world}"), 1)
    return out


@pytest.fixture(scope="module")
def moved(ran):
    return {2: ran(moving, 2)[0], 4: ran(moving, 4)[0], "hsdp": ran(moving_write, 4)[0]}


@needs_fsdp2
@pytest.mark.parametrize("world", [2, 4])
def test_a_run_moves_between_zero_and_fsdp2_with_the_same_losses(moved, world):
    # zero.py's checkpoint of the other N (stage 1 at N = 4, stage 0 at N = 2) continued by FSDP2
    # (stage 2 at N = 2, stage 3 at N = 4; and stage 3 with HSDP, 2 groups of 2, from zero.py's
    # N = 4) and by zero.py at that stage; FSDP2's (DCP,
    # stage 3 at N = 4, stage 2 at N = 2) continued by FSDP2 and by zero.py at that stage: steps
    # 2 and 3, the same losses on both sides, to rounding.
    res = moved[world]
    for source in ("zero", "fsdp"):
        r = res[source]
        assert r["first"] == 2 and len(r["theirs"]) == len(r["ours"]) == 2
        assert max(abs(a - b) for a, b in zip(r["theirs"], r["ours"])) <= 1e-5, (source, r)
    assert res["zero"]["theirs"][-1] < 5.5  # trained weights, not fresh ones (ln 256 = 5.55)
    hsdp = moved["hsdp"]
    assert (hsdp["first"] == 2
            and max(abs(a - b) for a, b in zip(hsdp["theirs"], hsdp["ours"])) <= 1e-5)


@needs_fsdp2
def test_moving_refuses_bad_input_in_one_line(ran, shared, one_rank, tmp_path):
    # --resume-from, on either side: one line (zero.run: exit code 2), nothing trained, nothing
    # written in --ckpt-dir, the source as it was
    import fsdp_demo
    ran(moving_write, 4)  # its checkpoints
    dcp_dir, zero_dir = (checkpoints.latest_checkpoint(os.path.join(shared, name))
                         for name in ("fsdp4", "zero4"))
    for bad in ("torn", "truncated"):
        shutil.copytree(dcp_dir, tmp_path / bad)
    os.remove(tmp_path / "torn" / checkpoints.DCP_MARKER)
    os.truncate(tmp_path / "truncated" / "__1_0.distcp", 100)
    (tmp_path / "neither").mkdir()
    (tmp_path / "neither" / "notes.txt").write_text("not a checkpoint")
    with contextlib.redirect_stdout(io.StringIO()):
        # weights only
        zero.main(["--consolidate", zero_dir, "--out", str(tmp_path / "weights.dcp")])
    before = sorted(os.listdir(dcp_dir))
    cases = [(zero.main, ["--resume-from", str(tmp_path / "neither")], "not a checkpoint"),
             (zero.main, ["--d-model", "32", "--resume-from", dcp_dir],
              "another model: tensor 'wte.weight' is [256, 16] there, [256, 32] here"),
             (fsdp_demo.main, ["--stage", "2", "--n-layer", "1", "--resume-from", zero_dir],
              "another model: tensor 'blocks.1."),
             (zero.main, ["--resume-from", str(tmp_path / "weights.dcp")],
              "no optimizer state: --init-from its dcp_to_torch_save .pt"),
             (zero.main, ["--resume-from", str(tmp_path / "torn")],
              "complete.json: missing: the DCP checkpoint is torn"),
             (zero.main, ["--resume-from", str(tmp_path / "truncated")], "__1_0.distcp: 100 bytes")]
    for i, (main, args, message) in enumerate(cases):
        ckpt = tmp_path / f"ckpt{i}"
        error, printed = main_refused(main, [*MOVE, "--steps", "3", "--ckpt-dir", str(ckpt), *args])
        assert error and message in error and "\n" not in error, (args, error)
        assert "step    2 |" not in printed and os.listdir(ckpt) == []
    assert sorted(os.listdir(dcp_dir)) == before
    for argv in ([], ["--compare"]):  # a checkpoint at --steps already: one line, no report
        with contextlib.redirect_stdout(io.StringIO()) as out:
            fsdp_demo.main([*MOVE, "--stage", "2", "--steps", "1", "--resume-from", dcp_dir, *argv])
        assert "nothing left to train" in out.getvalue() and "model state" not in out.getvalue()


def dcp_full(path):
    """{(key, parameter name): full tensor} of a DCP checkpoint, read by torch's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, os.path.join(tmp, "all.pt"))
        state = torch.load(os.path.join(tmp, "all.pt"), weights_only=False)
    full = {(k, n): v for n, st in state["optimizer"]["state"].items() for k, v in st.items()}
    return {**full, **{("master", n): state["model"][n] for (_, n) in full}}


@needs_fsdp2
@pytest.mark.parametrize("world", [2, 4])
def test_moving_keeps_every_weight_and_adam_value(moved, shared, world):
    # Element by element, right after the conversion: FSDP2's weights, m, v and step count are
    # those of zero.py's checkpoint; zero.py's, saved again at once, those of FSDP2's DCP.
    other = 6 - world
    want = full_checkpoint(checkpoints.latest_checkpoint(os.path.join(shared, f"zero{other}")))
    got = moved[world]["fsdp_loaded"]
    assert ({k for k in want if k != "scalars"} | {("step", n) for n in want["scalars"]}
            == set(got) - {("master", "head.weight")})
    for key in want:
        if key != "scalars":
            assert torch.equal(got[key], want[key]), key
    assert all(float(got["step", n]) == float(s["step"]) == 1.0 for n, s in want["scalars"].items())
    want = dcp_full(checkpoints.latest_checkpoint(os.path.join(shared, f"fsdp{other}")))
    got = full_checkpoint(os.path.join(shared, f"resaved{world}", "step_00000001"))
    assert {k for k in want if k[0] != "step"} == {k for k in got if k != "scalars"}
    for key in got:
        if key != "scalars":
            assert torch.equal(got[key], want[key]), key
    assert ({n: float(s["step"]) for n, s in got["scalars"].items()}
            == {n: float(want["step", n]) for (k, n) in want if k == "step"})
