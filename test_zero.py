"""Tests for zero.py, on the gloo backend, and where a GPU is visible also on CUDA tensors (gloo
and NCCL): every stage against one single-process reference (a plain model, a plain torch
optimizer, the concatenation of every rank's batch), every measured number against the ZeRO
paper's formula (arXiv:1910.02054). The ranks are conftest.py's pool: each scenario below runs
on N of them, and the tests right after it read what every rank returned.
Run: python -m pytest -q           (the CUDA cases alone: python -m pytest -q -k cuda -rs)

What the README claims of zero.py, and the tests that check it:

- Every stage trains like single-process training: test_matches_single_process_reference (N = 1,
  2, 4; three optimizer and unit cases), test_three_ranks_match_the_reference (N = 3),
  test_every_backward_may_reduce, test_unused_parameters_and_out_of_place_accumulation,
  test_buckets_merge_and_split_units_and_change_nothing_else,
  test_each_way_of_reducing_trains_the_same, test_mixed_precision_trains_close_to_fp32 (bf16:
  close, not equal), test_mixed_precision_keeps_writes_between_steps,
  test_clipping_really_clips (that those comparisons can fail),
  test_cli_every_stage_gives_the_same_losses (the demo GPT),
  test_a_model_of_torchs_own_layers_trains_like_the_reference (nn.TransformerEncoder).
- Memory = formula: test_memory_matches_formula, test_mixed_precision_memory_matches_the_paper,
  test_sharded_state_is_never_whole, test_peak_follows_every_change,
  test_dropped_models_are_freed, test_estimate_reproduces_the_paper,
  test_cli_trains_under_torchrun (the printed tables).
- Communication = formula: test_communication_matches_formula,
  test_mixed_precision_communication, test_every_backward_may_reduce,
  test_buckets_merge_and_split_units_and_change_nothing_else,
  test_each_way_of_reducing_trains_the_same, test_direct_exchange_equals_the_native_collectives.
- Overlap on or off, bit-identical results: test_overlap_changes_nothing_but_timing. The time a
  step waits on collectives, measured where it waits: test_waiting_is_measured_where_the_rank_
  waits, test_each_step_is_split_into_waiting_and_the_rest.
- Parameters without a gradient, as plain torch (unused, or frozen after wrap: not stepped, at
  every stage, in mixed precision, with hybrid sharding): test_unused_and_frozen_parameters_are_
  not_stepped_as_in_torch, test_an_unused_parameters_grad_is_none_as_in_torch,
  test_unused_parameters_and_out_of_place_accumulation,
  test_a_parameter_unfrozen_after_wrap_is_refused_by_name.
- torch's conventions: test_torch_gradient_conventions_and_conversions,
  test_clipping_in_any_dtype_is_torchs, test_sparse_gradients_are_refused_by_name; buffers:
  test_buffers_broadcast_or_kept_per_rank; full parameters for a moment:
  test_gathered_parameters_read_write_back_and_memory.
- A stage-3 model in real code: test_activation_checkpointing_trains_like_the_reference,
  test_reading_a_stage3_parameter_is_an_error_not_a_crash,
  test_stage3_gathers_what_each_module_computes_with, test_default_units_find_the_blocks_at_any_
  depth, test_output_tensors_are_found_at_any_depth, test_stage3_hooks_a_unit_output_of_any_
  structure, test_stage3_refuses_values_read_outside_their_modules (a prefetch in flight too),
  test_stage3_prefetches_the_unit_that_computes_next.
- Only what steps as unsharded torch does: test_wrap_refuses_what_would_not_step_as_unsharded_
  torch (groups, Adafactor...), test_wrap_refuses_a_bad_option_in_one_line,
  test_a_unit_of_two_dtypes_is_refused_naming_them,
  test_an_embedding_that_renormalizes_in_forward_is_refused.
- Ranks that disagree fail on every rank before anything is applied:
  test_ranks_that_disagree_fail_fast, test_settings_that_change_communication_must_agree,
  test_ranks_that_reduce_different_units_stop_before_the_step,
  test_ranks_that_disagree_are_one_line_under_torchrun.
- Hybrid sharding: test_hybrid_sharding_matches_the_reference,
  test_hybrid_memory_and_communication_by_group, test_estimate_reproduces_the_paper.
- The command line: test_cli_trains_under_torchrun; bad input is one line on stderr and exit
  code 2 (test_bad_input_is_one_line_and_exit_2, test_bad_flags_are_one_line,
  test_wrap_rejects_a_bad_stage, test_run_ends_zero_own_errors_in_one_line); a dead rank is one
  line and exit code 1 (test_a_dead_rank_ends_the_job).
- On a GPU (CUDA tensors, the reference on CPU): every test that takes `ranks` or `hybrid_runs`,
  again for the ids cuda-gloo-N2 and cuda-gloo-N4 (N ranks sharing one GPU over gloo) and
  cuda-nccl-N1, -N2, -N4 (NCCL, a GPU per rank), which covers stage 3 on CUDA streams with
  prefetch on and off; the allocator's bytes against the formula:
  test_cuda_peak_memory_is_within_the_formula, test_cuda_memory_between_steps_is_the_model_state;
  the report and the timeline's CUDA curve: test_cuda_report_and_timeline_draw_the_allocator;
  the demo GPT at every stage: test_cuda_every_stage_trains_alike.

No assertion depends on how fast anything runs. Where overlap is checked, collectives report
"not finished" until zero.py waits for them (landed_only_when_waited), so what is seen in flight
is what zero.py left in flight, on any schedule.
"""
import collections
import contextlib
import copy
import datetime
import dataclasses
import functools
import gc
import io
import itertools
import os
import re
import socket
import subprocess
import sys
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import conftest
import memory
import zero
from conftest import (B, CASES, CKPT, CUDA_RUNS, D, ENV, H, HERE, STEPS, T, TINY, V, Early, Net,
                      assert_trains_like, global_batch, losses, main_printed, reference, run_id,
                      run_steps, scenario, unit_layout, wrapped)

# ----------------------------------------------------------------------------------------------
# Every stage, every way: what each rank runs, and what it records

def watch(model, opt):
    """The most a rank held at any moment, sampled from inside forward and backward: bytes from
    memory_breakdown(), units gathered, full unit gradients held, reduce-scatters in flight and
    all-gathers prefetched. The hooks hold `opt` weakly (see zero._grad_hook)."""
    seen, ref = dict.fromkeys(["params", "grads", "gathered", "grads_held", "in_flight",
                               "prefetching", "untracked"], 0), weakref.ref(opt)

    def sample(*_):
        opt = ref()
        m = opt.memory_breakdown()
        now = {"params": m["params"], "grads": m["grads"],
               # bytes the running total that feeds opt.peak (zero.py's Meter.event) misses or adds
               "untracked": max(abs(opt.meter.now[k] - m[k]) for k in ("params", "grads")),
               "gathered": sum(u.gathered for u in opt.units),
               "grads_held": sum(u.grad is not None for u in opt.units),
               "in_flight": len(opt.in_flight),
               "prefetching": sum(getattr(u, "prefetch", None) is not None for u in opt.units)}
        seen.update({k: max(seen[k], v) for k, v in now.items()})
    for m in model.modules():
        m.register_forward_pre_hook(sample)
        m.register_forward_hook(sample)
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(sample)  # runs after zero.py's own hook
    return seen


@contextlib.contextmanager
def landed_only_when_waited():
    """Every collective answers is_completed() with False. zero.py lands a reduction early when it
    happens to have finished already; whether it has, when backward next looks, depends on how
    fast the other ranks and the backend's threads were. Under this, a reduction lands only where
    zero.py waits for it, so what a sample sees in flight is what zero.py chose not to wait for,
    the same on every schedule. The results do not change: reductions land in the order they were
    issued either way (zero.DataParallel._land_reductions)."""
    saved = dist.Work.is_completed
    dist.Work.is_completed = lambda self: False
    try:
        yield
    finally:
        dist.Work.is_completed = saved


def parameters_alive():
    # (isinstance(o, nn.Parameter) alone runs Python code for each of the process's objects)
    return [o for o in gc.get_objects()
            if isinstance(o, torch.Tensor) and isinstance(o, nn.Parameter)]


def train_every_way(rank, world):
    out, rows = {}, slice(rank * B, (rank + 1) * B)  # this rank's rows of every global batch
    for stage in range(4):
        for case in CASES:
            model, opt = wrapped(rank, stage, case, seed=100)
            rec = watch(model, opt)
            comm = [dict(opt.comm)]

            def after_step():
                rec["mem"] = opt.memory_breakdown()  # after the step, before zero_grad
                comm.append(dict(opt.comm))
            # "adamw" is the run with overlap that
            # test_overlap_changes_nothing_but_timing looks into
            with landed_only_when_waited() if case == "adamw" else contextlib.nullcontext():
                run_steps(model, opt, opt.clip_grad_norm_, CASES[case], rows, world, STEPS,
                          after_step=after_step)
            rec["comm"] = [{k: b.get(k, 0) - a.get(k, 0) for k in b}
                           for a, b in zip(comm, comm[1:])]
            rec.update(full=opt.full_state_dict(), layout=unit_layout(opt), peak=dict(opt.peak))
            out[(stage, case)] = rec

        # Buckets of 300 bytes (Net's units: 312, 596, 596, 48 bytes and the head's bias): cut
        # from the last parameter backwards, small units merged, blocks split; stage 3 ignores it.
        model, opt = wrapped(rank, stage, "adamw", seed=100, bucket_bytes=300)
        comm = [dict(opt.comm)]
        run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, world, STEPS,
                  after_step=lambda: comm.append(dict(opt.comm)))
        out[(stage, "bucketed")] = {"full": opt.full_state_dict(), "layout": unit_layout(opt),
                                    "names": [[n for n, _ in u] for u in zero.layout(opt)["units"]],
                                    "comm": [{k: b.get(k, 0) - a.get(k, 0) for k in b}
                                             for a, b in zip(comm, comm[1:])]}

        # Overlap off: the same run, every collective waited for where it is issued (under the same
        # landed_only_when_waited as the run with overlap: what is in flight is what is not
        # waited for)
        model, opt = wrapped(rank, stage, "adamw", seed=100, overlap=False)
        seen = watch(model, opt)
        with landed_only_when_waited():
            run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, world, STEPS)
        out[(stage, "no-overlap")] = dict(seen, full=opt.full_state_dict())
        # and of the "sgd" case: one backward per step, where stage 0 with overlap divides by N as
        # it copies gradients in, and without it after the all-reduce
        model, opt = wrapped(rank, stage, "sgd", seed=100, overlap=False)
        run_steps(model, opt, opt.clip_grad_norm_, CASES["sgd"], rows, world, STEPS)
        out[(stage, "no-overlap sgd")] = opt.full_state_dict()

        # gloo's own reduce_scatter_tensor / all_gather_into_tensor (zero.DIRECT = False): the
        # same training, the same calls counted (the report says what gloo's own sends)
        zero.DIRECT = False
        try:
            model, opt = wrapped(rank, stage, "adamw", seed=100)
            comm = [dict(opt.comm)]
            run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, world, STEPS,
                      after_step=lambda: comm.append(dict(opt.comm)))
        finally:
            zero.DIRECT = True
        out[(stage, "native")] = {"full": opt.full_state_dict(),
                                  "comm": [{k: b.get(k, 0) - a.get(k, 0) for k in b}
                                           for a, b in zip(comm, comm[1:])]}

        # Every backward reduces (no no_sync() around the first micro-batch): accumulating on top
        # of reduced gradients must still give the reference, at k times the communication.
        model, opt = wrapped(rank, stage, "sgd-accum", seed=100)
        comm = [dict(opt.comm)]
        run_steps(model, opt, opt.clip_grad_norm_, CASES["sgd-accum"], rows, world, STEPS,
                  after_step=lambda: comm.append(dict(opt.comm)), no_sync=False)
        out[(stage, "every-backward")] = {"full": opt.full_state_dict(), "layout": unit_layout(opt),
                                          "comm": {k: v - comm[-2].get(k, 0)
                                                   for k, v in comm[-1].items()}}

        # Mixed precision: bf16 compute, fp32 reductions (and bf16 reductions, at stage 2)
        for name, reduce_dtype in ([("bf16", None)]
                                   + [("bf16-reduce", torch.bfloat16)] * (stage == 2)):
            model, opt = wrapped(rank, stage, "adamw", seed=100, param_dtype=torch.bfloat16,
                                 reduce_dtype=reduce_dtype)
            comm = [dict(opt.comm)]
            rec = watch(model, opt)

            def after_step():
                rec["mem"] = opt.memory_breakdown()
                comm.append(dict(opt.comm))
            run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, world, STEPS,
                      after_step=after_step)
            rec["comm"] = {k: v - comm[-2].get(k, 0) for k, v in comm[-1].items()}
            rec.update(full=opt.full_state_dict(), layout=unit_layout(opt), peak=dict(opt.peak),
                       dtypes={str(p.dtype) for p in model.parameters()})
            out[(stage, name)] = rec
    return out


@scenario(1, 2, 4, cuda=(1, 2, 4))
def trained(rank, world):
    # Parameters of earlier runs in this rank process are not counted (and are held here, so that
    # no parameter made below can take one's id).
    before = parameters_alive()
    out = train_every_way(rank, world)
    gc.collect()  # every model and optimizer of these scenarios is garbage now: are they freed?
    gc.collect()  # (a second pass: what the first one frees lets go of more)
    known = {id(p) for p in before}
    out["params_alive"] = sum(id(p) not in known for p in parameters_alive())
    return out


# (transport, N): the CUDA runs where a GPU is
RUNS = [("cpu", 1), ("cpu", 2), ("cpu", 4), *CUDA_RUNS]


@pytest.fixture(scope="module", params=RUNS, ids=run_id)
def ranks(request, ran):
    """(N, every rank's result of `trained`, on a GPU?) at each N, on CPU tensors and on a GPU."""
    transport, world = request.param
    return world, ran(trained, world, transport), transport != "cpu"


# ----------------------------------------------------------------------------------------------
# Correctness: every stage trains exactly like the single-process reference

@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stage", range(4))
def test_matches_single_process_reference(ranks, stage, case):
    world, results, cuda = ranks
    want = reference(case, world)
    initial = {n: p.detach() for n, p in Net(seed=100).named_parameters()}
    for r, res in enumerate(results):
        assert_trains_like(res[(stage, case)]["full"], want, cuda, what=f"rank {r}")
    moved = max((want[n] - initial[n]).abs().max().item() for n in want if n != "frozen.weight")
    assert moved > 1e-2  # the comparison is not between two untrained models
    assert torch.equal(want["frozen.weight"], initial["frozen.weight"])


def test_clipping_really_clips():
    # With clip 0.05 the "adamw" reference must differ from the same run without clipping, or
    # the clipping checks above prove nothing.
    unclipped = dict(CASES["adamw"], clip=None)
    model = Net(seed=100)
    params = [p for p in model.parameters() if p.requires_grad]
    run_steps(model, unclipped["optimizer"](params), None, unclipped, slice(None), 2, STEPS)
    clipped = reference("adamw", 2)
    assert max((p.detach() - clipped[n]).abs().max().item()
               for n, p in model.named_parameters()) > 1e-4


def torch_transformer(seed):
    """A model of torch's own layers, as a user builds one: nn.TransformerEncoder (pre-norm, its
    attention's packed in_proj_weight, layers deep-copied from one) between an embedding and a
    head; float64, where AdamW's first, sign-like steps cannot turn rounding into a step."""
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(D, 2, dim_feedforward=2 * D, dropout=0.0,
                                       batch_first=True, norm_first=True, dtype=torch.float64)
    return nn.Sequential(nn.Embedding(V, D, dtype=torch.float64),
                         nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                         nn.Linear(D, V, dtype=torch.float64))


THIRD_PARTY = {"adamw": functools.partial(torch.optim.AdamW, lr=1e-2),
               "sgd-momentum": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)}


def third_party_steps(model, opt, rows, world):
    for step in range(STEPS):
        x, y = (t[rows] for t in global_batch(step, 0, world))
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()


