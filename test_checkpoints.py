"""Tests for checkpoints.py: a checkpoint written by N ranks at one stage is read by M ranks at
another, exactly; the files are atomic, rotated, one job per directory, and checked before
anything changes; --consolidate writes one plain state_dict in the format its name asks for.
The multi-rank scenarios run on conftest.py's pool; the tests right after each read its results.

What the README claims of checkpoints, and the tests that check it:

- Resume is exact: test_resume_from_state_dict_is_exact (and torch's convention,
  opt.load_state_dict(opt.state_dict()) on the same ranks), test_a_killed_rank_restarts_and_
  resumes_exactly, test_a_model_in_two_dtypes_resumes_exactly (float64 masters),
  test_checkpoints_with_bf16_compute_and_without_optimizer_state,
  test_parameters_stepped_apart_checkpoint_exactly (parameters without a gradient in some steps).
- Resharding (a checkpoint of N ranks at one stage loads at M ranks at another, with hybrid
  sharding too): test_reshard_keeps_every_parameter_and_optimizer_value,
  test_reshard_trains_on_as_if_nothing_changed,
  test_hybrid_checkpoints_load_at_any_shard_size_stage_and_world.
- Consolidation, one format per --out: test_consolidate_and_init_from (torch.load, safetensors'
  load_file, DCP's dcp_to_torch_save), test_cli_runs_as_one_process_without_torchrun.
- Refused in one line before anything changes: test_bad_checkpoints_are_refused_before_anything_
  changes, test_checkpoint_errors_are_one_line, test_the_manifest_is_data.
- Under abuse: test_a_job_on_a_directory_in_use_is_refused_and_a_dead_jobs_lock_is_not,
  test_rank_0_chooses_the_checkpoint_and_a_full_disk_fails_every_rank,
  test_nonfinite_steps_are_never_applied_nor_saved, test_resume_applies_the_command_lines_lr,
  test_resume_notes_other_data_under_the_same_name,
  test_rotation_keeps_the_new_checkpoint_and_only_reads_exact_names,
  test_a_failed_manifest_write_leaves_the_previous_checkpoint,
  test_overwriting_a_checkpoint_of_the_same_step_is_atomic,
  test_a_dcp_checkpoint_saved_again_takes_its_name_in_one_step.

No assertion depends on how fast anything runs: the killed rank kills itself right after a
given checkpoint, not from outside at whatever step it has reached.
"""
import argparse
import contextlib
import functools
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import checkpoints
import zero
from conftest import (B, CASES, CKPT, CUDA_RUNS, D, EARLY, SMALL, TINY, Early, Net,
                      assert_trains_like, full_checkpoint, launcher_script, losses, main_printed,
                      main_refused, run_id, run_py, run_steps, scenario, wrapped)
from test_zero import (TASKS_OPTIMIZER, Tasks, TwoDtypes, tasks_reference, tasks_steps,
                       two_dtypes_steps)

RUNS = [("cpu", 1), ("cpu", 2), ("cpu", 4), *CUDA_RUNS]
STEPS = 3  # a resume: 1 step, a checkpoint, 2 more, against 3 straight

# ----------------------------------------------------------------------------------------------
# torch's convention, opt.load_state_dict(opt.state_dict()), and a checkpoint on disk, on the same
# ranks: exact

@scenario(1, 2, 4, cuda=(1, 2, 4))
def resumed(rank, world):
    out, rows = {}, slice(rank * B, (rank + 1) * B)  # this rank's rows of every global batch
    for stage in range(4):
        model, opt = wrapped(rank, stage, "adamw", seed=100)  # 3 steps straight
        run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, world, STEPS)
        straight = opt.full_state_dict()
        # Resume: 1 step, a checkpoint on disk, a fresh model with other weights loads it, 2 more
        # steps; against the uninterrupted 3 steps.
        root = os.path.join(os.environ["ZERO_TEST_TMP"], f"resume-N{world}-{stage}")
        model, opt = wrapped(rank, stage, "adamw", seed=100)
        run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, world, 1)
        checkpoints.save_checkpoint(opt, root, 1)
        # torch's convention on the same ranks: opt.load_state_dict(opt.state_dict()) undoes a step
        own = opt.state_dict()
        run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, world, 1, start=1)
        moved = opt.full_state_dict()
        opt.load_state_dict(own)
        run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, world, STEPS - 1, start=1)
        own_resumed = opt.full_state_dict()
        try:  # another rank's part (given to the last rank only: every rank refuses), or stage's
            opt.load_state_dict(dict(own, rank=0) if world > 1 and rank == world - 1 else own
                                if world > 1
                                else dict(own, layout=dict(own["layout"], stage=stage - 1)))
            refused = None
        except checkpoints.CheckpointError as e:
            refused = str(e)
        # the last rank's without exp_avg_sq: a gather of other tensors (gloo aborted), refused
        edited = dict(own, units=[dict(u, state={"exp_avg": u["state"]["exp_avg"]})
                                  for u in own["units"]]) if rank == world - 1 else own
        try:
            opt.load_state_dict(edited)
            disagree = None
        except ValueError as e:
            disagree = str(e)
        model, opt = wrapped(rank, stage, "adamw", seed=500)
        checkpoints.load_checkpoint(opt, checkpoints.latest_checkpoint(root))
        run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, world, STEPS - 1, start=1)
        out[(stage, "resume")] = {"straight": straight,
                                  "resumed": opt.full_state_dict(), "own": own_resumed,
                                  "moved": moved, "refused": refused, "disagree": disagree}

    return out


@pytest.mark.parametrize("run", RUNS, ids=run_id)
@pytest.mark.parametrize("stage", range(4))
def test_resume_from_state_dict_is_exact(ran, run, stage):
    results, cuda = ran(resumed, run[1], run[0]), run[0] != "cpu"
    for res in results:
        r = res[(stage, "resume")]
        # bit for bit (on a GPU: see there)
        assert_trains_like(r["resumed"], r["straight"], cuda, tol=0)
        # opt.load_state_dict(opt.state_dict())
        assert_trains_like(r["own"], r["straight"], cuda, tol=0)
        assert any(not torch.equal(t, r["moved"][n]) for n, t in r["straight"].items()
                   if "frozen" not in n)
        assert r["refused"] and "load_checkpoint" in r["refused"]
        assert (r["disagree"] or "").startswith("zero: load_state_dict(): ranks disagree: rank 0 "
                                                "has unit 0's optimizer states") == (
            run[1] > 1 and stage == 0)  # (from stage 1 a rank's part may lack them: below)


class UsedThenUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(D, D), nn.Linear(D, 8 * D)

    def forward(self, x):
        return self.used(x)


@scenario(2)
def unstepped_shard(rank, world):
    # One unit, its second rank's shard all of a parameter never used, so never stepped: that
    # rank's state_dict holds no optimizer state, rank 0's does (refused as ranks disagreeing)
    out = {}
    for stage in range(4):
        torch.manual_seed(0)
        model = UsedThenUnused()
        opt = zero.wrap(model, stage, functools.partial(torch.optim.AdamW, lr=0.1), units=[])
        saved = []  # (state_dict, full parameters) after the first step
        for step in range(2):
            model(torch.randn(B, D)).sum().backward()
            opt.step()
            opt.zero_grad()
            saved += [(opt.state_dict(), opt.full_state_dict())] * (step == 0)
        (own, saved), = saved
        opt.load_state_dict(own)
        out[stage] = {"saved": saved, "loaded": opt.full_state_dict(),
                      "state": [list(u["state"]) for u in own["units"]]}
    return out


def test_a_round_trip_where_a_rank_stepped_nothing_is_exact(ran):
    for rank, res in enumerate(ran(unstepped_shard, 2)):
        for stage, r in res.items():
            assert_trains_like(r["loaded"], r["saved"], tol=0)
            assert r["state"] == [[] if stage and rank else ["exp_avg", "exp_avg_sq"]], stage