@scenario(2)
def third_party(rank, world):
    out, rows = {}, slice(rank * B, (rank + 1) * B)
    for name, optimizer in THIRD_PARTY.items():
        for stage in range(4):
            model = torch_transformer(seed=rank)  # ranks build different weights: rank 0's win
            opt = zero.wrap(model, stage, optimizer)
            third_party_steps(model, opt, rows, world)
            out[(name, stage)] = {"full": opt.full_state_dict(), "units": len(opt.units)}
    return out


def test_a_model_of_torchs_own_layers_trains_like_the_reference(ran):
    # Not a model written for these tests: torch's nn.TransformerEncoder, its two layers found
    # as units (with the embedding and head in the root), at every stage, AdamW and SGD momentum
    for name, optimizer in THIRD_PARTY.items():
        model = torch_transformer(seed=0)
        third_party_steps(model, optimizer(model.parameters()), slice(None), 2)
        want = {n: p.detach() for n, p in model.named_parameters()}
        initial = dict(torch_transformer(seed=0).named_parameters())
        assert max((want[n] - initial[n]).abs().max().item() for n in want) > 1e-2
        for res in ran(third_party, 2):
            for stage in range(4):
                got = res[(name, stage)]
                assert got["units"] == 3
                assert_trains_like(got["full"], want, tol=1e-10, what=f"{name} stage {stage}")


# ----------------------------------------------------------------------------------------------
# Memory: what memory_breakdown() measures equals the ZeRO paper's formula (arXiv:1910.02054,
# fp32 AdamW; zero.memory_formula)

@pytest.mark.parametrize("stage", range(4))
def test_memory_matches_formula(ranks, stage):
    world, results, cuda = ranks
    for res in results:
        rec = res[(stage, "adamw")]
        lay = rec["layout"]
        padded = world * sum(lay["S"])  # parameters incl. padding, per rank
        shard = lambda sharded: padded // world if sharded else padded
        exact = {"params": 4 * shard(stage >= 3), "grads": 4 * shard(stage >= 2),
                 # + AdamW's float32 step counter of each piece
                 "optimizer": 8 * shard(stage >= 1) + 4 * lay["pieces"]}
        assert rec["mem"] == exact
        formula = zero.memory_formula(stage, lay["psi"], world)
        # the paper's formula, up to padding (< N elements per unit) and step counters
        for kind in formula:
            assert (abs(rec["mem"][kind] - formula[kind])
                    <= 8 * world * len(lay["S"]) + 4 * lay["pieces"]), kind


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_state_is_never_whole(ranks, stage):
    # Stage 2: the full gradient of the whole model never exists at once (the reduce-scatter runs
    # during backward and frees each unit's). Stage 3: neither do the full parameters.
    world, results, cuda = ranks
    if world == 1:
        pytest.skip("with one rank a shard is the whole model")
    for res in results:
        for case in CASES:
            rec = res[(stage, case)]
            full, units = 4 * world * sum(rec["layout"]["S"]), len(rec["layout"]["S"])
            # full gradients of one or two units at a time
            assert 1 <= rec["grads_held"] <= 2 < units
            if stage == 3:
                # at most three at once: the one computing, the next one prefetched, and the root
                # (or, with the tied head in a unit of its own, the embedding's unit)
                assert 1 <= rec["gathered"] <= 3 and (units <= 3 or rec["gathered"] < units)
            assert rec["in_flight"] <= 1  # overlap keeps one reduce-scatter in flight, as FSDP2
        # in bytes too, without overlap's in-flight buffers (with N = 2 the tiny Net's root unit
        # plus a block is more than the model)
        if world == 4:
            off = res[(stage, "no-overlap")]
            full = 4 * world * sum(res[(stage, "adamw")]["layout"]["S"])
            assert 0 < off["grads"] < full
            assert 0 < off["params"] < full if stage == 3 else off["params"] == full


@pytest.mark.parametrize("stage", range(4))
def test_peak_follows_every_change(ranks, stage):
    # opt.peak grows from a running total that Meter.event corrects one unit at a time, where
    # memory changes. Sampled from inside forward and backward, the total equals a full
    # measurement (memory_breakdown()) every time: no change goes uncounted.
    world, results, cuda = ranks
    for res in results:
        for key in [(stage, case) for case in CASES] + [(stage, "no-overlap"), (stage, "bf16")]:
            assert res[key]["untracked"] == 0, key
        # and the moment a backward hands over a new gradient (after zero_grad(): .grad None):
        # autograd's tensor beside the unit's buffer until it is copied in, counted for the
        # largest parameter too (stage 0's peak held nothing else beyond what it keeps)
        for case in CASES if stage == 0 else []:
            rec = res[(stage, case)]
            assert rec["peak"]["grads"] >= rec["mem"]["grads"] + 4 * V * D, (case, rec["peak"])


# ----------------------------------------------------------------------------------------------
# Communication: the bytes counted from the calls made equal the formula

def expected_comm(stage, case, world, lay):
    """Ring bytes per step for the Net, from its unit sizes (so padding is exact)."""
    ring = 4 * (world - 1) * sum(lay["S"])  # (N-1)/N x 4 bytes x every padded parameter
    k = CASES[case]["accum"]
    root = 4 * (world - 1) * sum(s for s, r in zip(lay["S"], lay["root"]) if r)
    emb = 4 * (world - 1) * sum(s for s, e in zip(lay["S"], lay["emb"]) if e)
    want = [{"all_reduce": 2 * ring}, {"reduce_scatter": ring, "all_gather": ring},
            {"reduce_scatter": k * ring, "all_gather": ring},
            # forward + backward, minus the root's backward gather (kept from forward); the "adamw"
            # units have emb and head apart, so emb is gathered once more, for the head's forward
            {"reduce_scatter": k * ring,
             "all_gather": k * (2 * ring - root + (emb if root == 0 else 0))}][stage]
    if CASES[case]["clip"] and stage >= 1:
        want["all_reduce"] = 2 * (world - 1) * 4 / world  # the sum of squares for the global norm
    want["all_reduce"] = want.get("all_reduce", 0) + CHECK * (world - 1) / world
    return want


CHECK = 2 * 16  # ring bytes of the per-step check that ranks agree (zero.check_step_agrees)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stage", range(4))
def test_communication_matches_formula(ranks, stage, case):
    world, results, cuda = ranks
    for res in results:
        rec = res[(stage, case)]
        want = expected_comm(stage, case, world, rec["layout"])
        for step in rec["comm"]:
            assert {k: v for k, v in step.items() if v} == {k: v for k, v in want.items() if v}
        if case == "sgd" and stage < 3:  # the paper's 2Ψ(N-1)/N, up to padding
            formula = sum(zero.comm_formula(stage, rec["layout"]["psi"], world).values())
            assert (abs(sum(rec["comm"][0].values()) - formula)
                    <= 8 * world * len(rec["layout"]["S"]))


@pytest.mark.parametrize("stage", range(4))
def test_every_backward_may_reduce(ranks, stage):
    # Without no_sync() every backward reduces (stages 2 and 3 always do): k = 2 reductions per
    # step, and the result is still the reference's.
    world, results, cuda = ranks
    want = reference("sgd-accum", world)
    for res in results:
        rec = res[(stage, "every-backward")]
        assert_trains_like(rec["full"], want, cuda)
        ring = 4 * (world - 1) * sum(rec["layout"]["S"])
        reductions = rec["comm"].get("all_reduce" if stage == 0 else "reduce_scatter", 0)
        check = CHECK * (world - 1) / world if stage == 0 else 0
        assert reductions == 2 * (2 * ring if stage == 0 else ring) + check


@pytest.mark.parametrize("stage", range(4))
def test_buckets_merge_and_split_units_and_change_nothing_else(ranks, stage):
    world, results, cuda = ranks
    want = reference("adamw", world)
    # Walking backwards from the head's bias (52 bytes), a bucket closes once it holds 300 bytes:
    # the norm and the last Linear of block 1 (388), then block 1's first Linear (308), block 0's
    # bias and last Linear (332), and what is left, block 0's first weight with the embedding.
    buckets = [["emb.weight", "blocks.0.0.weight"],
               ["blocks.0.0.bias", "blocks.0.2.weight", "blocks.0.2.bias"],
               ["blocks.1.0.weight", "blocks.1.0.bias"],
               ["blocks.1.2.weight", "blocks.1.2.bias", "norm.weight", "norm.bias", "head.bias"]]
    for res in results:
        rec, plain = res[(stage, "bucketed")], res[(stage, "adamw")]
        if stage == 3:
            # units as given: what a module gathers
            assert rec["layout"]["S"] == plain["layout"]["S"]
        else:
            assert rec["names"] == buckets
        assert_trains_like(rec["full"], want, cuda)
        for step in rec["comm"]:  # the same bytes as the formula, in fewer calls
            assert {k: v for k, v in step.items() if v} == {
                k: v for k, v in expected_comm(stage, "adamw", world, rec["layout"]).items() if v}


# ----------------------------------------------------------------------------------------------
# Overlap: asynchronous reductions (stages 0-2) and prefetched all-gathers (stage 3); the other
# ways of reducing on gloo

@pytest.mark.parametrize("stage", range(4))
def test_overlap_changes_nothing_but_timing(ranks, stage):
    world, results, cuda = ranks
    for res in results:
        on, off = res[(stage, "adamw")], res[(stage, "no-overlap")]
        # bit-identical (on a GPU: see there)
        assert_trains_like(on["full"], off["full"], cuda, tol=0)
        assert_trains_like(res[(stage, "sgd")]["full"], res[(stage, "no-overlap sgd")], cuda, tol=0)
        # Both runs are sampled under landed_only_when_waited: "in flight" is what zero.py has
        # issued and not waited for, whatever the backend had finished by then. (That the bytes
        # really move while backward computes is a matter of timing, and not asserted.) With
        # overlap, backward goes on while a reduction it launched is not waited for, and in stage
        # 3 while the next unit's all-gather is; without, every collective is waited for at once.
        assert on["in_flight"] >= 1 and off["in_flight"] == 0
        assert ((on["prefetching"] >= 1 if stage == 3 else on["prefetching"] == 0)
                and off["prefetching"] == 0)


@pytest.mark.parametrize("stage", range(4))
def test_each_way_of_reducing_trains_the_same(ranks, stage):
    world, results, cuda = ranks
    want = reference("adamw", world)
    for res in results:
        other, direct = res[(stage, "native")], res[(stage, "adamw")]
        assert_trains_like(other["full"], want, cuda)
        assert other["comm"] == direct["comm"]


@scenario(2, 4)
def collectives(rank, world):
    """zero.reduce_scatter / zero.all_gather (their own way on gloo) against gloo's own calls."""
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for S in (1, 5, 1000):
            g = torch.Generator().manual_seed(rank * 100 + S)
            x = torch.randn(world * S, generator=g).to(dtype)
            want = torch.empty(S, dtype=dtype)
            dist.reduce_scatter_tensor(want, x.clone())
            shard = torch.randn(S, generator=g).to(dtype)
            want_full = torch.empty(world * S, dtype=dtype)
            dist.all_gather_into_tensor(want_full, shard)
            for async_op in (False, True):
                # out separate, and out = this rank's slice of the input (how ZeRO1 calls it)
                got, y = torch.empty(S, dtype=dtype), x.clone()
                works = [zero.reduce_scatter(got, x.clone(), async_op=async_op),
                         zero.reduce_scatter(y[rank * S:(rank + 1) * S], y, async_op=async_op)]
                full, flat = (torch.empty(world * S, dtype=dtype),
                              torch.zeros(world * S, dtype=dtype))
                flat[rank * S:(rank + 1) * S] = shard
                works += [zero.all_gather(full, shard, async_op=async_op),
                          zero.all_gather(flat, flat[rank * S:(rank + 1) * S], async_op=async_op)]
                assert all(w is None for w in works) != async_op
                for w in works if async_op else []:
                    w.wait()
                out.append({"rs": [got, y[rank * S:(rank + 1) * S]], "rs_want": want,
                            "ag": [full, flat], "ag_want": want_full, "dtype": dtype})
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_direct_exchange_equals_the_native_collectives(ran, world):
    for rank_out in ran(collectives, world):
        for case in rank_out:
            tol = 1e-5 if case["dtype"] == torch.float32 else 2e-2
            for got in case["rs"]:
                assert torch.allclose(got.float(), case["rs_want"].float(), atol=tol, rtol=tol)
            for got in case["ag"]:
                assert torch.equal(got, case["ag_want"])  # data movement only: exact


# ----------------------------------------------------------------------------------------------
# Mixed precision: bf16 compute, fp32 masters, the paper's memory rows

@pytest.mark.parametrize("stage", range(4))
def test_mixed_precision_memory_matches_the_paper(ranks, stage):
    world, results, cuda = ranks
    for res in results:
        rec = res[(stage, "bf16")]
        padded = world * sum(rec["layout"]["S"])
        shard = lambda sharded: padded // world if sharded else padded
        assert rec["dtypes"] == {"torch.bfloat16"}  # every parameter computes in bf16
        # 2 + 2 + 12 bytes per parameter: bf16 params and grads; fp32 master, m and v (K = 12)
        assert rec["mem"] == {"params": 2 * shard(stage >= 3), "grads": 2 * shard(stage >= 2),
                              "optimizer": 12 * shard(stage >= 1) + 4 * rec["layout"]["pieces"]}
        # each reduction in flight holds an fp32 copy of its unit's gradient: one at a time, also
        # in stage 0 (whose in-place fp32 all-reduces may all be in flight at once)
        assert rec["in_flight"] <= 1
        # and the step an fp32 copy of every gradient element stepped, beside the bf16 gradients
        # held between steps: counted in the peak (the paper's formula has no row for it)
        assert rec["peak"]["grads"] >= rec["mem"]["grads"] + 4 * shard(stage >= 1), rec["peak"]


@pytest.mark.parametrize("stage", range(4))
def test_mixed_precision_trains_close_to_fp32(ranks, stage):
    world, results, cuda = ranks
    want = reference("adamw", world)
    initial = {n: p.detach() for n, p in Net(seed=100).named_parameters()}
    got = results[0][(stage, "bf16")]["full"]
    names = [n for n in want if n != "frozen.weight"]
    assert all(got[n].dtype == torch.float32 for n in names)  # full_state_dict: the fp32 masters
    off = sum((got[n] - want[n]).pow(2).sum() for n in names).sqrt()
    moved = sum((want[n] - initial[n]).pow(2).sum() for n in names).sqrt()
    assert off < 0.1 * moved, (off, moved)


@pytest.mark.parametrize("stage", range(4))
def test_mixed_precision_communication(ranks, stage):
    # bf16 all-gathers (2 bytes per element), fp32 reductions (4), or bf16 ones when asked
    world, results, cuda = ranks
    rec = results[0][(stage, "bf16")]
    fp32 = expected_comm(stage, "adamw", world, rec["layout"])
    want = {k: v / 2 if k == "all_gather" else v for k, v in fp32.items()}
    assert {k: v for k, v in rec["comm"].items() if v} == {k: v for k, v in want.items() if v}
    if stage == 2:
        got = results[0][(2, "bf16-reduce")]["comm"]
        assert got["reduce_scatter"] == fp32["reduce_scatter"] / 2


def test_dropped_models_are_freed(ranks):
    # The gradient hooks live on the parameters, out of the garbage collector's sight: they must
    # not keep a dropped ZeRO object, and with it the whole model state, alive.
    world, results, cuda = ranks
    assert [res["params_alive"] for res in results] == [0] * world


# ----------------------------------------------------------------------------------------------
# Parameters without a gradient, as plain torch: unused in a step, frozen after wrap(), a
# gradient accumulated out of place

class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, h, use_b):
        return self.a(h) + (self.b(h) if use_b else 0)