@scenario(2)
def stepped_apart(rank, world):
    rows = slice(rank * B, (rank + 1) * B)
    # Checkpoints when parameters were stepped different numbers of times: after step 0 (aux and
    # rare never stepped: no optimizer state) at stage 3, loaded at stage 1, steps 1 and 2, saved
    # (aux stepped once, rare and first.weight twice, the rest three times), loaded at stage 0,
    # step 3: as the uninterrupted runs.
    root = os.path.join(os.environ["ZERO_TEST_TMP"], "tasks")
    model = Tasks()
    opt = zero.wrap(model, 3, TASKS_OPTIMIZER, units=[*model.blocks, model.head, model.aux])
    tasks_steps(model, opt, rows, world, range(1))
    checkpoints.save_checkpoint(opt, root, 1)
    for stage, steps in [(1, range(1, 3)), (0, range(3, 4))]:
        model = Tasks(seed=500 + rank)  # other weights, on each rank
        opt = zero.wrap(model, stage, TASKS_OPTIMIZER, units=[*model.blocks, model.head, model.aux])
        checkpoints.load_checkpoint(opt, checkpoints.latest_checkpoint(root))
        tasks_steps(model, opt, rows, world, steps)
        if stage == 1:
            checkpoints.save_checkpoint(opt, root, 3)
    return opt.full_state_dict()


def test_parameters_stepped_apart_checkpoint_exactly(ran, shared):
    # Stage 3 -> stage 1 -> stage 0, where parameters have no optimizer state (step 1: aux and
    # rare never got a gradient) or another step count than the rest (step 3): each parameter's
    # is saved by name, and the run goes on as the uninterrupted one.
    for res in ran(stepped_apart, 2):
        for name, t in tasks_reference(2).items():
            assert (res[name] - t).abs().max().item() <= 1e-5, name
    steps = lambda ckpt: {n: int(s["step"]) for n, s in
                          full_checkpoint(os.path.join(shared, "tasks", ckpt))["scalars"].items()}
    names = set(tasks_reference(2))
    assert steps("step_00000001") == {n: 1 for n in names if not n.startswith(("aux", "rare"))}
    fewer = {"aux.weight": 1, "aux.bias": 1, "rare.weight": 2, "rare.bias": 2, "first.weight": 2}
    assert steps("step_00000003") == {n: fewer.get(n, 3) for n in names}
    state = full_checkpoint(os.path.join(shared, "tasks", "step_00000001"))
    # no state: zeros
    assert all(state[key, "aux.weight"].abs().sum() == 0 for key in ("exp_avg", "exp_avg_sq"))


@scenario(3)
def two_dtypes_resumed(rank, world):
    # A model in two dtypes, bucketed (one bucket per dtype), resumed from a checkpoint after
    # step 1: the same bits, float64 masters included
    out, rows = {}, slice(rank * B, (rank + 1) * B)
    for stage in range(3):
        root = os.path.join(os.environ["ZERO_TEST_TMP"], f"two-dtypes-N{world}-{stage}")
        runs = []
        for steps in (range(2), range(1), range(1, 2)):  # straight; to the checkpoint; from it
            model = TwoDtypes()
            opt = zero.wrap(model, stage, functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
                            bucket_bytes=1 << 20)
            if steps.start == 1:
                checkpoints.load_checkpoint(opt, checkpoints.latest_checkpoint(root))
            two_dtypes_steps(model, opt, rows, world, steps)
            if steps.stop == 1:
                checkpoints.save_checkpoint(opt, root, 1)
            runs.append(opt.full_state_dict())
        out[stage] = (runs[0], runs[2])
    return out


def test_a_model_in_two_dtypes_resumes_exactly(ran, shared, tmp_path):
    for res in ran(two_dtypes_resumed, 3):
        for stage in range(3):
            straight, resumed = res[stage]
            assert (straight["a.weight"].dtype == torch.float64
                    and straight["b.weight"].dtype == torch.float32)
            assert all(torch.equal(straight[n], resumed[n]) for n in straight), stage
    # --consolidate says which masters it wrote
    printed = main_printed(zero.main, ["--consolidate", os.path.join(shared, "two-dtypes-N3-0"),
                                       "--out", str(tmp_path / "two.pt")])
    assert printed.rstrip().endswith("rank(s), fp64 master weights)"), printed


@scenario(4, cuda=(4,))
def hybrid_checkpoints(rank, world):
    out, rows, G = {}, slice(rank * B, (rank + 1) * B), 2
    # Checkpoints: written with G = 2 at stage 3, read with G = 4 at stage 1 and with G = 1 at
    # stage 2, trained on: as 4 uninterrupted steps. And load_state_dict(state_dict()) at G = 2.
    root = os.path.join(os.environ["ZERO_TEST_TMP"], "hybrid")
    case = "adamw"
    model, opt = wrapped(rank, 3, case, seed=100, shard_size=G)
    run_steps(model, opt, opt.clip_grad_norm_, CASES[case], rows, world, 4)
    out["straight"] = opt.full_state_dict()
    model, opt = wrapped(rank, 3, case, seed=100, shard_size=G)
    run_steps(model, opt, opt.clip_grad_norm_, CASES[case], rows, world, 2)
    checkpoints.save_checkpoint(opt, root, 2)
    out["saved"] = opt.full_state_dict()
    out["files"] = sorted(os.listdir(checkpoints.latest_checkpoint(root)))
    for name, stage, shard_size in [("G4", 1, None), ("G1", 2, 1)]:
        model, opt = wrapped(rank, stage, case, seed=500, shard_size=shard_size)
        checkpoints.load_checkpoint(opt, checkpoints.latest_checkpoint(root))
        out[name + " loaded"] = opt.full_state_dict()
        run_steps(model, opt, opt.clip_grad_norm_, CASES[case], rows, world, 2, start=2)
        out[name] = opt.full_state_dict()
    model, opt = wrapped(rank, 2, case, seed=100, shard_size=G)
    run_steps(model, opt, opt.clip_grad_norm_, CASES[case], rows, world, 2)
    own = opt.state_dict()
    run_steps(model, opt, opt.clip_grad_norm_, CASES[case], rows, world, 1, start=2)
    opt.load_state_dict(own)
    run_steps(model, opt, opt.clip_grad_norm_, CASES[case], rows, world, 2, start=2)
    out["own"] = opt.full_state_dict()
    return out


@pytest.mark.parametrize("transport", ["cpu", "cuda-gloo", "cuda-nccl"])
def test_hybrid_checkpoints_load_at_any_shard_size_stage_and_world(ran, transport):
    for res in ran(hybrid_checkpoints, 4, transport):
        assert res["files"] == ["manifest.json"] + [f"rank_{r:05d}.pt" for r in range(4)]
        cuda = transport != "cpu"
        assert_trains_like(res["own"], res["straight"], cuda, tol=0)  # the same G and stage: exact
        for name in ("G4", "G1"):  # every value loaded exactly; trained on at another G and stage
            assert_trains_like(res[name + " loaded"], res["saved"], tol=0, what=name)
            assert_trains_like(res[name], res["straight"], cuda, what=name)  # rounding


# ----------------------------------------------------------------------------------------------
# Resharding: written by N ranks at one stage, read by M ranks at another

ROWS = 12  # global rows per micro-batch in the resharding runs, split evenly over 2 or 4 ranks


def train_rows(model, opt, rank, world, steps, start):
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, ROWS // B, steps, start=start)


@scenario(4)
def reshard_write(rank, world):
    # N = 4, stage 3, the optimizer handed pieces of 7 elements: 2 steps, checkpoint, 2 more steps.
    zero.PIECE = {"cpu": 7, "cuda": 7}
    model, opt = wrapped(rank, 3, "adamw", seed=100)
    train_rows(model, opt, rank, world, 2, 0)
    checkpoints.save_checkpoint(opt, os.path.join(os.environ["ZERO_TEST_TMP"], "a"), 2,
                                extra={"note": "from N=4"})
    train_rows(model, opt, rank, world, 2, 2)
    return opt.full_state_dict()


def _load_fresh(rank, stage, path, **kwargs):
    # other weights on each rank
    model, opt = wrapped(rank, stage, "adamw", seed=500 + rank, **kwargs)
    manifest = checkpoints.load_checkpoint(opt, path)
    return model, opt, manifest


@scenario(2, 4, reads=reshard_write, chain=True)
def reshard_read(rank, world):
    # Load the N = 4 stage-3 checkpoint at this world size into every stage (pieces of 5), write it
    # again at once, then train on. Then the checkpoints that must be refused.
    tmp, out = os.environ["ZERO_TEST_TMP"], {}
    if world == 2:
        if rank == 0:
            damage_copies(tmp)  # copies of the N = 4 checkpoint, each damaged one way
        dist.barrier()
    zero.PIECE = {"cpu": 5, "cuda": 5}
    source = os.path.join(tmp, "a" if world == 2 else "b1", "step_00000002")
    for stage in range(4):
        model, opt, manifest = _load_fresh(rank, stage, source)
        checkpoints.save_checkpoint(
            opt, os.path.join(tmp, f"{'b' if world == 2 else 'c'}{stage}"), 2)
        train_rows(model, opt, rank, world, 2, 2)
        out[stage] = {"full": opt.full_state_dict(), "extra": manifest["extra"]}
    if world == 2:
        # bf16 compute, fp32 masters: loading and saving again keeps every fp32 value
        model, opt, _ = _load_fresh(rank, 2, source, param_dtype=torch.bfloat16)
        checkpoints.save_checkpoint(opt, os.path.join(tmp, "bf16"), 2)
        # an optimizer without state (plain SGD): a round trip at stage 3 is exact
        plain = functools.partial(torch.optim.SGD, lr=0.1)
        model = Net(seed=100)
        opt = zero.wrap(model, 3, plain)
        train_rows(model, opt, rank, world, 1, 0)
        checkpoints.save_checkpoint(opt, os.path.join(tmp, "sgd"), 1)
        fresh = zero.wrap(Net(seed=7), 3, plain)
        checkpoints.load_checkpoint(fresh, checkpoints.latest_checkpoint(os.path.join(tmp, "sgd")))
        out["sgd"] = (opt.full_state_dict(), fresh.full_state_dict())
        out["refused"] = {}
        for bad in ["corrupt", "truncated", "missing", "incomplete"]:
            model, opt = wrapped(rank, 2, "adamw", seed=100)
            before = opt.full_state_dict()
            try:
                checkpoints.load_checkpoint(opt, os.path.join(tmp, bad, "step_00000002"))
                out["refused"][bad] = None
            except checkpoints.CheckpointError as e:
                out["refused"][bad] = str(e)
            after = opt.full_state_dict()
            out.setdefault("unchanged", []).append(all(torch.equal(before[n], after[n])
                                                       for n in before))
        others = {"another model": lambda: zero.wrap(nn.Sequential(nn.Linear(4, 4)), 2,
                                                     CASES["adamw"]["optimizer"]),
                  "another optimizer": lambda: wrapped(rank, 2, "sgd", seed=100)[1]}
        for what, build in others.items():
            try:
                checkpoints.load_checkpoint(build(), source)
                out["refused"][what] = None
            except checkpoints.CheckpointError as e:
                out["refused"][what] = str(e)
    return out


def damage_copies(tmp):
    """Copies of the N = 4 checkpoint "a", each damaged one way, for reshard_read to refuse."""
    step = os.path.join(tmp, "a", "step_00000002")
    for bad in ["corrupt", "truncated", "missing", "incomplete"]:
        shutil.copytree(step, os.path.join(tmp, bad, "step_00000002"))
    damaged = lambda bad, r=2: os.path.join(tmp, bad, "step_00000002", f"rank_0000{r}.pt")
    data = bytearray(open(damaged("corrupt"), "rb").read())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, in the middle of a tensor's data
    open(damaged("corrupt"), "wb").write(data)
    os.truncate(damaged("truncated", 3), os.path.getsize(damaged("truncated", 3)) - 100)
    os.remove(damaged("missing", 1))
    os.remove(os.path.join(tmp, "incomplete", "step_00000002", "manifest.json"))


@pytest.fixture(scope="module")
def resharded(ran, shared):
    two, two_rank1 = ran(reshard_read, 2)
    four = ran(reshard_read, 4)[0]
    states = {name: full_checkpoint(os.path.join(shared, name, "step_00000002"))
              for name in ["a", "bf16"] + [f"{x}{s}" for x in "bc" for s in range(4)]}
    return {"straight": ran(reshard_write, 4)[0], "two": two, "four": four, "states": states,
            "two_rank1": two_rank1}


@pytest.mark.parametrize("stage", range(4))
def test_reshard_keeps_every_parameter_and_optimizer_value(resharded, stage):
    # N = 4 stage 3 -> N = 2 at this stage (b), and N = 2 stage 1 -> N = 4 at this stage (c):
    # every master weight and every Adam m and v, element by element, and the step count.
    want = resharded["states"]["a"]
    for name in [f"b{stage}", f"c{stage}"]:
        got = resharded["states"][name]
        assert set(got) == set(want)
        assert {k[0] for k in want if k != "scalars"} == {"master", "exp_avg", "exp_avg_sq"}
        for key in want:
            if key == "scalars":  # each of the 12 trainable parameters stepped twice
                floats = lambda scalars: {n: {k: float(v) for k, v in s.items()}
                                          for n, s in scalars.items()}
                assert (floats(got[key]) == floats(want[key])
                        == {n: {"step": 2.0} for n in want[key]})
                assert len(want[key]) == 12
            else:
                assert torch.equal(got[key], want[key]), (name, key)


@pytest.mark.parametrize("stage", range(4))
def test_reshard_trains_on_as_if_nothing_changed(resharded, stage):
    # 2 more steps after loading match the uninterrupted N = 4 run, to float rounding (the sums
    # of the reductions run in another order at another N).
    want = resharded["straight"]
    initial = {n: p.detach() for n, p in Net(seed=100).named_parameters()}
    for run in ("two", "four"):
        got = resharded[run][stage]["full"]
        assert list(got) == list(want)
        for name in want:
            assert (got[name] - want[name]).abs().max().item() <= 1e-5, (run, name)
    assert max((want[n] - initial[n]).abs().max().item() for n in want) > 1e-2
    assert resharded["two"][stage]["extra"] == {"note": "from N=4"}


def test_checkpoints_with_bf16_compute_and_without_optimizer_state(resharded):
    want, got = resharded["states"]["a"], resharded["states"]["bf16"]
    assert set(got) == set(want) and all(torch.equal(got[k], want[k])
                                         for k in want if k != "scalars")
    before, after = resharded["two"]["sgd"]
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_bad_checkpoints_are_refused_before_anything_changes(resharded):
    refused = resharded["two"]["refused"]
    assert "corrupt" in refused["corrupt"] and "rank_00002.pt" in refused["corrupt"]
    assert "truncated" in refused["truncated"] and "rank_00003.pt" in refused["truncated"]
    # the same message on both ranks, whichever found it
    assert resharded["two_rank1"]["refused"] == refused
    assert "missing" in refused["missing"] and "rank_00001.pt" in refused["missing"]
    assert "no manifest.json" in refused["incomplete"]
    assert "another model" in refused["another model"] and "'0.weight'" in refused["another model"]
    assert "AdamW" in refused["another optimizer"] and "SGD" in refused["another optimizer"]
    assert all(msg.count("\n") == 0 for msg in refused.values())
    assert resharded["two"]["unchanged"] == [True] * 4


# ----------------------------------------------------------------------------------------------
# The command line's checkpoints: a rank killed and restarted, consolidation, errors

KILLED_STEPS = 12  # a checkpoint every 4 steps: rank 1 dies after the first, at step 4


@scenario(2)
def straight(rank, world):
    """The uninterrupted run that the killed and restarted one must equal: zero.main at N = 2 with
    the same arguments. Its checkpoint also serves the consolidation and checkpoint-error tests."""
    ckpt = os.path.join(os.environ["ZERO_TEST_TMP"], "straight")
    return main_printed(zero.main, [*CKPT, "--steps", str(KILLED_STEPS), "--ckpt-dir", ckpt])


KILLER = """
import checkpoints
save = checkpoints.save_checkpoint


def save_then_die(opt, root, step, **kwargs):
    save(opt, root, step, **kwargs)  # returns once the checkpoint is complete, on every rank
    if (step == 4 and os.environ["RANK"] == "1"
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        os.kill(os.getpid(), signal.SIGKILL)


checkpoints.save_checkpoint = save_then_die
zero.run(zero.main)
"""