class Sometimes(nn.Module):
    """Parameters that some steps leave unused: mid.b except at step 1 (part of a unit), extra
    only at step 2 (a whole unit)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.first, self.mid, self.extra, self.last = (nn.Linear(D, D), Pair(), nn.Linear(D, D),
                                                       nn.Linear(D, V))
        self.step = 0

    def forward(self, x):
        h = self.mid(torch.tanh(self.first(x)), use_b=self.step != 1)
        h = h + (self.extra(h) if self.step == 2 else 0)
        return self.last(h)


def sometimes_steps(model, opt, rows, world, create_graph, set_to_none=True):
    # 4 steps of 2 micro-batches; on even steps model.zero_grad() too (every p.grad None), or
    # set_to_none=False throughout: a .grad of zeros is a gradient, which torch steps.
    for step in range(4):
        model.step = step
        for micro in range(2):
            g = torch.Generator().manual_seed(10 * step + micro)
            x, y = (torch.randn(world * B, D, generator=g)[rows],
                    torch.randint(V, (world * B,), generator=g)[rows])
            with (opt.no_sync() if hasattr(opt, "no_sync") and micro == 0
                  else contextlib.nullcontext()):
                F.cross_entropy(model(x), y).div(2).backward(create_graph=create_graph)
        opt.step()  # the reference: plain torch, which skips a parameter whose .grad is None
        opt.zero_grad(set_to_none=set_to_none)
        if step % 2 == 0 and set_to_none:
            model.zero_grad()


SOMETIMES_OPTIMIZERS = {"adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
                        "sgd": functools.partial(torch.optim.SGD, lr=0.1)}  # SGD: sees a factor off


@scenario(2)
def sometimes(rank, world):
    out = {}
    for stage in range(4):
        for create_graph in (False, True) if stage < 2 else (False,):
            for name, optimizer in SOMETIMES_OPTIMIZERS.items():
                model = Sometimes()
                opt = zero.wrap(model, stage, optimizer,
                                units=[model.first, model.mid, model.extra, model.last])
                sometimes_steps(model, opt, slice(rank * B, (rank + 1) * B), world, create_graph)
                out[(stage, create_graph, name)] = opt.full_state_dict()
        model = Sometimes()  # zero_grad(set_to_none=False)
        opt = zero.wrap(model, stage, SOMETIMES_OPTIMIZERS["adamw"],
                        units=[model.first, model.mid, model.extra, model.last])
        sometimes_steps(model, opt, slice(rank * B, (rank + 1) * B), world, False,
                        set_to_none=False)
        out[(stage, "zeros", "adamw")] = opt.full_state_dict()
    return out


def test_unused_parameters_and_out_of_place_accumulation(ran):
    # Stages 0 and 1 keep p.grad as a view into their buffer and do not zero it in zero_grad():
    # a gradient that arrives as a new tensor (after zero_grad, or accumulated out of place by
    # create_graph=True) is copied over last step's values, and a parameter that gets none has its
    # values zeroed. Wrong either way, these runs would differ from the reference. A parameter
    # unused in a step is not stepped at all, as plain torch skips it (AdamW's decay would show).
    # zero_grad(set_to_none=False) keeps zeros, which both step (AdamW decays a parameter unused).
    world, want = 2, {}
    for name, optimizer in [*SOMETIMES_OPTIMIZERS.items(),
                            ("zeros", SOMETIMES_OPTIMIZERS["adamw"])]:
        model = Sometimes()
        sometimes_steps(model, optimizer(model.parameters()), slice(None), world, False,
                        set_to_none=name != "zeros")
        want[name] = {n: p.detach() for n, p in model.named_parameters()}
    # they differ
    assert (want["zeros"]["extra.weight"] - want["adamw"]["extra.weight"]).abs().max() > 1e-4
    for res in ran(sometimes, 2):
        for (stage, create_graph, opt_name), got in res.items():
            for name, t in got.items():
                key = "zeros" if create_graph == "zeros" else opt_name
                assert (t - want[key][name]).abs().max().item() <= 1e-5, \
                    (stage, create_graph, opt_name, name)


@dataclasses.dataclass
class Hidden:  # a unit's output as models return them: a record, not a tensor
    h: torch.Tensor
    note: str = "hidden"


class Slotted:  # an output whose tensor zero.py cannot find (no __dict__): the unit stays gathered
    __slots__ = ("h",)

    def __init__(self, h):
        self.h = h


class RecordBlock(nn.Module):
    def __init__(self, record):
        super().__init__()
        self.fc, self.record = nn.Linear(D, D), record

    def forward(self, h):
        return self.record(torch.tanh(self.fc(h)))


class Tasks(nn.Module):
    """Units: two blocks (one returns a dataclass, one a __slots__ object), the head, and an
    auxiliary head used on odd steps only (a whole unit no rank uses on even steps). In the root
    unit: `first`, and `rare`, used only on the rows a step selects (on no rank at step 0, on rank
    0 only at step 1). `first.weight` is frozen from step 2 on, after wrap()."""

    def __init__(self, seed=11):
        super().__init__()
        torch.manual_seed(seed)
        self.first, self.rare = nn.Linear(D, D), nn.Linear(D, V)
        self.blocks = nn.ModuleList([RecordBlock(Hidden), RecordBlock(Slotted)])
        self.head, self.aux = nn.Linear(D, V), nn.Linear(D, V)
        self.step = 0

    def forward(self, x, use_rare):
        h = self.first(x)
        for block in self.blocks:
            h = h + block(h).h
        out = self.head(h)
        if use_rare.any():
            out = out + self.rare(h) * use_rare[:, None]
        return out + (self.aux(h) if self.step % 2 else 0)


# decay: a stepped parameter moves
TASKS_OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
RARE_ROWS = {0: [], 1: [0], 2: [0, -1], 3: [-1]}  # step -> rows of the global batch that use `rare`


def tasks_steps(model, opt, rows, world, steps, around_step=None):
    for step in steps:
        model.step = step
        if step >= 2:
            # the fine-tuning schedule: frozen mid-training
            model.first.weight.requires_grad_(False)
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(world * B, D, generator=g), torch.randint(V, (world * B,), generator=g)
        use_rare = torch.zeros(world * B, dtype=torch.bool)
        use_rare[RARE_ROWS[step]] = True
        F.cross_entropy(model(x[rows], use_rare[rows]).float(), y[rows]).backward()
        (around_step or (lambda step, do: do()))(step, opt.step)
        opt.zero_grad()


@functools.lru_cache(maxsize=None)
def tasks_reference(world):
    model = Tasks()
    tasks_steps(model, TASKS_OPTIMIZER(model.parameters()), slice(None), world, range(4))
    return {n: p.detach() for n, p in model.named_parameters()}


# step -> what no rank gives a gradient
UNUSED = {0: {"aux.weight", "aux.bias", "rare.weight", "rare.bias"}, 1: set(),
          2: {"aux.weight", "aux.bias", "first.weight"}, 3: {"first.weight"}}


def snapshot(opt):
    """Every parameter's fp32 values, the optimizer state of the pieces each one owns on this rank,
    and the aux unit's compute copy (bf16 in mixed precision)."""
    names, state = {p: n for n, p in opt.model.named_parameters()}, {}
    for u in opt.units:
        for piece, owners in zip(u.pieces, u.owners):
            for p in owners:
                state.setdefault(names[p], []).append(
                    {k: v.clone() for k, v in opt.optimizer.state.get(piece, {}).items()})
    aux = next(u for u in opt.units if opt.model.aux in u.modules)
    return {"values": opt.full_state_dict(), "state": state, "aux compute": aux.shard.clone()}


@scenario(2, 4)
def tasks(rank, world):
    out, rows = {}, slice(rank * B, (rank + 1) * B)
    if world == 4:  # hybrid sharding: G = 2 groups of 2
        runs = [(stage, dict(shard_size=2)) for stage in range(1, 4)]
    else:
        runs = [(stage, kwargs) for stage in range(4)
                for kwargs in ({}, dict(param_dtype=torch.bfloat16))]
        runs.append((2, dict(check_steps=False)))  # the mask's all-reduce is made without the check
    for stage, kwargs in runs:
        model = Tasks()
        opt = zero.wrap(model, stage, TASKS_OPTIMIZER, units=[*model.blocks, model.head, model.aux],
                        **kwargs)
        rec = {"around": {}, "gathered": []}
        modules = {"blocks.0": model.blocks[0], "blocks.1": model.blocks[1], "head": model.head,
                   "aux": model.aux}
        units = {n: next(u for u in opt.units if m in u.modules) for n, m in modules.items()}

        def after_forward(module, args, output):
            if module.step == 0:  # which units the first forward left gathered
                rec["after_forward"] = {n: u.gathered for n, u in units.items()}
        model.register_forward_hook(after_forward)

        def around_step(step, do):
            # after backward
            rec["gathered"].append(any(u.gathered for u in opt.units if u.modules))
            before, none = snapshot(opt), {n for n, p in model.named_parameters() if p.grad is None}
            do()
            rec["around"][step] = (before, snapshot(opt))
            rec.setdefault("grad None", {})[step] = (
                none, {n for n, p in model.named_parameters() if p.grad is None})
        tasks_steps(model, opt, rows, world, range(4), around_step)
        rec["full"] = opt.full_state_dict()
        rec["per parameter"] = [u.per_parameter for u in opt.units]  # which units were cut again
        out[(stage, str(kwargs))] = rec
    return out


@pytest.fixture(scope="module")
def tasks_runs(ran):
    return ran(tasks, 2), ran(tasks, 4)


def test_unused_and_frozen_parameters_are_not_stepped_as_in_torch(tasks_runs):
    # AdamW's weight decay moves any parameter it steps. The aux head unused on even steps,
    # `rare` unused at step 0 (used on one rank only at steps 1 and 3: the mean over ranks), and
    # first.weight frozen after wrap() from step 2 on train exactly as plain torch trains them:
    # at every stage, in mixed precision, with hybrid sharding, without the per-step check.
    for world, results in zip((2, 4), tasks_runs):
        want = tasks_reference(world)
        initial = {n: p.detach() for n, p in Tasks().named_parameters()}
        for res in results:
            for key, rec in res.items():
                got = rec["full"]
                if "bfloat16" in key[1]:  # bf16 compute: close, not equal
                    off = sum((got[n] - want[n]).pow(2).sum() for n in want).sqrt()
                    assert off < 0.1 * sum((want[n] - initial[n]).pow(2).sum()
                                           for n in want).sqrt(), key
                else:
                    for name, t in want.items():
                        assert (got[name] - t).abs().max().item() <= 1e-5, (world, key, name)
                # A parameter no rank gave a gradient did not move, not by a bit (nor its bf16
                # compute copy), and its optimizer state (Adam's m, v, step) is as it was: none
                # at all if it was never stepped. Every other parameter moved.
                for step, (before, after) in rec["around"].items():
                    for name in want:
                        same = torch.equal(before["values"][name], after["values"][name])
                        assert same == (name in UNUSED[step]), (world, key, step, name)
                        for a, b in zip(before["state"].get(name, []),
                                        after["state"].get(name, [])):
                            assert (a.keys() == b.keys()
                                    and all(torch.equal(a[k], b[k]) for k in a)) == same
                    assert (torch.equal(before["aux compute"], after["aux compute"])
                            == (step % 2 == 0))
                    # no optimizer state until aux's first step (step 1)
                    aux = before["state"]["aux.weight"]
                    assert aux and all(s == {} for s in aux) == (step <= 1)
                if key[0] == 3:  # after backward only the root unit may still be gathered: none is
                    assert rec["gathered"] == [False] * 4
                # Pieces per parameter only where a piece held parameters with and without a
                # gradient: the root unit (first and rare) on rank 0, never a unit used whole or
                # not at all
                assert (rec["per parameter"][:4] == [False] * 4
                        and (rec["per parameter"][4] or res is not results[0]))


def test_an_unused_parameters_grad_is_none_as_in_torch(tasks_runs):
    # After backward, .grad is None for what this rank did not use (stages 2 and 3: for every
    # parameter, their gradients live in shards); after step() at stages 0 and 1, for what no rank
    # used only, as DDP: `rare`, used on one rank at steps 1 and 3, shows the mean on the other.
    for world, results in zip((2, 4), tasks_runs):
        names = set(tasks_reference(world))
        for rank, res in enumerate(results):
            for key, rec in res.items():
                for step, (after_backward, after_step) in rec["grad None"].items():
                    rare = {"rare.weight", "rare.bias"}
                    here = any(i % (world * B) // B == rank for i in RARE_ROWS[step])
                    want = ((names, names) if key[0] >= 2
                            else (UNUSED[step] | (set() if here else rare), UNUSED[step]))
                    assert (after_backward, after_step) == want, (world, rank, key, step)


def test_stage3_hooks_a_unit_output_of_any_structure(tasks_runs):
    # The dataclass block is freed after forward and gathered again when backward reaches its
    # output; the __slots__ block, whose output hides its tensor, stays gathered until its
    # gradient is reduced. Both train exactly (test above).
    for results in tasks_runs:
        for res in results:
            rec = res[(3, "{}")] if (3, "{}") in res else res[(3, "{'shard_size': 2}")]
            assert rec["after_forward"] == {"blocks.0": False, "blocks.1": True, "head": False,
                                            "aux": False}


def test_output_tensors_are_found_at_any_depth():
    # What stage 3 hooks to gather a unit again in backward: the tensors of its module's output,
    # in tuples (named ones too), lists, dicts, dataclasses and objects' attributes, each once.
    t = [torch.full((1,), float(i)) for i in range(6)]
    Pair = collections.namedtuple("Pair", "a b")

    @dataclasses.dataclass
    class Record:
        a: torch.Tensor
        rest: dict

    class Obj:
        def __init__(self):
            # a cycle; a module is not opened
            self.x, self.me, self.module = t[4], self, nn.Linear(1, 1)
    hidden = Slotted(t[5])
    output = {"pair": Pair(t[0], [t[1]]), "record": Record(t[2], {"k": (t[3], "text")}),
              "obj": Obj(), "slots": hidden, "none": None}
    assert [id(x) for x in zero.output_tensors(output)] == [id(x) for x in t[:5]]


def test_a_parameter_unfrozen_after_wrap_is_refused_by_name(one_rank):
    # Frozen at wrap(), it belongs to no unit: made trainable later, nothing would reduce or step
    # it. step() refuses, naming it, before anything is applied.
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, V))
    model[0].requires_grad_(False)
    opt = zero.wrap(model, 2, functools.partial(torch.optim.SGD, lr=0.1))
    before = opt.full_state_dict()
    model[0].weight.requires_grad_(True)
    model(torch.ones(B, D)).sum().backward()
    with pytest.raises(RuntimeError) as e:
        opt.step()
    assert str(e.value).startswith("zero: 0.weight was frozen at wrap() and requires grad now")
    assert "wrap it again" in str(e.value)
    assert all(torch.equal(t, opt.full_state_dict()[n]) for n, t in before.items())


# ----------------------------------------------------------------------------------------------
# Training code as users write it: buffers, full parameters for a moment, gradients in any
# dtype, torch's conventions, sparse gradients refused, three ranks and two dtypes