# (Before zero.setup prefixed the store's keys by the restart attempt, the restarted ranks here
# read the dead ranks' addresses and waited for ever: see zero._attempt_store.)
KILLED_CKPT = os.path.join(EARLY, "killed")
KILLED = Early(*CKPT, "--steps", str(KILLED_STEPS), "--ckpt-every", "4", "--ckpt-dir", KILLED_CKPT,
               script=launcher_script(os.path.join(EARLY, "killed.py"), KILLER), torchrun=2,
               torchrun_args=["--max-restarts=1"])


def test_a_killed_rank_restarts_and_resumes_exactly(ran, shared):
    # torchrun --max-restarts=1: rank 1 is SIGKILLed once the checkpoint of step 4 is complete;
    # torchrun restarts the group, which resumes from that checkpoint. The final weights and Adam
    # state equal an uninterrupted run's, bit for bit. The rank kills itself (KILLER, a launcher
    # of zero.main), always right after that checkpoint: killed from outside when the checkpoint
    # shows up, how many more steps it had trained by then would be a matter of timing.
    out, ckpt = KILLED.result(), KILLED_CKPT
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = re.findall(r"^resumed from .*step_(\d+): step (\d+)", out.stdout, re.M)
    assert resumed == [("00000004", "4")], out.stdout[-2000:]
    # steps 1-4 before the kill, 5-12 after the restart: none trained twice, none skipped
    assert (re.findall(r"^step +(\d+) \|", out.stdout, re.M)
            == [str(s) for s in range(1, KILLED_STEPS + 1)])
    assert losses(out.stdout)[-1] == losses(ran(straight, 2)[0])[-1]
    a, b = (full_checkpoint(checkpoints.latest_checkpoint(path))
            for path in (ckpt, os.path.join(shared, "straight")))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a if k != "scalars")
    assert (a["scalars"] == b["scalars"]
            and {k[0] for k in a if k != "scalars"} == {"master", "exp_avg", "exp_avg_sq"})
    assert sorted(os.listdir(ckpt)) == ["step_00000008", "step_00000012"]  # the newest two are kept


@pytest.fixture(scope="module")
def one_process(ran, shared, tmp_path_factory):
    # The N = 2 stage-2 checkpoint of the straight run -> one plain state_dict (--consolidate, as
    # zero.main runs it: no process group), in each format its --out names, then `python zero.py
    # --init-from` the .pt: one process, no torchrun, a stage-3 run at N = 1.
    ran(straight, 2)  # its checkpoint
    out = tmp_path_factory.mktemp("one")
    printed = [main_printed(zero.main, ["--consolidate", os.path.join(shared, "straight"), "--out",
                                        str(out / name)])
               for name in ("model.pt", "model.safetensors", "model.dcp")]
    model_file = str(out / "model.pt")
    return printed, str(out), run_py("--stage", "3", *SMALL, "--init-from", model_file)


def test_cli_runs_as_one_process_without_torchrun(one_process):
    out = one_process[2]
    assert out.returncode == 0, out.stderr[-3000:]
    assert "world size       | 1 (gloo" in out.stdout and len(losses(out.stdout)) == 3


def test_consolidate_and_init_from(one_process):
    # The consolidated state_dict is one that the unwrapped model loads; the --init-from run's
    # first loss is that model's own. Each --out is one file (or DCP directory) of the format
    # its name asks for, read by that format's own loader, and nothing else is written.
    printed, folder, out = one_process
    assert all(f"step {KILLED_STEPS} (written at stage 2 by 2 rank(s)" in p for p in printed)
    assert [p.split(" (")[1].split(")")[0] for p in printed] == ["pt", "safetensors", "dcp"]
    assert sorted(os.listdir(folder)) == ["model.dcp", "model.pt", "model.safetensors"]
    # (safetensors' save_file makes its file of mode 0600: it is given a new file's, as the .pt)
    assert len({os.stat(os.path.join(folder, f)).st_mode
                for f in ("model.pt", "model.safetensors")}) == 1
    model_file = os.path.join(folder, "model.pt")
    state = torch.load(model_file, weights_only=True)
    a = zero.training_parser("").parse_args(SMALL)  # MODEL, and the batch of the --init-from run
    model = zero.GPT(a.seq_len, a.d_model, a.n_layer, a.n_head)
    model.load_state_dict(state)  # strict: every key of the model, nothing else
    # tied: one tensor under both keys, as the model's state_dict() has it (written once)
    assert state["head.weight"].data_ptr() == state["wte.weight"].data_ptr()
    # no parts
    assert os.path.getsize(model_file) < 4 * 1.2 * sum(t.numel() for t in state.values())
    torch.manual_seed(a.seed)  # the weights a run starts from without --init-from
    untrained = zero.GPT(a.seq_len, a.d_model, a.n_layer, a.n_head)
    data = zero.demo_data()
    x, y = zero.get_batch(data, 1, 0, 0, 1, a.batch_size, a.seq_len, a.seed)
    with torch.no_grad():
        want, fresh = (F.cross_entropy(m(x).flatten(0, 1), y.flatten()).item()
                       for m in (model, untrained))
    assert out.returncode == 0, out.stderr[-3000:]
    # trained weights, not a fresh model
    assert abs(losses(out.stdout)[0] - want) < 1e-5 and want < fresh - 0.1
    # the same tensors, under the same keys, as safetensors' own loader and torch's DCP converter
    # read them
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    converted = os.path.join(str(folder) + "-from-dcp.pt")
    dcp_to_torch_save(os.path.join(folder, "model.dcp"), converted)
    for other in (load_file(os.path.join(folder, "model.safetensors")),
                  torch.load(converted, weights_only=True)):
        assert sorted(other) == sorted(state) and all(torch.equal(other[k], state[k])
                                                      for k in state)


def test_init_from_reads_safetensors_on_every_torch(one_process, monkeypatch):
    # --init-from model.safetensors reads the same tensors as the .pt, with safetensors' own
    # loader: torch.load refuses a safetensors file before torch 2.12, as it does here
    folder = one_process[1]
    want = checkpoints.read_state_dict(os.path.join(folder, "model.pt"))

    def old_torch_load(*args, **kwargs):
        raise RuntimeError("Invalid magic number; corrupt file?")
    monkeypatch.setattr(torch, "load", old_torch_load)
    got = checkpoints.read_state_dict(os.path.join(folder, "model.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def checkpoint_error_cases(tmp):
    ckpt, plain = os.path.join(tmp, "straight"), os.path.join(tmp, "plain.pt")
    return [(["--d-model", "64", "--ckpt-dir", ckpt], "checkpoint is for another model"),
            (["--init-from", plain], "--init-from"),
            (["--init-from", os.path.join(tmp, "none.pt")], "No such file"),
            (["--init-from", tmp], "a directory; it takes a .pt or .safetensors file"),
            (["--consolidate", tmp], "needs --out"),
            (["--consolidate", os.path.join(tmp, "empty"), "--out", plain],
             "no complete checkpoint"),
            (["--consolidate", plain, "--out", plain + ".out.pt"], "not a directory"),
            (["--consolidate", os.path.join(tmp, "none"), "--out", plain + ".out.pt"],
             "no such directory"),
            (["--consolidate", ckpt, "--out", plain + ".out"], "name a .pt or .safetensors file"),
            (["--consolidate", ckpt, "--out", plain + "/"], "ends in /"),  # (plain.pt is a file)
            (["--consolidate", ckpt, "--out", "/proc/m.dcp"], "cannot write in /proc"),  # (root)
            (["--consolidate", ckpt, "--out", os.path.join(ckpt, "model.pt")],  # (it wrote there)
             "inside the checkpoints it reads"),
            (["--ckpt-every", "2"], "needs --ckpt-dir"), (["--bucket-mb", "-1"], "--bucket-mb"),
            # the same shapes, another model: recorded beside the data position, and refused
            (["--n-head", "2", "--ckpt-dir", ckpt], "written with --n-head 4, not 2"),
            (["--init-from", os.path.join(tmp, "fifo")], "not a regular file")]  # (no wait)


@scenario(2, reads=straight)
def cli_errors(rank, world):
    # after `straight`, whose checkpoint is the one of another model for the first case
    tmp = os.environ["ZERO_TEST_TMP"]
    if rank == 0:
        torch.save({"x": torch.zeros(2)}, os.path.join(tmp, "plain.pt"))
        os.makedirs(os.path.join(tmp, "empty"), exist_ok=True)
        os.mkfifo(os.path.join(tmp, "fifo"))
    dist.barrier()
    return [main_refused(zero.main, [*CKPT, "--steps", "2", *args])
            for args, _ in checkpoint_error_cases(tmp)]


def test_checkpoint_errors_are_one_line(ran, shared):
    # zero.main on both ranks of N = 2: every rank refuses, with the same one-line message (which
    # zero.run prints as one line, exit code 2: test_bad_input_is_one_line_and_exit_2), and trains
    # nothing.
    cases = checkpoint_error_cases(shared)
    for res in ran(cli_errors, 2):
        assert len(res) == len(cases)
        for (args, message), (error, printed) in zip(cases, res):
            assert error and message in error and "\n" not in error, (args, error)
            assert "step    1 |" not in printed
    assert [e for e, _ in ran(cli_errors, 2)[0]] == [e for e, _ in ran(cli_errors, 2)[1]]
    # a failed run wrote nothing
    assert torch.load(os.path.join(shared, "plain.pt"), weights_only=True)["x"].shape == (2,)


# ----------------------------------------------------------------------------------------------
# Checkpoints under abuse: one job per directory, ranks that agree, nothing non-finite saved, the
# manifest read as data, one line and never a traceback. In this process (a gloo group of one)
# where it can be; two ranks once.

def full_disk(obj, f):  # torch.save on a full disk: some bytes, then ENOSPC
    import errno
    f.write(b"\0" * 1000)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@scenario(2)
def abused_ranks(rank, world):
    root, out = os.path.join(os.environ["ZERO_TEST_TMP"], "abused-ckpt"), {}
    model, opt = wrapped(rank, 2, "adamw", seed=100)
    train_rows(model, opt, rank, world, 1, 0)
    for step in (2, 4):
        checkpoints.save_checkpoint(opt, root, step)
    # Rank 0 chooses: here its listing does not show step 4 yet (it completed in between), rank
    # 1's does. Both must resume from step 2.
    real_steps, real_save = checkpoints._steps, torch.save
    if rank == 0:
        checkpoints._steps = lambda r: {s: p for s, p in real_steps(r).items() if s < 4}
    out["chosen"] = checkpoints.choose_checkpoint(root, torch.device("cpu"))
    checkpoints._steps = real_steps
    # The disk fills up while rank 1 writes step 6: every rank raises the same one line, and
    # nothing of step 6 is left.
    if rank == 1:
        torch.save = full_disk
    try:
        checkpoints.save_checkpoint(opt, root, 6)
    except checkpoints.CheckpointError as e:
        out["full"] = str(e)
    torch.save = real_save
    dist.barrier()
    out["after"] = sorted(os.listdir(root))
    chosen = checkpoints.choose_checkpoint(root, torch.device("cpu"))
    out["loaded"] = checkpoints.load_checkpoint(opt, chosen)["step"]
    # Node-local disks: rank 1, the first rank of "another node", writes into a directory of its
    # own. Refused on every rank before a checkpoint is marked complete; each node's is removed.
    local, saved = root + ("-node1" if rank else ""), os.environ["LOCAL_RANK"]
    os.environ["LOCAL_RANK"] = "0"
    try:
        checkpoints.save_checkpoint(opt, local, 8)
    except checkpoints.CheckpointError as e:
        out["local"] = str(e)
    os.environ["LOCAL_RANK"] = saved
    dist.barrier()
    out["local after"] = sorted(os.listdir(local))
    try:  # and at the start of a run (train() takes --ckpt-dir's lock), before any training
        with checkpoints.ckpt_dir_lock(local + "-run", torch.device("cpu")):
            pass
    except zero.UsageError as e:
        out["local run"] = str(e)
    try:  # and a DCP save (fsdp_demo.py's), each rank a tensor of its own
        checkpoints.save_dcp({f"x{rank}": torch.ones(4)}, local, 10, {}, torch.device("cpu"))
    except checkpoints.CheckpointError as e:
        out["local dcp"] = str(e)
    # Resuming, each rank reads its own copy, and they differ: refused on every rank
    args = argparse.Namespace(ckpt_dir=None, resume_from=os.path.join(root, "step_0000000" + (
        "4" if rank else "2")))
    try:
        checkpoints.resume(opt, args, world, torch.device("cpu"), print)
    except checkpoints.CheckpointError as e:
        out["mixed"] = str(e)
    try:  # the library's load_checkpoint too
        checkpoints.load_checkpoint(opt, args.resume_from)
    except checkpoints.CheckpointError as e:
        out["mixed load"] = str(e)
    args.resume_from = os.path.join(root, "step_00000002" if rank == 0 else "gone")  # (a node
    try:                                                        # without it: every rank stops)
        checkpoints.resume(opt, args, world, torch.device("cpu"), print)
    except checkpoints.CheckpointError as e:
        out["missing"] = str(e)
    return out


@pytest.fixture(scope="module")
def abused(ran, shared):
    return shared, ran(abused_ranks, 2)


def test_rank_0_chooses_the_checkpoint_and_a_full_disk_fails_every_rank(abused):
    tmp, ranks = abused
    assert [r["chosen"] for r in ranks] == [os.path.join(tmp, "abused-ckpt", "step_00000002")] * 2
    assert ranks[0]["full"] == ranks[1]["full"]
    full = ranks[0]["full"]
    assert full.startswith("step 6 not saved: rank 1: ") and "No space left" in full
    assert "\n" not in full
    assert ranks[0]["after"] == ranks[1]["after"] == ["step_00000002", "step_00000004"]
    assert [r["loaded"] for r in ranks] == [4, 4]  # the previous checkpoint is intact
    for path, _, files in os.walk(os.path.join(tmp, "abused-ckpt")):
        assert not [f for f in files if ".tmp" in f], (path, files)


def test_a_write_cut_short_is_named():  # torch.save's own words on a full disk, as seen there
    e = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 407872 vs 407824")
    assert checkpoints._reason(e) == "a write was cut short (no space left on the device?)"


def test_node_local_directories_are_refused_at_save_and_at_resume(abused):
    tmp, ranks = abused
    assert ranks[0]["local"] == ranks[1]["local"]
    assert re.fullmatch(r"step 8 not saved: \S+rank_00001\.pt, which another rank wrote, is not "
                        r"there for rank 0: --ckpt-dir must be shared by every rank",
                        ranks[0]["local"]), ranks[0]["local"]
    assert ranks[0]["local after"] == ["step_00000002", "step_00000004"]  # nothing of step 8
    assert ranks[1]["local after"] == []  # (rank 1's "node": its part removed too)
    assert ranks[0]["local run"] == ranks[1]["local run"]
    assert "-run: not the one rank 0 sees (each node's own disk?)" in ranks[0]["local run"]
    assert os.listdir(os.path.join(tmp, "abused-ckpt-run")) == []  # (rank 0's probe removed)
    assert ranks[0]["local dcp"] == ranks[1]["local dcp"]
    assert re.fullmatch(r"step 10 not saved: \S+__1_0\.distcp, which another rank wrote, is not "
                        r"there for rank 0: .*", ranks[0]["local dcp"]), ranks[0]["local dcp"]
    for rank, other in enumerate([1, 0]):
        for case in ("mixed", "mixed load"):
            assert ranks[rank][case].endswith(f": rank {other} reads another checkpoint there "
                                              "than this rank (each node's own copy?): every "
                                              "rank must load the same one")
        assert ranks[rank]["missing"].endswith("gone: no such directory (a checkpoint, or one "
                                               "that holds checkpoints)")


def test_a_job_on_a_directory_in_use_is_refused_and_a_dead_jobs_lock_is_not(one_rank, tmp_path):
    import fcntl
    ckpt = tmp_path / "ckpt"
    zero.main([*TINY, "--steps", "2", "--ckpt-dir", str(ckpt)])
    before = sorted(os.listdir(ckpt))
    # another job (here a process that holds the lock and is then killed) holds the directory
    hold = (f"import fcntl, os, time\nfd = os.open({str(ckpt)!r}, os.O_RDONLY)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        in_use = f"in use by another job \\(process {holder.pid}\\)"
        with pytest.raises(zero.UsageError, match=in_use):
            zero.main([*TINY, "--ckpt-dir", str(ckpt)])
        assert sorted(os.listdir(ckpt)) == before  # refused before writing (or deleting) anything
    finally:
        holder.kill()
        holder.wait()
    zero.main([*TINY, "--ckpt-dir", str(ckpt)])  # the kernel dropped the dead job's lock
    assert sorted(os.listdir(ckpt)) == ["step_00000002", "step_00000003"]
    fd = os.open(ckpt, os.O_RDONLY)  # and this job let go of its own when it ended
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)


def test_nonfinite_steps_are_never_applied_nor_saved(one_rank, tmp_path, capsys):
    # --lr 1e4: step 1 is finite, step 2's gradient norm is not. The run stops before applying
    # step 2, names it and the last good checkpoint, which is kept; also with --clip 0.
    for clip in ["1", "0"]:
        ckpt = tmp_path / f"clip{clip}"
        with pytest.raises(zero.Diverged) as e:
            zero.main([*TINY, "--steps", "6", "--lr", "1e4", "--clip", clip,
                       "--ckpt-dir", str(ckpt), "--ckpt-every", "1"])
        message = str(e.value)
        # nan or inf: which one the overflow gives depends on torch's kernels
        assert re.match(r"step 2: the gradient norm is (nan|inf); stopped before", message)
        assert "\n" not in message
        assert f"Last good checkpoint: {ckpt / 'step_00000001'} " in message
        assert sorted(os.listdir(ckpt)) == ["step_00000001"]
        parts = checkpoints.read_checkpoint(ckpt / "step_00000001")[1]
        assert all(torch.isfinite(u["master"]).all() for part in parts for u in part["units"])
    # --skip-nonfinite: those steps are skipped, the weights and optimizer state stay step 1's
    ckpt = tmp_path / "skip"
    zero.main([*TINY, "--steps", "6", "--lr", "1e4", "--ckpt-dir", str(ckpt), "--ckpt-every", "1",
               "--skip-nonfinite", "--timeline", str(tmp_path / "t.svg")])
    assert "5 step(s) of 6 skipped" in capsys.readouterr().out
    assert (tmp_path / "t.svg").exists()  # step 6's, skipped: its events up to the step drawn
    five, six = (checkpoints.read_checkpoint(ckpt / f"step_0000000{s}")[1][0] for s in (5, 6))
    assert all(torch.equal(a["master"], b["master"]) for a, b in zip(five["units"], six["units"]))
    assert ([s["step"] for s in five["param_scalars"].values()]
            == [s["step"] for s in six["param_scalars"].values()]
            == [1] * len(five["param_scalars"]))  # one step applied in all


def test_resume_applies_the_command_lines_lr(one_rank, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    zero.main([*TINY, "--steps", "2", "--ckpt-dir", str(ckpt)])
    zero.main([*TINY, "--lr", "1e-3", "--ckpt-dir", str(ckpt)])
    out = capsys.readouterr().out
    assert "hyper-parameters loaded, then --lr 0.001 applied (it had 0.002)" in out
    assert checkpoints.read_checkpoint(ckpt / "step_00000003")[1][0]["hyper"][0]["lr"] == 1e-3


def test_resume_notes_other_data_under_the_same_name(one_rank, tmp_path, capsys):
    ckpt, data = tmp_path / "ckpt", tmp_path / "d.txt"
    data.write_bytes(bytes(range(256)) * 8)
    zero.main([*TINY, "--steps", "2", "--ckpt-dir", str(ckpt), "--data", str(data)])
    zero.main([*TINY, "--steps", "3", "--ckpt-dir", str(ckpt), "--data", str(data)])
    assert "data stream differs" not in capsys.readouterr().out
    data.write_bytes(bytes(range(255, -1, -1)) * 8)  # other bytes, the same name and size
    zero.main([*TINY, "--steps", "4", "--ckpt-dir", str(ckpt), "--data", str(data)])
    assert "note: the data stream differs" in capsys.readouterr().out


def test_rotation_keeps_the_new_checkpoint_and_only_reads_exact_names(one_rank, tmp_path):
    root = tmp_path / "ckpt"
    model, opt = wrapped(0, 1, "adamw", seed=100)
    for step in (4, 8):
        checkpoints.save_checkpoint(opt, str(root), step)
    shutil.copytree(root / "step_00000004", root / "step_00000009.bak")
    for name in ["step_", "step_9", "step_000000009"]:
        (root / name).mkdir()
        (root / name / "manifest.json").write_text("{}")
    (root / "step_00000010").write_text("a file")
    leftover = root / "step_00000008" / "rank_00000.pt.tmp12345"  # a save killed midway
    leftover.write_bytes(b"\0" * 100)
    torn = root / "step_00000006.partial"  # a DCP save (fsdp_demo.py) killed midway
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"\0" * 100)
    assert checkpoints.latest_checkpoint(str(root)) == str(root / "step_00000008")
    zero.main(["--consolidate", str(root), "--out", str(tmp_path / "model.pt")])
    odd = ["step_", "step_000000009", "step_00000009.bak", "step_00000010", "step_9"]
    # lower than both: kept all the same, once written
    checkpoints.save_checkpoint(opt, str(root), 2)
    kept = ["step_00000002", "step_00000004", "step_00000008"]
    assert sorted(os.listdir(root)) == sorted(kept + odd)
    assert not leftover.exists() and not torn.exists()
    checkpoints.save_checkpoint(opt, str(root), 12)
    assert sorted(os.listdir(root)) == sorted(["step_00000008", "step_00000012", *odd])
    checkpoints.save_checkpoint(opt, str(root), 16, keep=0)  # none older: it kept them all
    assert sorted(os.listdir(root)) == sorted(["step_00000016", *odd])


def test_load_state_dict_refuses_another_optimizers_before_any_change(one_rank):
    # AdamW's state into SGD: it loaded, and SGD's step failed on a KeyError ('momentum'); SGD's
    # into AdamW failed on 'step' with the weights replaced already; AdamW's into Adam changed
    # the user's Adam into AdamW's hyper-parameters, silently
    own = wrapped(0, 1, "adamw", seed=100)[1].state_dict()
    model = Net(seed=200)
    opt = zero.wrap(model, 1, functools.partial(torch.optim.Adam, lr=1e-2),
                    units=[model.emb, *model.blocks, model.norm, model.head])
    before = opt.full_state_dict()
    with pytest.raises(checkpoints.CheckpointError, match="of this model and optimizer"):
        opt.load_state_dict(own)
    assert all(torch.equal(t, before[n]) for n, t in opt.full_state_dict().items())
    assert not opt.optimizer.param_groups[0].get("decoupled_weight_decay")
    # its own, edited by hand: an IndexError or RuntimeError deep in the load, or taken silently
    model, opt = wrapped(0, 1, "adamw", seed=100)
    for edit, message in [(lambda s: s["units"].pop(), "does not hold the 5 unit"),
                          (lambda s: s["units"][0].update(master=s["units"][0]["master"][:-1]),
                           "unit 0: not "),
                          (lambda s: s.update(replicated={"x": torch.zeros(1)}), "buffers are"),
                          (lambda s: s.update(hyper=[]), "hyper-parameters are not")]:
        state = opt.state_dict()
        edit(state)
        with pytest.raises(checkpoints.CheckpointError, match=message):
            opt.load_state_dict(state)


def test_save_checkpoint_refuses_a_bad_step_or_extra_on_every_rank(one_rank, tmp_path):
    # rank 0 alone failed at its manifest (json.dumps), the others waited in a collective
    model, opt = wrapped(0, 1, "adamw", seed=100)
    for step, extra, message in [("5", None, "step must be an int >= 0, not '5'"),
                                 (-1, None, "step must be an int >= 0, not -1"),
                                 (3, None, "keep must be an int >= 0, not '2'"),
                                 (3, {"rng": torch.ones(2)}, "extra must be a JSON dict"),
                                 (3, ["epoch", 3], "extra must be a JSON dict")]:
        with pytest.raises(ValueError, match="^zero: save_checkpoint's " + re.escape(message)):
            checkpoints.save_checkpoint(opt, str(tmp_path / "ckpt"), step, extra,
                                        keep="2" if "keep" in message else 2)
    assert not (tmp_path / "ckpt").exists()


def test_a_part_whose_hyper_parameters_are_not_its_groups_changes_nothing(one_rank, tmp_path):
    # a part edited by hand (its hash in the manifest made anew): torch's raw error came after
    # the weights were loaded
    model, opt = wrapped(0, 1, "adamw", seed=100)
    checkpoints.save_checkpoint(opt, str(tmp_path), 1)
    path = tmp_path / "step_00000001"
    part = torch.load(path / "rank_00000.pt", weights_only=True)
    part["units"][0]["master"] += 1
    part["hyper"] = []
    torch.save(part, path / "rank_00000.pt")
    manifest = json.load(open(path / "manifest.json"))
    data = (path / "rank_00000.pt").read_bytes()
    manifest["files"]["rank_00000.pt"] = [len(data), hashlib.sha256(data).hexdigest()]
    (path / "manifest.json").write_text(json.dumps(manifest))
    before = opt.full_state_dict()
    with pytest.raises(checkpoints.CheckpointError, match="hyper-parameters are not a dict"):
        checkpoints.load_checkpoint(opt, str(path))
    assert all(torch.equal(t, before[n]) for n, t in opt.full_state_dict().items())


def test_a_file_written_on_a_full_disk_is_one_line_and_leaves_none(tmp_path, monkeypatch):
    # --timeline's SVG and mistakes.py's --json, after the run: an OSError's line without the
    # file's name before, and a file of 0 bytes left
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(zero.UsageError, match=r"t\.svg: cannot be written \(No space left"):
        checkpoints.write_file(str(tmp_path / "t.svg"), "<svg/>")
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    checkpoints.write_file(str(tmp_path / "t.svg"), "<svg>Ψ</svg>")
    assert (tmp_path / "t.svg").read_text(encoding="utf-8") == "<svg>Ψ</svg>"


def test_complex_parameters_consolidate_to_what_each_format_holds(one_rank, tmp_path):
    # complex64 and complex128 masters (a spectral layer's weights): .pt holds both, safetensors
    # complex64 only: complex128 is refused in one line (it was safetensors' KeyError), no file
    import safetensors.torch
    def model(*dtypes):  # a unit of each dtype (a unit's parameters share one)
        m = nn.ModuleList(nn.ParameterList([torch.randn(3, dtype=t)]) for t in dtypes)
        opt = zero.wrap(m, 1, functools.partial(torch.optim.AdamW, lr=0.1), units=list(m))
        sum(p.abs().sum() for p in m.parameters()).backward()
        opt.step()
        checkpoints.save_checkpoint(opt, str(tmp_path / str(dtypes)), 1)
        return checkpoints.latest_checkpoint(str(tmp_path / str(dtypes))), opt.full_state_dict()
    path, want = model(torch.float32, torch.cfloat, torch.cdouble)
    checkpoints.consolidate(path, str(tmp_path / "m.pt"), "pt")
    state = torch.load(tmp_path / "m.pt")
    assert state["2.0"].dtype == torch.cdouble and all(torch.equal(state[n], t)
                                                        for n, t in want.items())
    with pytest.raises(zero.UsageError, match="safetensors holds no complex128 \\(2.0\\)"):
        checkpoints.consolidate(path, str(tmp_path / "m.safetensors"), "safetensors")
    assert not os.path.exists(tmp_path / "m.safetensors")
    path, want = model(torch.float32, torch.cfloat)
    checkpoints.consolidate(path, str(tmp_path / "m.safetensors"), "safetensors")
    state = safetensors.torch.load_file(tmp_path / "m.safetensors")
    assert state["1.0"].dtype == torch.cfloat and all(torch.equal(state[n], t)
                                                       for n, t in want.items())


def test_consolidate_to_safetensors_on_a_full_disk_is_one_line(one_rank, tmp_path, monkeypatch):
    # safetensors' own error (a traceback before), as .pt and .dcp on a full disk: nothing left
    import safetensors.torch
    model, opt = wrapped(0, 1, "adamw", seed=100)
    checkpoints.save_checkpoint(opt, str(tmp_path / "ckpt"), 1)

    def full(*args, **kwargs):
        raise checkpoints.SafetensorError("Error while serializing: No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(zero.UsageError, match="m.safetensors: cannot be written .*No space left"):
        checkpoints.consolidate(str(tmp_path / "ckpt" / "step_00000001"),
                                str(tmp_path / "m.safetensors"), "safetensors")
    assert os.listdir(tmp_path) == ["ckpt"]


class SharedBuffer(nn.Module):
    """Two blocks that share one buffer (one tensor under two state_dict keys)."""

    def __init__(self, scale=2.0):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])
        self.blocks[0].register_buffer("scale", torch.full((D,), scale))
        self.blocks[1].register_buffer("scale", self.blocks[0].scale)

    def forward(self, x):
        for block in self.blocks:
            x = block(x) * block.scale
        return x


def test_a_buffer_shared_by_two_modules_saves_loads_and_consolidates(one_rank, tmp_path):
    # The manifest named a shared buffer's second key, which its table of buffers (one name a
    # tensor) lacks: the checkpoint saved, then neither loaded nor consolidated
    import safetensors.torch
    model = SharedBuffer()
    opt = zero.wrap(model, 3, functools.partial(torch.optim.SGD, lr=0.1))
    model(torch.randn(B, D)).sum().backward()
    opt.step()
    checkpoints.save_checkpoint(opt, str(tmp_path / "ckpt"), 1)
    path = checkpoints.latest_checkpoint(str(tmp_path / "ckpt"))
    other = SharedBuffer(scale=5.0)
    opt2 = zero.wrap(other, 1, functools.partial(torch.optim.SGD, lr=0.1))
    checkpoints.load_checkpoint(opt2, path)
    assert other.blocks[1].scale is other.blocks[0].scale and other.blocks[1].scale[0] == 2
    want = opt.full_state_dict()
    assert all(torch.equal(t, want[n]) for n, t in opt2.full_state_dict().items())
    for kind in ("pt", "safetensors"):
        out = str(tmp_path / f"m.{kind}")
        checkpoints.consolidate(path, out, kind)
        state = torch.load(out) if kind == "pt" else safetensors.torch.load_file(out)
        assert torch.equal(state["blocks.1.scale"], torch.full((D,), 2.0))


@pytest.mark.parametrize("units", ["each", "one"])
def test_parameters_of_no_elements_save_load_and_consolidate(one_rank, tmp_path, units):
    # A unit whose parameters hold no elements is padded to one element a rank: state_dict()
    # wrote that padding as its part, and every load refused it ("unit 0: not 0 elements");
    # reading such a parameter found no part (torch.cat of none), or divided by its part size 0
    model = nn.Sequential(nn.Linear(D, 0), nn.Linear(D, D))
    opt = zero.wrap(model, 1, functools.partial(torch.optim.AdamW, lr=0.1),
                    units=list(model) if units == "each" else [])
    x = torch.randn(B, D)
    (model[0](x).sum() + model[1](x).sum()).backward()
    opt.step()
    want = opt.full_state_dict()
    checkpoints.save_checkpoint(opt, str(tmp_path), 1)
    opt.load_state_dict(opt.state_dict())
    path = checkpoints.latest_checkpoint(str(tmp_path))
    checkpoints.load_checkpoint(opt, path)
    assert all(torch.equal(t, want[n]) for n, t in opt.full_state_dict().items())
    checkpoints.consolidate(path, str(tmp_path / "m.pt"), "pt")
    state = torch.load(tmp_path / "m.pt")
    assert state.keys() == want.keys() and all(torch.equal(t, want[n]) for n, t in state.items())


def test_a_failed_manifest_write_leaves_the_previous_checkpoint(one_rank, tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    model, opt = wrapped(0, 1, "adamw", seed=100)
    checkpoints.save_checkpoint(opt, str(root), 1)
    monkeypatch.setattr(checkpoints, "_json_lines", lambda d: full_disk(None, io.BytesIO()))
    full = "^step 2 not saved: rank 0: .*manifest.json: No space left"
    with pytest.raises(checkpoints.CheckpointError, match=full):
        checkpoints.save_checkpoint(opt, str(root), 2)
    assert sorted(os.listdir(root)) == ["step_00000001"] and os.listdir(root / "step_00000001")
    checkpoints.load_checkpoint(opt, checkpoints.latest_checkpoint(str(root)))
    with pytest.raises(checkpoints.CheckpointError, match="no checkpoint path was given"):
        checkpoints.load_checkpoint(opt, None)


def test_overwriting_a_checkpoint_of_the_same_step_is_atomic(one_rank, tmp_path, monkeypatch):
    # Step 1 saved twice, with other weights: the second is written whole beside the first and
    # takes its name in one rename; until then step_00000001 is the first, whole. A failed
    # overwrite leaves the first as it was.
    root = str(tmp_path / "ckpt")
    model, opt = wrapped(0, 1, "adamw", seed=100)
    checkpoints.save_checkpoint(opt, root, 1)
    first = opt.full_state_dict()
    run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], slice(None), 1, 1)
    second = opt.full_state_dict()
    seen, exchange = [], checkpoints._exchange

    def watched(new, old):  # the moment before the new one takes the name: the old one is whole
        seen.append(checkpoints.read_checkpoint(old)[1][0]["units"][0]["master"].clone())
        exchange(new, old)
    monkeypatch.setattr(checkpoints, "_exchange", watched)
    checkpoints.save_checkpoint(opt, root, 1)
    assert len(seen) == 1 and sorted(os.listdir(root)) == ["step_00000001"]
    fresh = wrapped(0, 1, "adamw", seed=500)[1]
    checkpoints.load_checkpoint(fresh, checkpoints.latest_checkpoint(root))
    assert all(torch.equal(fresh.full_state_dict()[n], t) for n, t in second.items())
    assert not torch.equal(seen[0], checkpoints.read_checkpoint(
        os.path.join(root, "step_00000001"))[1][0]["units"][0]["master"])
    monkeypatch.setattr(checkpoints, "_json_lines", lambda d: full_disk(None, io.BytesIO()))
    run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], slice(None), 1, 1, start=1)
    with pytest.raises(checkpoints.CheckpointError,
                       match="^step 1 not saved: rank 0: .*No space left"):
        checkpoints.save_checkpoint(opt, root, 1)
    checkpoints.load_checkpoint(fresh, checkpoints.latest_checkpoint(root))
    assert all(torch.equal(fresh.full_state_dict()[n], t) for n, t in second.items())
    assert first.keys() == second.keys()