class Normed(nn.Module):
    """BatchNorm first, so that its running statistics depend on the data alone, not on weights."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.norm, self.blocks = nn.BatchNorm1d(D), nn.Sequential(nn.Linear(D, D), nn.Linear(D, V))

    def forward(self, x):
        return self.blocks(self.norm(x))


def normed_steps(model, opt, rows, world, seen=None):
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randn(world * B, D, generator=g) * (step + 1) + step,
                torch.randint(V, (world * B,), generator=g))
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()


@scenario(2)
def buffers_runs(rank, world):
    out = {}
    for stage in range(4):
        for buffers in ("none", "broadcast"):
            model = Normed()
            opt = zero.wrap(model, stage, TASKS_OPTIMIZER, units=list(model.blocks),
                            buffers=buffers)
            starts = []  # the buffers as each forward starts (after zero.py's broadcast, if any)
            model.register_forward_pre_hook(
                lambda m, a: starts.append({n: b.clone() for n, b in model.named_buffers()}))
            normed_steps(model, opt, slice(rank * B, (rank + 1) * B), world)
            out[(stage, buffers)] = {"starts": starts,
                                     "end": {n: b.clone() for n, b in model.named_buffers()},
                                     "comm": dict(opt.comm)}
    try:
        zero.wrap(Normed(), 0, TASKS_OPTIMIZER, buffers="broadcast" if rank else "none")
    except ValueError as e:
        out["disagree"] = str(e)
    return out


def test_buffers_broadcast_or_kept_per_rank(ran, one_rank):
    # BatchNorm on N ranks normalizes by each rank's batch (as plain DDP without SyncBatchNorm),
    # so no choice makes its running statistics those of plain torch on the global batch:
    #   "none" (default): rank r's statistics are plain torch's fed rank r's rows, each rank its
    #     own; the mean over ranks of running_mean is plain torch's on the global batch (the
    #     update is linear in the batch mean); running_var is not (the variance is not).
    #   "broadcast": every forward starts from rank 0's on every rank, plain torch's fed rank 0's
    #     rows; after the last forward each rank has added its own batch once.
    world, runs = 2, ran(buffers_runs, 2)

    def plain(rows):
        model, stats = Normed(), []
        model.register_forward_pre_hook(
            lambda m, a: stats.append({n: b.clone() for n, b in model.named_buffers()}))
        normed_steps(model, torch.optim.SGD(model.parameters(), lr=0), rows, world)
        return stats, {n: b.clone() for n, b in model.named_buffers()}
    per_rank = [plain(slice(r * B, (r + 1) * B)) for r in range(world)]
    whole = plain(slice(None))[1]
    for stage in range(4):
        none, broadcast = ([res[(stage, b)] for res in runs] for b in ("none", "broadcast"))
        for rank in range(world):
            for got, want in zip(none[rank]["starts"] + [none[rank]["end"]],
                                 per_rank[rank][0] + [per_rank[rank][1]]):
                assert all(torch.allclose(got[n], want[n]) for n in want), (stage, rank)
            assert not torch.allclose(none[rank]["end"]["norm.running_var"],
                                      whole["norm.running_var"])
            # rank 0's, on every rank
            for got, want in zip(broadcast[rank]["starts"], per_rank[0][0]):
                assert all(torch.allclose(got[n], want[n]) for n in want), (stage, rank)
            assert (broadcast[rank]["comm"]["broadcast"] > 0
                    and "broadcast" not in none[rank]["comm"])
        mean = (none[0]["end"]["norm.running_mean"] + none[1]["end"]["norm.running_mean"]) / 2
        assert torch.allclose(mean, whole["norm.running_mean"], atol=1e-6)
        assert not torch.allclose(none[0]["end"]["norm.running_mean"],
                                  none[1]["end"]["norm.running_mean"])
    for res in runs:
        assert res["disagree"].startswith("zero: ranks disagree: rank 0 has buffers")
    with pytest.raises(ValueError,
                       match="^zero: buffers must be 'broadcast' or 'none', not 'sync'$"):
        zero.wrap(Normed(), 0, TASKS_OPTIMIZER, buffers="sync")


@scenario(2)
def gathered_runs(rank, world):
    # opt.gathered(): full values to read (and a no_grad forward inside), one block alone, what
    # is written kept (writeback: rank 0's wins, into shards and fp32 masters), and refused
    # inside a forward; at every stage, in fp32 and bf16, each rank's weights different at first.
    out, x = {}, global_batch(0, 0, world)[0]
    for stage in range(4):
        for dtype in (None, torch.bfloat16):
            model, opt = wrapped(rank, stage, "adamw", seed=100, param_dtype=dtype)
            run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"],
                      slice(rank * B, (rank + 1) * B), world, 1)
            rec = {"full": opt.full_state_dict(), "outside": opt.memory_breakdown()["params"]}
            with opt.gathered():
                rec["inside"] = opt.memory_breakdown()["params"]
                rec["read"] = {n: p.detach().clone() for n, p in model.named_parameters()}
                with torch.no_grad():
                    rec["logits"] = model(x).float()
            rec["after"] = opt.memory_breakdown()["params"]
            with opt.gathered(model.blocks[0]):
                rec["one block"] = [u.gathered for u in opt.units]
            with opt.gathered(model.blocks[1], writeback=True), torch.no_grad():
                model.blocks[1][0].weight.fill_(rank + 1.0)  # rank 0's 1.0 wins
                model.blocks[1][0].bias[0] = rank + 1.0
            rec["written"] = opt.full_state_dict()
            with opt.gathered():
                rec["compute"] = model.blocks[1][0].weight.detach().clone()
            with opt.gathered(writeback=True):  # written and read back: nothing else moves
                pass
            rec["rewritten"] = opt.full_state_dict()

            def inside(module, args):
                with opt.gathered():
                    pass
            model.blocks[0].register_forward_pre_hook(inside)
            try:
                with torch.no_grad():
                    model(x[rank * B:(rank + 1) * B])
            except RuntimeError as e:
                rec["refused"] = str(e)
            out[(stage, str(dtype))] = rec
    return out


def test_gathered_parameters_read_write_back_and_memory(ran):
    world = 2
    for stage in range(4):
        for dtype in ("None", "torch.bfloat16"):
            recs = [res[(stage, dtype)] for res in ran(gathered_runs, 2)]
            plain = Net(seed=100)
            plain.load_state_dict(recs[0]["full"], strict=False)
            with torch.no_grad():
                want = plain(global_batch(0, 0, world)[0])
            for rec in recs:
                exact = dtype == "None"
                for name, t in rec["full"].items():  # what a reader sees: the model's values
                    got = rec["read"][name].float()
                    assert (torch.equal(got, t) if exact
                            else torch.allclose(got, t, atol=1e-2)), (stage, dtype, name)
                assert torch.allclose(rec["logits"], want,
                                      atol=1e-5 if exact else 0.1), (stage, dtype)
                # stage 3 holds the full parameters inside only (once more than its 1/N shards)
                assert ((rec["inside"] > rec["outside"]) == (stage == 3)
                        and rec["after"] == rec["outside"])
                assert rec["one block"] == [stage < 3 or i == 1
                                            for i in range(len(rec["one block"]))]
                # rank 0's value, exactly, in the fp32 masters
                w = rec["written"]["blocks.1.0.weight"]
                assert (torch.equal(w, torch.ones_like(w))
                        and rec["written"]["blocks.1.0.bias"][0] == 1.0)
                assert torch.equal(rec["compute"], torch.ones_like(rec["compute"]))
                for name, t in rec["written"].items():
                    if name not in ("blocks.1.0.weight", "blocks.1.0.bias"):
                        # fp32 bits kept
                        assert torch.equal(t, rec["full"][name]), (stage, dtype, name)
                    assert torch.equal(rec["rewritten"][name], t), (stage, dtype, name)
                assert rec["refused"].startswith(
                    "zero: optimizer.gathered() inside a forward or backward")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_clipping_in_any_dtype_is_torchs(one_rank, dtype):
    # The norm is taken in the gradients' dtype, at least float32 (bf16 squares would round
    # away): float64 gradients keep float64, as torch's clip_grad_norm_ does (float32 raised).
    torch.manual_seed(0)
    model, x = (nn.Sequential(nn.Linear(D, D), nn.Linear(D, V)).to(dtype),
                torch.randn(B, D, dtype=dtype))
    plain = copy.deepcopy(model)
    opt = zero.wrap(model, 1, functools.partial(torch.optim.SGD, lr=0.1))
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    norm = opt.clip_grad_norm_(0.1)
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    if dtype == torch.float64:
        assert norm.dtype == torch.float64 and torch.allclose(norm, expected, rtol=1e-12)
    else:  # torch's bf16 norm is rounded to bf16's 8 bits; zero.py's is fp32
        assert norm.dtype == torch.float32 and torch.allclose(norm, expected.float(), rtol=1e-2)


class Three(nn.Sequential):
    def forward(self, x, use_middle):
        return self[2](self[1](self[0](x)) if use_middle else self[0](x))


@pytest.mark.parametrize("stage", range(4))
def test_torch_gradient_conventions_and_conversions(one_rank, stage):
    # As plain torch: an unused parameter's .grad is None after backward;
    # zero_grad(set_to_none=False) leaves zeros, which backward adds to and AdamW steps (the
    # middle layer, used at step 0 only, decays at step 1). model.to()/.float()/.half() work where
    # they change nothing and are refused in one line where they would convert a unit's
    # parameters.
    def build():
        torch.manual_seed(3)
        return Three(nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, V))
    plain, model = build(), build()
    ref = TASKS_OPTIMIZER(plain.parameters())
    opt = zero.wrap(model, stage, TASKS_OPTIMIZER, units=[model[0], model[1]])
    for bad, named in ((model.half, "0.weight"),
                       (functools.partial(model.to, torch.float64), "0.weight"),
                       (model[1].double, "1.weight"),
                       (model[2].half, "2.weight")):  # the module's own
        with pytest.raises(RuntimeError) as e:
            bad()
        assert str(e.value).startswith(f"zero: converting the wrapped model would make {named} ")
        assert "before wrap()" in str(e.value) and "\n" not in str(e.value)
    model.to("cpu").float().to(torch.float32)  # nothing to convert: fine
    x = torch.randn(B, D)
    for step in range(3):  # zero_grad(set_to_none=False) after step 0 only
        for m, o in ((plain, ref), (model, opt)):
            m(x * (step + 1), use_middle=step == 0).square().sum().backward()
            if step > 0:  # the middle layer unused: zeros kept at step 1, None at step 2 (as torch)
                assert (m[1].weight.grad is None) == (step == 2 or o is opt and stage >= 2)
                assert (m[0].weight.grad is None) == (o is opt and stage >= 2)
            o.step()
            o.zero_grad(set_to_none=step > 0)
        if step == 0 and stage < 2:  # zeros kept as views, as torch keeps its tensors
            assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    for name, t in opt.full_state_dict().items():
        assert torch.allclose(t, dict(plain.named_parameters())[name], atol=1e-6), name


class Empty(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Parameter(torch.zeros(0))

    def forward(self, h):
        return h + self.e.sum()


class Reads(nn.Module):
    """Its forward reads a block's weight (read()) before the blocks compute."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.emb, self.blocks = nn.Embedding(V, D), nn.ModuleList(nn.Linear(D, D) for _ in "ab")
        self.empty, self.read = Empty(), None  # a unit of zero elements

    def forward(self, x):
        h = self.empty(self.emb(x) * (self.read().sum() if self.read else 1))
        for block in self.blocks:
            h = block(h)
        return h @ self.emb.weight.T


def test_stage3_refuses_values_read_outside_their_modules(one_rank):
    # A block's weight read by the root before the block computes: from the second step its unit
    # is prefetched then, its memory there and its values on the way (2 ranks: off by 1e-2,
    # silently); refused as when not prefetched. So is .T, a view of the values (a raw torch
    # error before), and a weight inside a list or given by keyword (torch read the freed memory:
    # a crash, or a raw error). A unit of zero elements is gathered as any other (refused before).
    for read in (lambda m: m.blocks[0].weight, lambda m: m.blocks[1].weight.T,
                 lambda m: torch.cat([m.blocks[0].weight]),
                 lambda m: F.linear(input=torch.ones(D), weight=m.blocks[1].weight)):
        model = Reads()
        opt = zero.wrap(model, 3, functools.partial(torch.optim.SGD, lr=0.1),
                        units=[model.empty, *model.blocks])
        x = global_batch(0, 0, 1)[0]
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        model.read = functools.partial(read, model)
        with pytest.raises(RuntimeError, match=r"^zero: blocks\.\d\.weight is sharded at stage 3 "
                           "and not gathered now"):
            model(x)


class SparseLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.table, self.out = nn.Parameter(torch.randn(V, D)), nn.Linear(D, V)

    def forward(self, x):
        return self.out(F.embedding(x, self.table, sparse=True))


@pytest.mark.parametrize("stage", range(4))
def test_sparse_gradients_are_refused_by_name(one_rank, stage):
    # At wrap() for the modules that make them (sparse=True), in the first backward for any other
    optimizer = functools.partial(torch.optim.SGD, lr=0.1)
    for model, name in [(nn.Sequential(nn.Embedding(V, D, sparse=True)), "0.weight"),
                        (nn.ModuleDict({"bag": nn.EmbeddingBag(V, D, sparse=True)}), "bag.weight")]:
        with pytest.raises(ValueError) as e:
            zero.wrap(model, stage, optimizer)
        assert str(e.value).startswith(f"zero: {name} would get sparse gradients")
    model = SparseLookup()
    opt = zero.wrap(model, stage, optimizer)  # kept: the hooks hold it weakly (gc may take it)
    with pytest.raises(RuntimeError) as e:
        model(torch.arange(B)).sum().backward()
    assert str(e.value).startswith("zero: table got a sparse gradient (torch.sparse_coo)")
    del opt


@pytest.mark.parametrize("stage", range(3))  # (stage 3: the resize itself is refused, sharded)
def test_a_parameter_given_new_data_after_wrap_is_refused_by_name(one_rank, stage):
    # as transformers' resize_token_embeddings() does: the unit's view is gone, its shape too
    model = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, V))
    opt = zero.wrap(model, stage, functools.partial(torch.optim.SGD, lr=0.1))  # (kept, as above)
    model[0].weight.data = torch.randn(V + 8, D)
    with pytest.raises(RuntimeError) as e:
        model(torch.arange(B)).sum().backward()
    assert str(e.value).startswith("zero: 0.weight has new .data since wrap()")
    del opt


@pytest.mark.parametrize("stage", range(4))
def test_a_step_of_the_torch_optimizer_alone_is_refused(one_rank, stage):
    # its pieces get their .grad in the wrapped step() only: it stepped nothing, silently
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, V))
    opt = zero.wrap(model, stage, functools.partial(torch.optim.SGD, lr=0.1))
    model(torch.randn(B, D)).sum().backward()
    with pytest.raises(RuntimeError, match=r"^zero: step the wrapped optimizer, opt.step\(\)"):
        opt.optimizer.step()
    opt.step()  # (the wrapped one steps it, as before)
    # a group added after wrap(): stepped on each rank's own gradients, the ranks apart
    opt.zero_grad()
    opt.optimizer.add_param_group({"params": [nn.Parameter(torch.ones(1))]})
    model(torch.randn(B, D)).sum().backward()
    with pytest.raises(RuntimeError, match=r"nor a group added since"):
        opt.step()


@pytest.mark.parametrize("stage", range(4))
def test_a_grad_set_by_hand_is_refused(one_rank, stage):
    # step() steps what backward put in the units: a p.grad = g (torch.autograd.grad's, a scaled
    # copy), after backward or after clipping, was ignored, silently. In place it is the gradient
    # stepped (stages 0, 1: p.grad is the unit's view).
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, V))
    opt = zero.wrap(model, stage, functools.partial(torch.optim.SGD, lr=0.1))
    for clip in (False, True):
        model(torch.randn(B, D)).sum().backward()
        if clip:
            opt.clip_grad_norm_(1.0)
        model[1].bias.grad = torch.zeros(V)
        with pytest.raises(RuntimeError, match=r"^zero: 1\.bias\.grad was set by hand since"):
            opt.step()
        opt.zero_grad()
        model[1].bias.grad = None
    if stage < 2:
        before = opt.full_state_dict()
        model(torch.randn(B, D)).sum().backward()
        for p in model.parameters():
            p.grad.mul_(0)
        opt.step()
        assert all(torch.equal(t, before[k]) for k, t in opt.full_state_dict().items())


def clip_values(optimizer, *_):  # a step pre-hook: torch's clip_grad_value_ on what it steps
    torch.nn.utils.clip_grad_value_([p for group in optimizer.param_groups for p in group["params"]
                                     if p.grad is not None], 0.02)


@scenario(2)
def grads_in_a_step_pre_hook(rank, world):
    out = {}
    for stage, overlap in itertools.product(range(4), (True, False)):
        model, opt = wrapped(rank, stage, "sgd", seed=100, overlap=overlap)
        opt.optimizer.register_step_pre_hook(clip_values)
        run_steps(model, opt, None, CASES["sgd"], slice(rank * B, (rank + 1) * B), world, STEPS)
        out[stage, overlap] = opt.full_state_dict()
    return out


def test_an_element_wise_gradient_transform_in_a_step_pre_hook_is_exact(ran):
    # Between backward and step(), p.grad is the global mean only at stage 0 with overlap (stage
    # 1: this rank's shard of the sum; overlap=False: the local gradient; stages 2, 3: None), so
    # clip_grad_value_ there trains otherwise. In a step pre-hook of opt.optimizer, each piece's
    # .grad is this rank's elements of the mean, at every stage: exactly torch's result.
    world, model = 2, Net(seed=100)
    torch_opt = CASES["sgd"]["optimizer"]([p for p in model.parameters() if p.requires_grad])
    torch_opt.register_step_pre_hook(clip_values)
    run_steps(model, torch_opt, None, CASES["sgd"], slice(None), world, STEPS)
    want = {n: p.detach() for n, p in model.named_parameters()}
    assert not all(torch.equal(want[n], t) for n, t in reference("sgd", world).items())  # clips
    for (stage, overlap), got in ran(grads_in_a_step_pre_hook, world)[0].items():
        assert_trains_like(got, want, what=f"stage {stage}, overlap={overlap}")