def test_a_dcp_checkpoint_saved_again_takes_its_name_in_one_step(tmp_path, monkeypatch):
    # fsdp_demo.py's DCP saves (checkpoints.save_dcp) commit as save_checkpoint does: a step saved
    # again is written whole beside the old one, which stays whole until the names are swapped.
    path, tmp = str(tmp_path / "step_00000003"), str(tmp_path / "step_00000003.partial")
    for d, what in ((path, "old"), (tmp, "new")):
        os.makedirs(d)
        open(os.path.join(d, "__0_0.distcp"), "w").write(what)
    seen, exchange = [], checkpoints._exchange

    def watched(new, old):  # the moment before the new one takes the name: the old one is whole
        seen.append(open(os.path.join(old, "__0_0.distcp")).read())
        exchange(new, old)
    monkeypatch.setattr(checkpoints, "_exchange", watched)
    checkpoints._commit(tmp, path, checkpoints.DCP_MARKER, {"step": 3})
    assert seen == ["old"] and os.listdir(tmp_path) == ["step_00000003"]
    assert open(os.path.join(path, "__0_0.distcp")).read() == "new"
    assert json.load(open(os.path.join(path, checkpoints.DCP_MARKER)))["step"] == 3


def unblock_after(fifo, seconds=20):
    """Should a reader wait for ever in open(fifo), a writer's open after `seconds` lets it go."""
    def write():
        time.sleep(seconds)
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    import threading
    threading.Thread(target=write, daemon=True).start()


def test_the_manifest_is_data(abused, tmp_path):
    source = os.path.join(abused[0], "abused-ckpt", "step_00000004")
    manifest = json.load(open(os.path.join(source, "manifest.json")))
    files = manifest["files"]

    def swapped(path):
        os.rename(path / "rank_00000.pt", path / "x")
        os.rename(path / "rank_00001.pt", path / "rank_00000.pt")
        os.rename(path / "x", path / "rank_00001.pt")
        return {"files": {"rank_00000.pt": files["rank_00001.pt"],
                          "rank_00001.pt": files["rank_00000.pt"]}}

    def fifo(name):
        def make(path):
            os.remove(path / name)
            os.mkfifo(path / name)
            unblock_after(path / name)
        return make

    first_unit = manifest["units"][0]
    false_shape = [[[first_unit[0][0], [-1]], *first_unit[1:]], *manifest["units"][1:]]
    cases = {  # what is changed -> what the one-line error must say
        "swapped": (swapped, "rank_00000.pt: holds the part of rank 1, not of rank 0"),
        "outside": ({"files": {"rank_00000.pt": files["rank_00000.pt"],
                               "../../../x.pt": files["rank_00001.pt"]}},
                    "'files' must be exactly rank_00000.pt ... rank_00001.pt"),
        "fifo": (fifo("rank_00001.pt"), "rank_00001.pt: not a regular file"),
        "fifo manifest": (fifo("manifest.json"), "manifest.json: not a regular file"),
        "step abc": ({"step": "abc"}, "'step' is 'abc'"),
        "step true": ({"step": True}, "'step' is True"),
        "no extra": ({"extra": None}, "'extra' is None, not a dictionary"),
        "no files": ({"files": None}, "'files' is None, not a non-empty dictionary"),
        "empty files": ({"files": {}}, "'files' is {}, not a non-empty dictionary"),
        "false shape": ({"units": false_shape}, "'units' is not a list"),
        "world size": ({"world_size": 0}, "'world_size' is 0"),
        "shard size": ({"shard_size": 3}, "'shard_size' is 3, not a divisor of world_size"),
        "shard size x": ({"shard_size": "x"}, "'shard_size' is 'x', not a divisor"),
        "psi": ({"psi": 5}, "'psi' is 5"),
        "bad hash": ({"files": {**files, "rank_00000.pt": [files["rank_00000.pt"][0], "../x"]}},
                     "'files' entry rank_00000.pt"),
    }
    for what, (change, message) in cases.items():
        path = tmp_path / what
        shutil.copytree(source, path)
        changed = change(path) if callable(change) else change
        if changed:
            (path / "manifest.json").write_text(json.dumps({**manifest, **changed}))
        out = str(tmp_path / "out.pt")
        for read in [checkpoints.read_checkpoint, lambda p: checkpoints.consolidate(p, out, "pt"),
                     lambda p: zero.main(["--consolidate", str(p), "--out", out])]:
            with pytest.raises(checkpoints.CheckpointError) as e:
                read(path)
            assert message in str(e.value) and "\n" not in str(e.value), (what, str(e.value))
        assert not os.path.exists(tmp_path / "out.pt")
    # --out onto a directory or into a missing one: one line, no temporary file left
    for out in [tmp_path, tmp_path / "missing" / "out.pt"]:
        with pytest.raises(zero.UsageError, match="^--out"):
            zero.main(["--consolidate", source, "--out", str(out)])
        with pytest.raises(zero.UsageError, match="cannot be written"):
            checkpoints.consolidate(source, str(out), "pt")
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_dcps_own_errors_are_one_line(one_rank, tmp_path, monkeypatch):
    # torch's DCP raises CheckpointException, a BaseException, for what failed on any rank: it is
    # caught by name, as any other error, or one rank would die alone while the others wait
    import traceback
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def fails(*args, **kwargs):
        raise CheckpointException("save", {0: (ValueError("no such key"),
                                                traceback.extract_stack())})
    monkeypatch.setattr(dcp, "save", fails)
    with pytest.raises(checkpoints.CheckpointError,
                       match=r"^step 1 not saved: rank 0: .*: ValueError: no such key; "
                             r"the checkpoints"):
        checkpoints.save_dcp({"x": torch.zeros(2)}, str(tmp_path), 1, {}, torch.device("cpu"))