class TwoDtypes(nn.Module):
    """A float64 layer, then a float32 one: buckets must not mix them (one flat buffer, one
    dtype)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = nn.Linear(D, D).double(), nn.Linear(D, V)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.double())).float())


def two_dtypes_steps(model, opt, rows, world, steps=range(2)):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randn(world * B, D, generator=g)[rows],
                torch.randint(V, (world * B,), generator=g)[rows])
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@scenario(3)
def three_ranks(rank, world):
    out, rows = {}, slice(rank * B, (rank + 1) * B)
    for stage in range(3):
        model = TwoDtypes()
        opt = zero.wrap(model, stage, functools.partial(torch.optim.SGD, lr=0.1),
                        bucket_bytes=1 << 20)
        two_dtypes_steps(model, opt, rows, world)
        out[(stage, "two dtypes")] = ({n: t.double() for n, t in opt.full_state_dict().items()},
                                      [sorted({str(p.dtype) for p in u.params}) for u in opt.units])
    for stage in range(4):
        for case, no_sync in (("sgd", True), ("sgd-accum", True), ("sgd-accum", False)):
            for overlap in (True, False):
                model, opt = wrapped(rank, stage, case, seed=100, overlap=overlap)
                run_steps(model, opt, opt.clip_grad_norm_, CASES[case], rows, world, STEPS,
                          no_sync=no_sync)
                out[(stage, case, no_sync, overlap)] = opt.full_state_dict()
    return out


def test_three_ranks_match_the_reference(ran):
    # N = 3, where 1/N is not exact in binary, with overlap and without, one backward per step or
    # two (reduced in each, or in the last); shards of 401 / 3 elements: within rounding of the
    # reference.
    want = {case: reference(case, 3) for case in ("sgd", "sgd-accum")}
    model = TwoDtypes()
    two_dtypes_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), slice(None), 3)
    for res in (dict(r) for r in ran(three_ranks, 3)):
        for stage in range(3):  # and a model in two dtypes, bucketed: one bucket per dtype
            got, dtypes = res.pop((stage, "two dtypes"))
            assert dtypes == [["torch.float64"], ["torch.float32"]]
            for name, p in model.named_parameters():
                assert (got[name] - p.detach().double()).abs().max().item() <= 1e-5, (stage, name)
        for (stage, case, no_sync, overlap), got in res.items():
            for name, t in got.items():
                assert (t - want[case][name]).abs().max().item() <= 1e-5, \
                    (stage, case, no_sync, overlap, name)


def test_stage3_gathers_what_each_module_computes_with(one_rank):
    # A unit whose weight is tied to a root module's (the head a unit, the embedding in the
    # root): the root's forward gathers it too. A container unit around two nested units: its
    # forward gathers its own parameters only, not its children's units.
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(5)
            self.emb, self.mid, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)
            self.head.weight = self.emb.weight
            self.outer = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))

        def forward(self, x):
            return self.head(self.outer(torch.tanh(self.mid(self.emb(x)))))

    want = Tied()
    plain = torch.optim.SGD(want.parameters(), lr=0.1)
    model = Tied()
    opt = zero.wrap(model, 3, functools.partial(torch.optim.SGD, lr=0.1), overlap=False,
                    units=[model.head, model.mid, model.outer[0], model.outer[1], model.outer])
    seen = []
    model.outer[1].register_forward_pre_hook(
        lambda *_: seen.append(sum(u.gathered for u in opt.units if model.outer[0] in u.modules)))
    for step in range(2):
        x, y = global_batch(step, 0, 1)
        for m, o in ((want, plain), (model, opt)):
            F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
            o.step()
            o.zero_grad()
    got = opt.full_state_dict()
    for n, p in want.named_parameters():
        assert (got[n] - p.detach()).abs().max().item() <= 1e-6, n
    assert seen == [0, 0]  # outer[0]'s unit was freed before outer[1] computed, in both steps


# ----------------------------------------------------------------------------------------------
# Stage 3 in real code: activation checkpointing, reading parameters between steps, a second
# wrap, the blocks of real models found by default, ranks that disagree

class Deep(nn.Module):
    """Four blocks, each run under torch.utils.checkpoint when `mode` says so: (use_reentrant,
    early_stop), or None for no checkpointing."""

    def __init__(self, mode=None):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))
                                    for _ in range(4))
        self.head = nn.Linear(D, V)
        self.mode, self.only = mode, None  # only: compute with this one block alone

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks if self.only is None else [self.blocks[self.only]]:
            if self.mode is None:
                h = h + block(h)
            else:
                with torch.utils.checkpoint.set_checkpoint_early_stop(self.mode[1]):
                    h = h + torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.mode[0])
        return self.head(h)


CHECKPOINT_MODES = [(False, True), (False, False), (True, True)]  # early stop: the default


def deep_steps(model, opt, rows, world, steps=3, after_step=lambda: None):
    for step in range(steps):
        x, y = (t[rows] for t in global_batch(step, 0, world))
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        after_step()
        opt.zero_grad()


@scenario(2)
def real_code(rank, world):
    out, rows = {}, slice(rank * B, (rank + 1) * B)
    optimizer = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    for stage in range(4):
        for mode in CHECKPOINT_MODES:
            model = Deep(mode)
            opt = zero.wrap(model, stage, optimizer)
            seen = watch(model, opt)
            gathered_after = []
            deep_steps(model, opt, rows, world,
                       after_step=lambda: gathered_after.append(sum(u.gathered for u in opt.units)))
            out[(stage, mode)] = dict(seen, full=opt.full_state_dict(), units=len(opt.units),
                                      gathered_after=gathered_after)
    # Reading a stage-3 model between steps: what needs values is a clear error, the rest works
    model = Deep()
    opt = zero.wrap(model, 3, optimizer)
    deep_steps(model, opt, rows, world, steps=1)
    errors = {}
    for name, read in [("norm", lambda: float(model.head.weight.norm())),
                       ("print", lambda: str(model.blocks[0][0].bias)),
                       ("data", lambda: model.emb.weight.data.sum()),
                       ("state_dict", lambda: model.state_dict()),
                       ("save", lambda: torch.save(model.state_dict(), io.BytesIO()))]:
        try:
            read()
            errors[name] = None
        except RuntimeError as e:
            errors[name] = str(e)
    out["reads"] = {"errors": errors, "shape": tuple(model.head.weight.shape),
                    "full": opt.full_state_dict()["head.weight"].shape,
                    "eval": model(torch.zeros(1, T, dtype=torch.long)).shape}
    with torch.no_grad():  # evaluation between steps gathers and frees as training does
        out["reads"]["eval_no_grad"] = model(torch.zeros(1, T, dtype=torch.long)).shape
    try:
        zero.wrap(model, 3, optimizer)
        out["rewrap"] = None
    except ValueError as e:
        out["rewrap"] = str(e)
    # Ranks that disagree on a setting that changes what is communicated: every rank refuses
    out["disagree"] = {}
    other_lr = functools.partial(torch.optim.SGD, lr=0.2, momentum=0.9)  # (rank 1's)
    for name, stage, kwargs in [("param_dtype", 1, dict(param_dtype=torch.bfloat16)),
                                ("overlap", 0, dict(overlap=False)),
                                ("bucket_bytes", 2, dict(bucket_bytes=1024)), ("lr", 1, {})]:
        try:
            zero.wrap(Deep(), stage, other_lr if name == "lr" and rank == 1 else optimizer,
                      **(kwargs if rank == 1 else {}))
            out["disagree"][name] = None
        except ValueError as e:
            out["disagree"][name] = str(e)
    # Ranks that compute with different blocks of the same size: the reductions pair the wrong
    # units; the per-step check stops it before anything is applied
    out["swapped"] = {}
    for stage in range(4):
        model = Deep()
        opt = zero.wrap(model, stage, optimizer, units=list(model.blocks))
        before = opt.full_state_dict()
        x, y = (t[rows] for t in global_batch(0, 0, world))
        model.only = rank % 2  # rank 0 computes with block 0, rank 1 with block 1
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        try:
            opt.step()
            out["swapped"][stage] = (None, None)
        except RuntimeError as e:
            after = opt.full_state_dict()
            out["swapped"][stage] = (str(e), all(torch.equal(before[n], after[n]) for n in before))
    # Nodes launched apart: a flag, or the bytes of a file of the same name, that differ on one
    # rank. zero.train stops on every rank before training, naming what differs, both values
    out["apart"], home = {}, os.getcwd()
    node = os.path.join(os.environ["ZERO_TEST_TMP"], f"node{rank}")  # (this rank's "disk")
    os.makedirs(node, exist_ok=True)
    with open(os.path.join(node, "data.txt"), "w") as f:
        f.write("the same words on every rank " * 20 + "but not on this one" * rank)
    torch.save({"w": torch.full((8,), float(rank))}, os.path.join(node, "init.pt"))  # other values
    torch.save({"w": torch.zeros(8)}, os.path.join(node, "bad.pt"))
    if rank:
        open(os.path.join(node, "bad.pt"), "w").close()  # empty on rank 1's disk only
    for name, argv in [("seed", ["--seed", str(rank)]), ("data (sha256)", ["--data", "data.txt"]),
                       ("init-from", ["--init-from", "init.pt"]),
                       ("init-from unreadable", ["--init-from", "bad.pt"])]:
        os.chdir(node)
        try:
            zero.train(zero.check_args(zero.training_parser("").parse_args([*TINY, *argv])),
                       quiet=True)
            out["apart"][name] = None
        except zero.UsageError as e:
            out["apart"][name] = str(e)
        finally:
            os.chdir(home)
    return out


@pytest.fixture(scope="module")
def real_runs(ran):
    return ran(real_code, 2)


def deep_reference(world):
    model = Deep()
    deep_steps(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), slice(None), world)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", CHECKPOINT_MODES,
                         ids=lambda m: f"reentrant={m[0]}-early_stop={m[1]}")
@pytest.mark.parametrize("stage", range(4))
def test_activation_checkpointing_trains_like_the_reference(real_runs, stage, mode):
    want = deep_reference(2)
    for res in real_runs:
        rec = res[(stage, mode)]
        for name, t in want.items():
            assert (rec["full"][name] - t).abs().max().item() <= 1e-5, (name, stage, mode)
        if stage == 3:  # a unit is freed once the recomputation is done with it: never all at once
            assert rec["gathered"] < rec["units"] and rec["gathered_after"] == [0, 0, 0]


def test_reading_a_stage3_parameter_is_an_error_not_a_crash(real_runs):
    for res in real_runs:
        r = res["reads"]
        for name, error in r["errors"].items():
            assert error and "full_state_dict()" in error, (name, error)
        assert r["errors"]["norm"].startswith("zero: head.weight is sharded")
        assert r["shape"] == r["full"] == (V, D) and r["eval"] == r["eval_no_grad"] == (1, T, V)
        assert res["rewrap"] and "wrapped already" in res["rewrap"]


def test_settings_that_change_communication_must_agree(real_runs):
    for res in real_runs:
        for name, error in res["disagree"].items():
            assert error and error.startswith(f"zero: ranks disagree: rank 0 has {name}"), error
        assert res["disagree"]["param_dtype"] == ("zero: ranks disagree: rank 0 has param_dtype "
                                                  "None; rank 1 has param_dtype torch.bfloat16")
        assert res["disagree"]["bucket_bytes"].endswith("rank 1 has bucket_bytes 1024")
        assert res["disagree"]["lr"] == "zero: ranks disagree: rank 0 has lr 0.1; rank 1 has lr 0.2"
        # and the command line's flags and data, where nodes were launched apart
        assert res["apart"]["seed"] == "ranks disagree: rank 0 has seed 0; rank 1 has seed 1"
        sha = r"'[0-9a-f]{19}\.\.\.[0-9a-f]{16}'"  # (a long value: its two ends)
        assert re.fullmatch(rf"ranks disagree: rank 0 has data \(sha256\) {sha}; rank 1 has data "
                            rf"\(sha256\) {sha}", res["apart"]["data (sha256)"])
        # --init-from: each rank reads its own shards from its own node's copy: copies that
        # differ (their size and sampled bytes), or one that a rank cannot read, stop every rank
        init = r"--init-from init.pt \(bytes, sampled sha256\) \(\d+, '[0-9a-f]{12}'\)"
        assert re.fullmatch(f"ranks disagree: rank 0 has {init}; rank 1 has {init}",
                            res["apart"]["init-from"]), res["apart"]["init-from"]
        assert res["apart"]["init-from unreadable"].startswith(
            "--init-from bad.pt: not a readable state_dict file"), res["apart"]


@pytest.mark.parametrize("stage", range(4))
def test_ranks_that_reduce_different_units_stop_before_the_step(real_runs, stage):
    for res in real_runs:
        error, unchanged = res["swapped"][stage]
        assert error and "different units" in error and unchanged


def test_default_units_find_the_blocks_at_any_depth():
    class Block(nn.Module):  # (a block with a forward: one without is a container, no unit)
        def __init__(self):
            super().__init__()
            self.attn, self.mlp = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.mlp(self.attn(x))

    class GPT2Like(nn.Module):  # Hugging Face: model.transformer.h, a ModuleList
        def __init__(self):
            super().__init__()
            self.transformer = nn.Module()
            self.transformer.wte, self.transformer.ln_f = nn.Embedding(5, 4), nn.LayerNorm(4)
            self.transformer.h = nn.ModuleList(Block() for _ in range(3))
            self.lm_head = nn.Linear(4, 5)

    class LlamaLike(nn.Module):  # model.model.layers
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(5, 4)
            self.model.layers = nn.ModuleList(Block() for _ in range(3))
            self.lm_head = nn.Linear(4, 5)

    class ViTLike(nn.Module):  # timm: blocks is an nn.Sequential, next to a Sequential stem
        def __init__(self):
            super().__init__()
            self.patch_embed = nn.Sequential(nn.Conv2d(3, 4, 2), nn.Flatten())
            self.blocks = nn.Sequential(*(Block() for _ in range(3)))
            self.head = nn.Linear(4, 2)

    for model, blocks in [(m, m.transformer.h) for m in [GPT2Like()]] + \
            [(m, m.model.layers) for m in [LlamaLike()]] + [(m, m.blocks) for m in [ViTLike()]]:
        assert zero.default_units(model) == list(blocks), type(model).__name__
    # no repeated blocks: children
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.LayerNorm(4))
    assert zero.default_units(flat) == [flat[0], flat[2]]


def test_stage3_gathers_a_unit_backward_is_done_with_no_more(one_rank):
    # A root used only at the end of forward (a head) gets its gradient first in backward, is
    # reduced and freed; the prefetch for the first block gathered it again, for nothing
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V))
    opt = zero.wrap(model, 3, functools.partial(torch.optim.SGD, lr=0.1),
                    units=[model[0], model[2]])
    gathers, sent = [], opt.meter.sent
    opt.meter.sent = lambda kind, full, unit=None, **kw: (
        gathers.append(unit.index) if kind == "all_gather" else None, sent(kind, full, unit, **kw))
    for _ in range(2):  # (the second: the prefetch knows the order)
        gathers.clear()
        model(torch.randn(B, D)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert gathers == [2, 0, 1, 1, 0]  # the root, the blocks in forward, in backward
    opt.meter.sent = sent
    # A backward that gives no parameter a gradient (a saliency map: the input's only) gathered
    # every unit and freed none: the whole model stayed gathered until the next backward
    x = torch.randn(B, D, requires_grad=True)
    torch.autograd.grad(model(x).sum(), x)
    assert not any(u.gathered for u in opt.units)
    # With create_graph (a gradient penalty) they stay for the backward that reads them again,
    # which then frees them; it steps as one process does (freed early: a raw torch error)
    plain = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V))
    plain.load_state_dict(opt.full_state_dict())
    for m in (model, plain):
        g, = torch.autograd.grad(m(x).sum(), x, create_graph=True)
        g.pow(2).sum().backward()
    assert not any(u.gathered for u in opt.units)
    opt.step()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    for name, t in opt.full_state_dict().items():
        assert torch.allclose(t, plain.state_dict()[name], atol=1e-6), name


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(D))])
        self.shifts = nn.ParameterDict({"a": nn.Parameter(torch.zeros(D))})

    def forward(self, x):
        return self.lin(x) * self.scales[0] + self.shifts["a"]


def test_parameter_lists_and_dicts_stay_in_the_root(one_rank):
    # They have no forward of their own: as units, stage 3 never gathered them and refused the
    # forward that reads them. In the root, they train as the rest.
    model = Scaled()
    assert zero.default_units(model) == [model.lin]
    opt = zero.wrap(model, 3, functools.partial(torch.optim.SGD, lr=0.1))
    model(torch.ones(B, D)).sum().backward()
    opt.step()
    assert opt.full_state_dict()["shifts.a"].eq(-0.1 * B).all()


@scenario(2)
def disagree(rank, world):
    # Ranks that chose another stage, or built another model, fail at wrap with a clear error
    # instead of hanging in the first collective whose sizes differ.
    errors = []
    for stage, case in [(3 - rank, "adamw"), (2, "sgd" if rank else "adamw")]:  # "sgd": other units
        try:
            wrapped(rank, stage, case, seed=100)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_ranks_that_disagree_fail_fast(ran):
    for errors in ran(disagree, 2):
        assert all(e and e.startswith("zero: ranks disagree: rank 0 has ") for e in errors), errors
        assert "rank 0 has stage 3; rank 1 has stage 2" in errors[0] and "layout hash" in errors[1]


# ----------------------------------------------------------------------------------------------
# Hybrid sharding: shard within groups of G = 2 ranks, replicate across the N/G = 2 groups

@scenario(4, cuda=(4,))
def hybrid(rank, world):
    out, rows, G = {}, slice(rank * B, (rank + 1) * B), 2
    for stage in range(1, 4):  # stage 0 shards nothing: shard_size is refused there (below)
        for case in ("adamw", "sgd-accum"):
            model, opt = wrapped(rank, stage, case, seed=100, shard_size=G)
            comm, mem = [dict(opt.comm)], []

            def after_step():
                mem.append(opt.memory_breakdown())
                comm.append(dict(opt.comm))
            run_steps(model, opt, opt.clip_grad_norm_, CASES[case], rows, world, STEPS,
                      after_step=after_step)
            out[(stage, case)] = {"full": opt.full_state_dict(), "layout": unit_layout(opt),
                                  "mem": mem[-1], "peak": dict(opt.peak),
                                  "comm": [{k: b.get(k, 0) - a.get(k, 0) for k in b}
                                           for a, b in zip(comm, comm[1:])]}
            # every backward reduces (no no_sync; stages 2 and 3 always do): at stage 1 the landed
            # sum stays in the buffer that the next backward reduces again, across replicas too
            if stage == 1 and case == "sgd-accum":
                model, opt = wrapped(rank, stage, case, seed=100, shard_size=G)
                run_steps(model, opt, opt.clip_grad_norm_, CASES[case], rows, world, STEPS,
                          no_sync=False)
                out[(stage, case, "every-backward")] = opt.full_state_dict()
    out["bad"] = []
    for stage, shard_size in [(1, 3), (0, 2)]:
        try:
            wrapped(rank, stage, case, seed=100, shard_size=shard_size)
            out["bad"].append(None)
        except ValueError as e:
            out["bad"].append(str(e))
    return out


@pytest.fixture(scope="module", params=[("cpu", 4), ("cuda-gloo", 4), ("cuda-nccl", 4)], ids=run_id)
def hybrid_runs(request, ran):
    transport, world = request.param
    return ran(hybrid, world, transport), transport != "cpu"


@pytest.mark.parametrize("case", ["adamw", "sgd-accum"])
@pytest.mark.parametrize("stage", range(1, 4))
def test_hybrid_sharding_matches_the_reference(hybrid_runs, stage, case):
    # with no_sync() around all micro-batches but the last, and with every backward reducing
    want, (runs, cuda) = reference(case, 4), hybrid_runs
    for res in runs:
        for got in ([res[(stage, case)]["full"]]
                    + [res[key] for key in [(stage, case, "every-backward")] if key in res]):
            assert_trains_like(got, want, cuda)


@pytest.mark.parametrize("case", ["adamw", "sgd-accum"])
@pytest.mark.parametrize("stage", range(1, 4))
def test_hybrid_memory_and_communication_by_group(hybrid_runs, stage, case):
    N, G = 4, 2
    R, k = N // G, CASES[case]["accum"]
    for res in hybrid_runs[0]:
        rec = res[(stage, case)]
        # S: a unit's 1/G, padded to a multiple of N
        lay, S = rec["layout"], sum(rec["layout"]["S"])
        # memory: what is sharded is 1/G of the model, not 1/N
        full = 4 * G * S
        # m, v and step counters
        adam = (2 * full // G if stage >= 1 else 2 * full) + 4 * lay["pieces"]
        assert rec["mem"] == {"params": full // G if stage >= 3 else full,
                              "grads": full // G if stage >= 2 else full,
                              "optimizer": adam if case == "adamw" else 0}  # plain SGD: no state
        assert zero.memory_formula(stage, lay["psi"], N, shard_size=G)["optimizer"] == \
            pytest.approx(8 * lay["psi"] / (G if stage else 1))
        # communication: reduce-scatters and all-gathers inside a group of G, the all-reduce of
        # each 1/G shard across the R groups
        if stage == 0:
            want = {"all_reduce": 2 * 4 * (N - 1) * G * S / N}
        else:
            want = expected_comm(stage, case, G, lay)
            want["all_reduce"] -= CHECK * (G - 1) / G
            reductions = 1 if stage == 1 else k
            want["all_reduce across groups"] = reductions * 2 * (R - 1) / R * 4 * S
        want["all_reduce"] = want.get("all_reduce", 0) + (CHECK * (N - 1) / N if stage == 0 else 0)
        if stage:
            want["all_reduce"] += CHECK * (N - 1) / N
        for step in rec["comm"]:
            assert {k2: v for k2, v in step.items() if v} == {k2: v for k2, v in want.items() if v}
        formula = zero.comm_formula(stage, lay["psi"], N, micro_batches=k, shard_size=G)
        if stage:
            assert formula["all_reduce across groups"] == pytest.approx(
                want["all_reduce across groups"], rel=0.05)
        # gloo/CPU: a reduce-scatter in flight holds its all-to-all's receive buffer, the size of
        # its unit, which the peak counts inside the across-groups step too (stage 1 reduces in
        # place: nothing else is held beyond what it keeps)
        if stage == 1 and not hybrid_runs[1]:
            assert rec["peak"]["grads"] >= rec["mem"]["grads"] + 4 * G * max(lay["S"])


# ----------------------------------------------------------------------------------------------
# The formulas alone (--estimate), and wrap()'s own refusals

def test_wrap_rejects_a_bad_stage():
    for stage in (4, 2.0, True, "2"):  # (2.0 and True compare equal to a stage)
        with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
            zero.wrap(Net(seed=0), stage, torch.optim.SGD)


def by_dim(params):  # nanoGPT's weight decay on matrices only: every flat piece is 1-D
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0}])


@pytest.mark.parametrize("optimizer, says", [
    # Adafactor on flat pieces stepped without error and differed from torch's (the RMS of a
    # tensor, factored moments of a matrix); groups by dim put every piece in the 1-D group:
    # no weight decay, silently. Now each is refused, as what is no optimizer at all.
    (torch.optim.Adafactor, "optimizer Adafactor is not element-wise"),
    (torch.optim.LBFGS, "optimizer LBFGS is not element-wise"),
    (torch.optim.SparseAdam, "optimizer SparseAdam is not element-wise"),
    pytest.param(functools.partial(getattr(torch.optim, "Muon", object), lr=0.01),
                 "optimizer Muon is not element-wise",  # (not Muon's own error on 1-D pieces)
                 marks=pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch < 2.9")),
    (by_dim, "optimizer AdamW must step the parameters it is given, in one group"),
    (lambda ps: torch.optim.SGD(list(ps)[:1]), "optimizer SGD must step the parameters"),
    (lambda ps: None, "optimizer is a .*, not <lambda>$"),
    (torch.optim.SGD([torch.zeros(1, requires_grad=True)]),
     "optimizer is a .*, not an instance of SGD$"),
    (nn.Linear, "optimizer is a .*, not Linear$"),
    (None, "optimizer is a .*, not an instance of NoneType$")])
def test_wrap_refuses_what_would_not_step_as_unsharded_torch(optimizer, says):
    with pytest.raises(ValueError, match=f"^zero: {says}"):
        zero.wrap(Net(seed=0), 1, optimizer)


@pytest.mark.parametrize("option, says", [
    (dict(overlpa=False), "Options.__init__() got an unexpected keyword argument 'overlpa'"),
    (dict(bucket_bytes=-5), "zero: bucket_bytes must be a whole number of bytes, 0 or more"),
    (dict(param_dtype=torch.int32), "zero: param_dtype must be a floating-point torch dtype, not "),
    (dict(reduce_dtype="fp32"), "zero: reduce_dtype must be a floating-point torch dtype, not 'fp"),
    (dict(shard_size=0), "zero: shard_size must be an int dividing the world size 1, not 0"),
    (dict(shard_size=1.0), "zero: shard_size must be an int dividing the world size 1, not"),
])
def test_wrap_refuses_a_bad_option_in_one_line(option, says):  # (an unknown one: Python's own)
    with pytest.raises((ValueError, TypeError), match=f"^{re.escape(says)}"):
        zero.wrap(Net(seed=0), 1, torch.optim.SGD, **option)


def test_units_that_cannot_be_units_are_refused(one_rank):
    # the model itself; at stage 3 a module without a forward (a ModuleList: its members were
    # refused at their first read, as 'sharded and not gathered', though in their unit). By
    # default such a module is no unit: its children are (a container class of one's own too)
    model = Net(seed=0)
    for stage, units, says in [(1, [model], "every unit must be a submodule of the model"),
                               (3, [model.blocks], "unit blocks (ModuleList) has no forward")]:
        with pytest.raises(ValueError, match=f"^zero: {re.escape(says)}"):
            zero.wrap(model, stage, torch.optim.SGD, units=units)
    zero.wrap(model, 2, functools.partial(torch.optim.SGD, lr=0.1), units=[model.blocks])

    class Holder(nn.Module):  # no forward: the model computes with its members
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    model = nn.Sequential(Holder(), nn.Linear(D, D))
    model.forward = lambda x: model[1](model[0].b(model[0].a(x)))
    assert zero.default_units(model) == [model[0].a, model[0].b, model[1]]
    opt = zero.wrap(model, 3, functools.partial(torch.optim.SGD, lr=0.1))
    model(torch.randn(B, D)).sum().backward()  # (a unit Holder: 'a.weight is sharded...')
    opt.step()
    # nor repeated blocks of them (their members are), and a forward set on the module is one
    holders = nn.ModuleList([Holder(), Holder()])
    assert zero.default_units(nn.Sequential(holders)) == [m for h in holders for m in (h.a, h.b)]
    own = Holder()
    own.forward = lambda x: own.b(own.a(x))
    assert zero.default_units(nn.Sequential(own, nn.Linear(D, D)))[0] is own
    assert not zero.no_forward(own) and zero.no_forward(holders)


def test_a_unit_of_two_dtypes_is_refused_naming_them():
    # one flat buffer a unit: one dtype and device; the line names a parameter of each
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(ValueError, match=r"^zero: the parameters of one unit must share dtype and "
                       r"device: 1.weight is torch.float64 on cpu, 0.weight torch.float32 on cpu$"):
        zero.wrap(model, 1, torch.optim.SGD, units=[])


def test_parameters_sharing_elements_are_refused_by_name():
    # wrap() copies each parameter into its unit: a view of another one (or of the same
    # elements twice: expand()) was untied there, and trained apart from it, silently
    class Views(nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(4, 8))
            self.w2 = nn.Parameter({"view": self.w1.data[:, :4], "own": torch.randn(4),
                                    "expand": torch.randn(4, 1).expand(4, 8),
                                    "transposed": torch.randn(8, 4).t()}[kind])

        def forward(self, x):
            return x @ self.w1.T
    for kind in ("view", "expand"):
        with pytest.raises(ValueError, match=r"^zero: w2 shares elements with another parameter"):
            zero.wrap(Views(kind), 1, torch.optim.SGD, units=[])
    for kind in ("transposed", "own"):  # (a view of elements of its own: fine)
        zero.wrap(Views(kind), 1, torch.optim.SGD, units=[])


@pytest.mark.parametrize("stage", range(3))
def test_mixed_precision_keeps_writes_between_steps(stage):
    # a write to a bf16 parameter between steps (weight clipping, a re-init) reaches its fp32
    # master before the step, as plain torch keeps it; elements not written keep their fp32
    # values. (Stage 3 refuses such writes outside gathered(writeback=True).)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = zero.wrap(model, stage, functools.partial(torch.optim.SGD, lr=0.0),
                    param_dtype=torch.bfloat16)
    with torch.no_grad():
        model[0].weight.clamp_(-0.01, 0.01)
    written = model[0].weight.detach().float()
    changed = written != fp32["0.weight"].bfloat16().float()
    assert 0 < changed.sum() < changed.numel()
    # before the step too: what a save or full_state_dict() between steps holds
    full = opt.full_state_dict()
    assert torch.equal(full["0.weight"], torch.where(changed, written, fp32["0.weight"]))
    assert torch.equal(full["1.weight"], fp32["1.weight"])
    model(torch.randn(8, 4)).sum().backward()
    opt.step()  # lr 0: the masters are what they were before it
    full = opt.full_state_dict()
    assert torch.equal(full["0.weight"], torch.where(changed, written, fp32["0.weight"]))
    assert torch.equal(full["1.weight"], fp32["1.weight"])


@pytest.mark.parametrize("stage", range(4))
def test_param_dtype_may_be_the_models_own(stage):
    # param_dtype=torch.float32 on an fp32 model: the compute copy is a copy all the same (at
    # stage 3, .to() of the same dtype returned the buffer that stage 3 frees: a crash)
    torch.manual_seed(0)
    model, plain = nn.Linear(4, 2), nn.Linear(4, 2)
    plain.load_state_dict(model.state_dict())
    opt = zero.wrap(model, stage, functools.partial(torch.optim.SGD, lr=0.1),
                    param_dtype=torch.float32)
    x = torch.randn(8, 4)
    for net, step in ((model, opt.step), (plain, torch.optim.SGD(plain.parameters(), 0.1).step)):
        net(x).square().sum().backward()
        step()
    full = opt.full_state_dict()
    assert all(torch.allclose(full[n], p, atol=1e-6) for n, p in plain.state_dict().items())


@pytest.mark.parametrize("stage", [0, 3])
def test_param_dtype_casts_inputs_given_by_keyword(stage):
    # model(x=x), as Hugging Face models are called: the input is cast to param_dtype as a
    # positional one is (it reached the bf16 weights in fp32: a dtype error inside torch)
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            return self.l(x) + x.float().mean()  # (x in fp32 here: a dtype error above)

    class Keyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x=None, scale=1.0):
            for block in self.blocks:
                x = block(x=x.float())  # the units' inputs by keyword too
            return x * scale
    model = Keyword()
    opt = zero.wrap(model, stage, torch.optim.SGD, param_dtype=torch.bfloat16)
    assert [u.modules for u in opt.units if u.modules] == [[b] for b in model.blocks]
    assert model(x=torch.randn(3, 4), scale=2.0).dtype == torch.bfloat16


def test_stage3_prefetches_the_unit_that_computes_next():
    # from the second forward on, the order of the first: as block i computes, unit i + 1 is
    # being gathered already, and unit i - 1 freed (a hook order that shifted it by one would
    # still train, with nothing prefetched)
    class Scaled(nn.Module):  # a root unit (scale), gathered first, and three blocks
        def __init__(self):
            super().__init__()
            self.scale, self.blocks = nn.Parameter(torch.ones(4)), nn.Sequential(
                *[nn.Linear(4, 4) for _ in range(3)])

        def forward(self, x):
            return self.blocks(x * self.scale)
    torch.manual_seed(0)
    model, seen = Scaled(), []
    opt = zero.wrap(model, 3, torch.optim.SGD)
    for block in model.blocks:  # (registered after wrap(): they run once zero.py has gathered)
        block.register_forward_pre_hook(lambda *_: seen.append([u.gathered for u in opt.units]))
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    T, F = True, False  # units: the three blocks, then the root
    assert seen == [[T, F, F, T], [F, T, F, T], [F, F, T, T],
                    [T, T, F, T], [F, T, T, T], [F, F, T, T]]


def test_an_embedding_that_renormalizes_in_forward_is_refused():
    # max_norm rewrites the rows each rank's forward looks up: the ranks' weights would part
    # silently (measured: 1.5 apart at stage 0), so it is refused by name, frozen or not
    for frozen in (False, True):
        model = nn.Sequential(nn.Embedding(V, D, max_norm=1.0), nn.Linear(D, V))
        model[0].requires_grad_(not frozen)
        with pytest.raises(ValueError, match=r"^zero: 0 has max_norm: each rank's forward"):
            zero.wrap(model, 0, torch.optim.SGD)


def test_run_ends_zero_own_errors_in_one_line(monkeypatch, capsys):
    # zero.py's own refusals (ValueError at wrap(), RuntimeError in use): one line, exit 2; any
    # other error is a bug and keeps its traceback
    monkeypatch.setattr(zero.dist, "is_initialized", lambda: False)  # (the group stays up)
    for error in (ValueError("zero: a refusal"), RuntimeError("zero: a refusal")):
        with pytest.raises(SystemExit) as e:
            zero.run(lambda: _raise(error))
        assert e.value.code == 2 and capsys.readouterr().err.endswith(": error: a refusal\n")
    with pytest.raises(RuntimeError, match="^a bug$"):
        zero.run(lambda: _raise(RuntimeError("a bug")))
    # One line a node: its first rank's (LOCAL_RANK 0), whatever its RANK. A file missing on one
    # node fails its ranks only: that node's console says why.
    for local_rank, says in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", "2")
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(SystemExit) as e:
            zero.run(lambda: _raise(zero.UsageError("--data x: not a file that can be read")))
        err = capsys.readouterr().err
        assert e.value.code == 2 and (err.endswith(": error: --data x: not a file that can be "
                                                   "read\n") if says else err == ""), err


def _raise(error):
    raise error


def estimate_rows(stdout):
    """{stage: (total GB, elements sent inside a group, across groups)} from --estimate."""
    rows = {}
    for line in stdout.splitlines():
        m = re.match(r"([0-3]) .*?([\d.]+) GB +([\d.e+]+) +([\d.e+]+)$", line)
        if m:
            rows[int(m[1])] = (float(m[2]), float(m[3]), float(m[4]))
    return rows


def test_estimate_reproduces_the_paper():
    rows = estimate_rows(main_printed(zero.main, ["--estimate", "--params", "7.5e9",
                                                  "--world-size", "64"]))
    assert [rows[s][0] for s in range(4)] == [120.0, 31.4, 16.6, 1.9]
    assert [rows[s][1] for s in range(4)] == [1.477e10] * 3 + [2.215e10]  # 2Ψ or 3Ψ (N-1)/N
    assert all(rows[s][2] == 0 for s in range(4))
    # 16, 5.5, 3.75, 2 GB
    out = main_printed(zero.main, ["--estimate", "--params", "1e9", "--world-size", "8"])
    assert [estimate_rows(out)[s][0] for s in range(4)] == [16.0, 5.5, 3.8, 2.0]
    # hybrid, G = 8 of N = 64: stage 3 holds 16Ψ/8; only 2Ψ/G (R-1)/R elements cross groups
    rows = estimate_rows(main_printed(zero.main, ["--estimate", "--params", "7.5e9",
                                                  "--world-size", "64", "--shard-size", "8"]))
    assert rows[3][0] == 15.0 and rows[3][2] == 1.641e9 and rows[0][2] == 1.477e10
    with pytest.raises(zero.UsageError, match="--shard-size 7 does not divide --world-size 64"):
        zero.main(["--estimate", "--params", "7.5e9", "--world-size", "64", "--shard-size", "7"])
    # --stage: that stage's row alone, and its communication; --ckpt-dir refused; Ψ = 1e30 fits
    out = main_printed(zero.main, ["--estimate", "--params", "7.5e9", "--world-size", "64",
                                   "--stage", "1"])
    assert estimate_rows(out) == {1: (31.4, 1.477e10, 0.0)} and "2Ψ(N-1)/N for stage 1" in out
    # k micro-batches: stage 2 reduce-scatters in each, stage 3 gathers twice and reduces in each
    out = main_printed(zero.main, ["--estimate", "--params", "7.5e9", "--world-size", "64",
                                   "--grad-accum", "4"])
    assert [estimate_rows(out)[s][1] for s in range(4)] == [1.477e10] * 2 + [3.691e10, 8.859e10]
    assert "k = 4 micro-batches):\n2Ψ(N-1)/N for stage 0, 2Ψ(N-1)/N for stage 1, 5Ψ(N-1)/N" in out
    for flag in (["--ckpt-dir", "x"], ["--bf16"]):  # (--bf16: its bytes are always bf16's)
        with pytest.raises(zero.UsageError,
                           match=f"^{flag[0]} is for training: --estimate trains nothing$"):
            zero.main(["--estimate", "--params", "7.5e9", "--world-size", "64", *flag])
    out = main_printed(zero.main, ["--estimate", "--params", "1e30", "--world-size", "64"])
    table = out.splitlines()[4:9]
    # the columns hold
    assert len({len(line) for line in table}) == 1 and len(table[0]) <= 100, table
    assert [float(line.split()[-4]) for line in table[1:]] == [1.6e22, 4.2e21, 2.2e21, 2.5e20]
    # 3 significant digits at least: the paper's trillion parameters on 1024 ranks, stage 0
    out = main_printed(zero.main, ["--estimate", "--params", "1e12", "--world-size", "1024"])
    assert out.splitlines()[5].split()[3:11:2] == ["2000.0", "2000.0", "12000", "16000"]


# ----------------------------------------------------------------------------------------------
# The command line, end to end

@pytest.mark.parametrize("stage", range(4))
def test_cli_trains_under_torchrun(cli_runs, stage):
    assert cli_runs[0].returncode == 0, cli_runs[0].stderr[-3000:]
    out = cli_runs[1][f"stage {stage}"]
    assert f"stage {stage} (" in out and "world size       | 4 (gloo" in out
    assert len(losses(out)) == 3
    assert "model state per rank" in out and "communication per rank per step" in out
    assert out.count("step    1 |") == 1  # one line per step: rank 0 alone prints
    # what is rank 0's alone, and what the bytes leave out, said so
    # the median is one step's (of an even number: the upper of the middle two), split after it
    median = re.search(r"median step time of rank 0: (\S+) ms over 3 steps\nstep \d, (\S+) ms:",
                       out)
    assert median and median[1] == median[2] and zero.median_step([0.4, 0.1, 0.3, 0.2]) == 2
    assert "(not counted: the training loop's all-reduce of the loss, 4 bytes a step)" in out
    assert out.count("16-byte check a step") == 1 and out.count("the gradient norm") == (stage > 0)


def test_cli_every_stage_gives_the_same_losses(cli_runs):
    assert cli_runs[0].returncode == 0, cli_runs[0].stderr[-3000:]
    runs = [losses(cli_runs[1][f"stage {stage}"]) for stage in range(4)]
    assert all(len(r) == 3 for r in runs)
    for run in runs[1:]:
        assert max(abs(a - b) for a, b in zip(run, runs[0])) <= 2e-6
    assert runs[0][-1] < runs[0][0]


def test_each_step_is_split_into_waiting_and_the_rest(cli_runs):
    # Exposed communication, measured where the training waits (Meter.wait): on each step line
    # next to the step's time, and in the report, one step's split, which adds up.
    for stage in range(4):
        out = cli_runs[1][f"stage {stage}"]
        steps = re.findall(r"^step +\d+ \| loss \S+ \| +(\S+) ms, +(\S+) waiting \| sent",
                           out, re.M)
        assert len(steps) == 3 and all(0 <= float(w) <= float(t) for t, w in steps), out
        split = re.search(r"^step (\d+), (\S+) ms: (\S+) ms waiting on collectives .*\n"
                          r".* \+ (\S+) ms the rest", out, re.M)
        assert split and float(split[2]) == pytest.approx(float(split[3]) + float(split[4]),
                                                          abs=0.11)
        assert (split[2], split[3]) in steps  # the step the split is of


@scenario(2)
def late_rank(rank, world):
    # Rank 1 starts each backward 0.4 s late: rank 0's reductions wait for it there, and the
    # Meter times that wait; rank 1 finds rank 0 ready and waits far less.
    out = {}
    for stage in range(4):
        model, opt = wrapped(rank, stage, "sgd", seed=100)
        x, y = (t[rank * B:(rank + 1) * B] for t in global_batch(0, 0, world))
        opt.step()  # nothing to reduce: the first collectives set up their connections
        opt.zero_grad()
        waited = opt.meter.waited()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        if rank == 1:
            time.sleep(0.4)
        loss.backward()
        opt.step()
        out[stage] = opt.meter.waited() - waited
        opt.zero_grad()
    return out


def test_waiting_is_measured_where_the_rank_waits(ran):
    early, late = ran(late_rank, 2)
    for stage in range(4):
        assert early[stage] >= 0.3, (stage, early, late)  # of the 0.4 s it waited for rank 1
        assert late[stage] < early[stage] - 0.2, (stage, early, late)


BAD = [["--stage", "7"], ["--steps", "0"], ["--d-model", "-3"],
       ["--d-model", "30", "--n-head", "4"],
       ["--clip", "-1"], ["--estimate", "--params", "abc", "--world-size", "4"],
       ["--estimate", "--params", "-1", "--world-size", "64"],
       ["--estimate", "--params", "nan", "--world-size", "2"],
       ["--estimate", "--params", "1e9"], ["--no-such-flag"],
       ["--max-memory", "100kB"]]  # below 1MB: a thread the runtime starts would abort the process
if not torch.cuda.is_available():
    BAD.append(["--backend", "nccl"])


def test_bad_input_is_one_line_and_exit_2(refused):
    # End to end: an argument error, and an error found once the process group exists (the model
    # is built, --init-from names no file). One line on stderr, exit code 2.
    for name in ("argument", "after setup"):
        code, out, err, message = refused[name]
        assert code == 2, err
        assert err.count("\n") == 1 and err.startswith("zero.py: error: ") and message in err, err
        assert "Traceback" not in err + out
    # Every bad argument: zero.main raises UsageError (which zero.run prints as that one line, exit
    # code 2), its message one line, and nothing else is printed.
    for args in BAD:
        printed, errors = io.StringIO(), io.StringIO()
        with pytest.raises(zero.UsageError) as e, contextlib.redirect_stdout(printed), \
                contextlib.redirect_stderr(errors):
            zero.main(args)
        assert str(e.value) and "\n" not in str(e.value), args
        assert printed.getvalue() == errors.getvalue() == "", args


def test_a_file_that_cannot_be_written_is_one_line(monkeypatch, capsys):
    # A full disk under --timeline's SVG or mistakes.py's --json, once the run is over: a
    # traceback before; one line and exit code 1 (os._exit: no teardown, as for a rank gone)
    def main():
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(zero.os, "_exit", sys.exit)
    with pytest.raises(SystemExit) as e:
        zero.run(main)
    assert e.value.code == 1
    assert capsys.readouterr().err.endswith(": error: [Errno 28] No space left on device\n")
    # a LOCAL_RANK left in the shell, without torchrun's RANK: the line was not printed at all
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit):
        zero.run(main)
    assert capsys.readouterr().err.endswith(": error: [Errno 28] No space left on device\n")


def test_bad_flags_are_one_line(one_rank, tmp_path, capsys):
    afile, readonly = tmp_path / "afile", tmp_path / "readonly"
    afile.write_text("")
    readonly.mkdir()
    readonly.chmod(0o555)
    # root writes in readonly too: there, a directory nobody can make a file in
    unwritable = "/proc/self" if os.geteuid() == 0 else str(readonly)
    size = len(zero.corpus())
    cases = [(["--bucket-mb", "1e308"], "--bucket-mb"),
             (["--seq-len", str(size - 1)], "longer than the data"),
             (["--timeout", "1e20"], "--timeout"), (["--timeout", "1e-9"], "--timeout"),
             (["--seed", "99999999999999999999"], "--seed"), (["--seed", "-1"], "--seed"),
             (["--clip", "nan"], "--clip"), (["--clip", "inf"], "--clip"),
             (["--params", "1e9"], "is for --estimate"),
             (["--world-size", "8"], "is for --estimate and --largest-model"),
             # runs of their own: any two refused, naming them in the order of --help
             (["--largest-model", "--max-memory", "1GB", "--world-size", "2", "--timeline-all",
               "t.svg"], "--largest-model and --timeline-all: choose one"),
             (["--consolidate", "d", "--out", "m.pt", "--largest-model"], "--consolidate and "
              "--largest-model: choose one"),
             (["--tradeoffs", "--estimate"], "--estimate and --tradeoffs: choose one"),
             (["--ckpt-dir", str(afile)], "not a directory"),
             (["--ckpt-dir", str(afile / "x")], "Not a directory"),
             (["--ckpt-dir", unwritable], "not writable"),
             (["--ckpt-dir", os.fsdecode(bytes(tmp_path) + b"/\xff")], "bytes are not UTF-8"),
             (["--init-from", os.fsdecode(bytes(tmp_path) + b"/\xff")], "No such file"),
             (["--ckpt-dir", ""], "--ckpt-dir '': an empty name"),  # (else: no checkpoints)
             (["--consolidate", ""], "--consolidate '': an empty name"),  # (else: training)
             (["--lr", "1e39"], "beyond float32's range"),
             (["--lr", "inf"], "'inf' must be positive and finite"),
             (["--steps", "2.5"], "invalid positive int value: '2.5'"),
             (["--lr", "abc"], "invalid positive float value: 'abc'"),
             (["--init-from", str(afile)], "not a readable state_dict file (not the "
              "zip file torch.save writes: cut short, or not torch's"),  # (not mmap's)
             (["--shard-size", "2"], "must be an int dividing the world size 1"),
             (["--data", str(afile)], f"--data {afile} has 0 bytes: too few for a row"),
             (["--resume-from", str(afile / "x")], "no such directory"),
             (["--timeline", str(tmp_path / "t.txt")], "name it FILE.svg"),
             # what this machine cannot hold, refused before it is built (not killed later)
             (["--n-layer", "10000000"], "this model needs at least"),
             (["--batch-size", "100000000"], "(stage 3's formula, ")]
    for args, message in cases:
        with pytest.raises((zero.UsageError, ValueError)) as e:  # (ValueError: wrap's checks)
            zero.main([*TINY, *args])
        assert message in str(e.value) and "\n" not in str(e.value), (args, str(e.value))
    assert "step    1 |" not in capsys.readouterr().out  # refused at the start, before any training
    assert os.listdir(readonly) == []
    longest = zero.training_parser("").parse_args(["--seq-len", str(size - 2)])  # the data allows
    assert zero.check_args(longest).seq_len == size - 2
    with pytest.raises(SystemExit):
        zero.main(["--help"])
    options = re.split(r"\n  (?=-)", capsys.readouterr().out.split("\n  -h, --help")[1])[1:]
    assert len(options) > 25 and all("(default" in option for option in options), options


def test_ranks_that_disagree_are_one_line_under_torchrun():
    # What torchrun starts: two ranks, here given different stages. wrap refuses on every rank:
    # rank 0 prints one line, every rank exits 2.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, os.path.join(HERE, "zero.py"), *TINY, "--timeout", "30", "--stage"]
    procs = [subprocess.Popen(cmd + [str(1 + r)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    (out0, err0), (out1, err1) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [2, 2], (err0, err1)
    assert err0.startswith("zero.py: error: ranks disagree: rank 0 has stage 1"), err0
    assert err0.count("\n") == 1
    assert err1 == "" and "Traceback" not in out0 + out1


def test_a_dead_rank_ends_the_job(tmp_path):
    # Without torchrun to stop the group: rank 1 is killed mid-training; rank 0 leaves with a
    # one-line error (gloo sees the closed connection at once; a rank that hung instead would be
    # caught by --timeout). What is asserted holds wherever rank 0 is when rank 1 dies.
    env = dict(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(conftest._free_port()),
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "zero.py"), *CKPT,
                               "--steps", "100000", "--timeout", "30"],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for line in procs[0].stdout:
        if line.startswith("step    3 |"):
            break
    procs[1].kill()
    _, err = procs[0].communicate(timeout=90)
    procs[1].communicate()
    assert procs[0].returncode == 1
    assert err.count("\n") == 1 and "rank 0: a collective failed, another rank is gone or the " \
        "group's timeout (--timeout) passed (" in err, err[-2000:]


# ----------------------------------------------------------------------------------------------
# On a GPU: the allocator's bytes against the formula, the report and the timeline's curve

# The demo GPT, with every tensor under 1 MiB (a block: 198,272 parameters, 793 kB in fp32): the
# caching allocator serves those from its small pool, exactly, in multiples of 512 bytes, so what
# torch.cuda.memory_allocated counts is the tensors alive, to within that rounding.
REPORT = ["--d-model", "128", "--n-layer", "8", "--n-head", "4", "--seq-len", "32",
          "--batch-size", "2", "--steps", "3"]
CUDA_REPORT_RUNS = [("cuda-nccl", 1), ("cuda-gloo", 2), ("cuda-nccl", 2)]


def report_args(*extra):
    return zero.training_parser("").parse_args(REPORT + list(extra))


def activation_bytes(args, rank, world):
    """The most bytes one forward and backward of the plain GPT (no zero.py; the same batch, dtype
    and loss as zero.train's) allocates above what it held before, its gradients dropped as they
    arrive: what a zero.py run holds that is not model state. Measured twice, the second time
    counts: the first also allocates what CUDA keeps from then on (cuBLAS's workspaces, one per
    thread: forward's and backward's), which is then part of every later baseline."""
    torch.manual_seed(args.seed)
    model = zero.GPT(args.seq_len, args.d_model, args.n_layer, args.n_head).to(conftest.DEVICE)
    if args.bf16:
        model.to(torch.bfloat16)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    data = zero.demo_data()
    x, y = zero.get_batch(data, 1, 0, rank, world, args.batch_size, args.seq_len, args.seed)
    for _ in range(2):
        gc.collect()
        torch.cuda.synchronize(conftest.DEVICE)
        before = torch.cuda.memory_allocated(conftest.DEVICE)
        torch.cuda.reset_peak_memory_stats(conftest.DEVICE)
        logits = model(x.to(conftest.DEVICE)).float()
        F.cross_entropy(logits.flatten(0, 1), y.to(conftest.DEVICE).flatten()).backward()
        torch.cuda.synchronize(conftest.DEVICE)
        peak = torch.cuda.max_memory_allocated(conftest.DEVICE) - before
        del logits
    return peak


@scenario(cuda=(1, 2))
def cuda_report(rank, world):
    """zero.train on the demo GPT, every stage, fp32 and bf16, on this rank's GPU, recording the
    last step's timeline (as --timeline does): what it returns, what rank 0 prints (the report)
    and draws, with the bytes this rank held before it started ("base") and the activations."""
    out = {}
    for bf16 in (False, True):
        args = report_args("--backend", dist.get_backend(), "--device", "cuda", *["--bf16"] * bf16)
        act = activation_bytes(args, rank, world)
        for stage in range(4):
            args.stage, args.record_step = stage, args.steps
            gc.collect()  # the last run's model and optimizer
            torch.cuda.synchronize(conftest.DEVICE)
            base, printed = torch.cuda.memory_allocated(conftest.DEVICE), io.StringIO()
            with contextlib.redirect_stdout(printed):
                res = zero.train(args)
                zero.report(res, args)
            panel = memory.timeline_panel(res, args)
            out[(stage, bf16)] = dict(res, base=base, act=act, stdout=printed.getvalue(),
                                      text=memory.timeline_text([panel]),
                                      svg=memory.timeline_svg([panel]))
    return out


@pytest.fixture(scope="module", params=CUDA_REPORT_RUNS, ids=run_id)
def cuda_reports(request, ran):
    """(transport, N, every rank's cuda_report)."""
    transport, world = request.param
    return transport, world, ran(cuda_report, world, transport)


@functools.lru_cache(maxsize=None)
def report_units():
    """The numel of each unit of the REPORT model as zero.train wraps it: the blocks, then the
    root (embeddings and the final norm; the head is tied to the embedding)."""
    a = report_args()
    model = zero.GPT(a.seq_len, a.d_model, a.n_layer, a.n_head)
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    return blocks + [sum(p.numel() for p in model.parameters()) - sum(blocks)]


def report_state(stage, bf16, world):
    """memory_breakdown() after the step, exactly, for the REPORT model: the formula's bytes per
    parameter on units padded to N parts, plus AdamW's step counter per unit (one piece each)."""
    pb, gb, ob = (2, 2, 12) if bf16 else (4, 4, 8)
    S = sum(-(-n // world) for n in report_units())  # a rank's shard of every unit
    return {"params": pb * S * (1 if stage >= 3 else world),
            "grads": gb * S * (1 if stage >= 2 else world),
            "optimizer": ob * S * (1 if stage >= 1 else world) + 4 * len(report_units())}


def peak_parts(stage, bf16, world, backend, act):
    """The most a rank may hold during zero.train above what it held before, in parts: the model
    state of the formula on units padded to N parts; what is transient, in units of the largest
    unit; the optimizer step's temporaries (torch's foreach AdamW on CUDA: sqrt(v) for the whole
    shard; in bf16 also the fp32 gradients fp32_step hands it); the activations, measured
    without zero.py; the allocator's rounding and the last step's logits."""
    pb, gb, ob = (2, 2, 12) if bf16 else (4, 4, 8)
    sizes = [-(-n // world) * world for n in report_units()]
    padded, unit = sum(sizes), max(sizes)
    stepped = padded // world if stage >= 1 else padded  # the elements this rank's optimizer steps
    return {"model state, formula":
                sum(zero.memory_formula(stage, padded, world, pb, gb, ob).values()),
            "gathered units: computing, prefetched, root": 3 * pb * unit * (stage == 3),
            "full unit gradients: filling, in flight": 2 * gb * unit * (stage >= 2),
            "fp32 copies of unit gradients, reduced": 2 * 4 * unit * bf16,
            "gloo's copy of a reduce-scatter's input": (2 * 4 * unit
                                                        * (backend == "gloo" and stage >= 1)),
            "optimizer step temporaries": 4 * stepped * (2 if bf16 else 1),
            "activations, measured without zero.py": act,
            "rounding to 512 bytes, the last logits": 256 << 10}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", range(4))
def test_cuda_peak_memory_is_within_the_formula(cuda_reports, stage, dtype):
    # The report's torch.cuda.max_memory_allocated, per rank, above what the rank held before:
    # at least the formula's model state, at most that (padded) plus the transient units, the
    # optimizer step's temporaries and the activations, which are measured separately.
    transport, world, ranks = cuda_reports
    bf16 = dtype == "bf16"
    for rank, reports in enumerate(ranks):
        r = reports[(stage, bf16)]
        assert r["mem"] == report_state(stage, bf16, world)  # memory_breakdown(), as on CPU
        peak = r["cuda_peak"][rank] - r["base"]
        pb, gb, ob = (2, 2, 12) if bf16 else (4, 4, 8)
        floor = sum(zero.memory_formula(stage, r["psi"], world, pb, gb, ob).values())
        parts = peak_parts(stage, bf16, world, transport.split("-")[1], r["act"])
        assert floor <= peak <= sum(parts.values()), (rank, peak, floor, parts)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", range(4))
def test_cuda_memory_between_steps_is_the_model_state(cuda_reports, stage, dtype):
    # Before the last step's forward (the timeline's first event) a rank holds its model state
    # and what the training loop kept from the step before (its logits, fp32, and a loss): the
    # allocator counts that, to within its rounding to 512 bytes, and nothing else, no unit left
    # gathered nor any gradient or copy left over. And at every event of the step it holds at
    # least what memory_breakdown() counts.
    transport, world, ranks = cuda_reports
    args = report_args()
    logits = 4 * args.batch_size * args.seq_len * 256
    for rank, reports in enumerate(ranks):
        r = reports[(stage, dtype == "bf16")]
        first = r["timeline"][0]
        assert first["event"] == "before forward"
        steppers = 4 * len(report_units())  # AdamW's step counters: CPU tensors
        held = [(e["event"], e["cuda"] - r["base"] - (sum(e[k] for k in memory.STACK) - steppers))
                for e in r["timeline"]]  # bytes beyond the model state memory_breakdown() counts
        assert 0 <= held[0][1] - logits <= 64 << 10, (rank, held[0], logits)
        assert min(n for _, n in held) >= 0, (rank, held)


def test_cuda_report_and_timeline_draw_the_allocator(cuda_reports):
    # The closing report prints torch.cuda.max_memory_allocated for every rank, and says what gloo
    # does with CUDA tensors; the timeline of one step draws memory_allocated as a curve.
    transport, world, ranks = cuda_reports
    for (stage, bf16), r in ranks[0].items():
        out = r["stdout"]
        assert f"world size       | {world} ({transport.split('-')[1]}, device cuda)" in out, out
        line = re.search(r"^torch\.cuda\.max_memory_allocated per rank: (.*)$", out, re.M)
        assert line and len(line[1].split(", ")) == world, out
        assert ("(gloo's own reduce_scatter_tensor all-reduces a copy of the whole input,\n   "
                "through host memory" in out) == (transport == "cuda-gloo" and stage > 0), out
        assert "(gloo on CPU:" not in out
        events = r["timeline"]
        assert all(e["cuda"] > 0 for e in events)
        assert "torch.cuda.memory_allocated (activations too): most " in r["text"]
        curve = re.search(r'<polyline class="cuda" points="([^"]*)"', r["svg"])
        assert curve and len(curve[1].split()) == len(events)
    for rank, reports in enumerate(ranks[1:], 1):
        assert all(r["stdout"] == "" for r in reports.values()), rank  # rank 0 alone prints


def test_cuda_every_stage_trains_alike(cuda_reports):
    # The demo GPT, 8 units, prefetch on at stage 3: each stage's losses are stage 0's (within
    # rounding: the norm for clipping sums shards in another order; in bf16 a weight's rounding
    # can flip) and fall. With a stream hazard (a unit freed while a kernel still reads it, or
    # read before its all-gather has landed) they would not.
    transport, world, ranks = cuda_reports
    for reports in ranks:
        for bf16, tol in ((False, 1e-4), (True, 1e-2)):
            runs = [reports[(stage, bf16)]["losses"] for stage in range(4)]
            assert all(len(run) == 3 for run in runs) and runs[0][-1] < runs[0][0], runs
            for run in runs[1:]:
                assert max(abs(a - b) for a, b in zip(run, runs[0])) <= tol, (bf16, runs)


# ----------------------------------------------------------------------------------------------
# Where GPUs are visible: the device each rank computes on, chosen here with torch's GPU count
# faked (the logic; the CUDA runs above check the rest on a GPU)

@pytest.fixture
def gpus(monkeypatch, capsys):
    """gpus(n, local_world, visible=None): choose_device's answers as if n GPUs were visible to
    a process that is local rank 1 (or local_rank) of local_world (visible: its
    CUDA_VISIBLE_DEVICES)."""
    def choose(n, local_world, visible=None, backend=None, device=None, local_rank=1):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        backend, dev = zero.choose_device(backend, device)
        return backend, str(dev)
    return choose


def test_each_rank_computes_where_it_should(gpus, capsys):
    assert gpus(4, 4) == ("nccl", "cuda:1")  # a GPU per local rank: NCCL, this rank's own
    assert gpus(1, 4, visible="3") == ("nccl", "cuda:0")  # the launcher showed each its own one
    assert gpus(0, 4) == ("gloo", "cpu") and capsys.readouterr().err == ""
    assert gpus(2, 4, local_rank=0) == ("gloo", "cpu")  # fewer GPUs than ranks: the CPU, said once
    assert "note: 4 local ranks, 2 GPU(s): gloo on CPU tensors" in capsys.readouterr().err
    assert gpus(2, 4) == ("gloo", "cpu") and capsys.readouterr().err == ""
    assert gpus(1, 4, backend="gloo", device="cuda") == ("gloo", "cuda:0")  # sharing one GPU
    for n, local_world, backend, device, message in [(2, 4, "nccl", None, "NCCL needs one CUDA"),
                                                     (0, 1, None, "cuda", "--device cuda: no"),
                                                     (1, 1, None, "xpu", "xpu: zero.py computes")]:
        with pytest.raises(zero.UsageError, match=message):
            gpus(n, local_world, backend=backend, device=device)


def test_setup_uses_the_group_that_is_up(gpus, one_rank, monkeypatch):
    # a gloo group up already (the test pool's, a user's own): its ranks compute on the CPU,
    # whatever GPUs are visible, unless asked for CUDA tensors; another backend is refused
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert zero.setup()[2] == torch.device("cpu")
    with pytest.raises(zero.UsageError, match="--backend nccl, but the process group is gloo"):
        zero.setup("nccl")


@pytest.mark.parametrize("env", [{"RANK": "0"}, *[dict(
    {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, **bad)
    for bad in ({"MASTER_PORT": "abc"}, {"MASTER_PORT": "99999"}, {"WORLD_SIZE": "0"},
                {"RANK": "2"}, {"RANK": "-1"})]])
def test_rank_without_the_rest_of_torchruns_environment_is_one_line(env, monkeypatch):
    # RANK set means torchrun's store: without its address, port and world size (whole
    # numbers), a KeyError or ValueError traceback, before any store is made
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(zero.UsageError, match="RANK is set, but torchrun's environment is in"):
        zero._attempt_store(datetime.timedelta(seconds=1))


# A user's own script, in a process of its own: no process group up when it calls wrap(), a GPU
# visible (its count faked), a CPU model; it trains, destroys its group and ends
USERS_SCRIPT = """
import functools, os, torch, torch.distributed as dist
torch.cuda.device_count = lambda: 1
import zero  # before any process group, as zero.py says
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
opt = zero.wrap(model, 3, functools.partial(torch.optim.AdamW, lr=1e-3), units=list(model))
print(dist.get_backend(), opt.device)
model(torch.randn(4, 8)).sum().backward()
opt.step()
dist.destroy_process_group()
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(sum(name.startswith("pt_gloo") for name in threads))
"""


USERS_RUN = Early(USERS_SCRIPT, script="-c")


@pytest.fixture(scope="module")
def users_script():
    out = USERS_RUN.result()
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_wrap_of_a_cpu_model_makes_a_gloo_group_where_gpus_are_visible(users_script):
    # wrap() with no process group on a machine with a GPU: the group is one for the model's
    # device, gloo for a model on the CPU (NCCL would refuse its CPU tensors)
    assert users_script[:2] == ["gloo", "cpu"]


def test_a_script_exits_without_gloos_threads_alive(users_script):
    # The group and its gloo threads are gone with destroy_process_group(). Torch's lazily
    # imported torch.distributed.nn (the first optimizer imports it) would otherwise hold the
    # group through its defaults, and a thread letting go of the last collective's tensor during
    # the interpreter's exit aborts a run that succeeded (zero.py imports it first).
    assert users_script[2:] == ["0"]


@scenario(4)
def hybrid_in_a_new_group(rank, world):
    # Hybrid sharding's groups are made once per default group: after the default group is
    # destroyed and a new one made in the same processes (as the CUDA runs do, gloo then NCCL),
    # new ones are made, on every rank, not the destroyed ones found again.
    # The destroyed groups are let go, not kept by hybrid.py's cache of them (held, their gloo
    # threads would live into the interpreter's exit, and abort it: USERS_SCRIPT).
    import hybrid
    out, rows = [], slice(rank * B, (rank + 1) * B)
    for attempt in range(2):
        model, opt = wrapped(rank, 3, "sgd", seed=100, shard_size=2)
        run_steps(model, opt, opt.clip_grad_norm_, CASES["sgd"], rows, world, STEPS)
        out.append(opt.full_state_dict())
        del model, opt
        conftest.destroy_group()
        gc.collect()
        out.append(len(hybrid._GROUPS))  # default groups whose subgroups are still held
        store = dist.FileStore(os.path.join(os.environ["ZERO_TEST_TMP"], f"regroup{attempt}"),
                               world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return out


def test_hybrid_sharding_in_a_new_process_group(ran):
    want = reference("sgd", 4)
    for trained, held, trained_again, held_again in ran(hybrid_in_a_new_group, 4):
        assert held == held_again == 0
        for got in (trained, trained_again):
            assert_trains_like(got, want)

