"""Tests for zero.py and fsdp_demo.py, on the gloo backend, and where a GPU is visible also on CUDA
tensors (gloo and NCCL): every stage is checked against one single-process reference (plain model,
plain torch optimizer, the concatenation of all ranks' batches).

The ranks are the processes of one pool, started once (a process costs seconds of imports, a
scenario a fraction of that). Each world size (1, 2, 3, 4) is one run of N of them in a fresh gloo
group, which goes through every scenario for every stage (N = 4 runs twice: the resharding
checkpoints go 4 -> 2 -> 4 ranks); the tests below then check what the ranks recorded. The command
line runs end to end where that is what is checked (under torchrun, a rank killed, exit codes),
and is called in-process (zero.main) where the check is about a message. The CUDA cases (ids and
names with "cuda") run the same scenarios in a second pool, started only when one of them runs and
a GPU is visible; elsewhere they are skipped, saying what is missing (section "On a GPU").
Run: python -m pytest -q           (the CUDA cases alone: python -m pytest -q -k cuda -rs)

What the README claims, and the tests that check it (the formulas are the ZeRO paper's,
arXiv:1910.02054, as zero.py's docstring and the README give them):

- Every stage trains like single-process training: test_matches_single_process_reference (N = 1,
  2, 4; three optimizer and unit cases), test_three_ranks_match_the_reference (N = 3),
  test_every_backward_may_reduce, test_unused_parameters_and_out_of_place_accumulation,
  test_buckets_merge_and_split_units_and_change_nothing_else, test_each_way_of_reducing_trains_the_same,
  test_mixed_precision_trains_close_to_fp32 (bf16: close, not equal), test_clipping_really_clips
  (that those comparisons can fail), test_cli_every_stage_gives_the_same_losses (the demo GPT).
- Memory = formula: test_memory_matches_formula, test_mixed_precision_memory_matches_the_paper,
  test_sharded_state_is_never_whole, test_peak_follows_every_change, test_dropped_models_are_freed,
  test_estimate_reproduces_the_paper (also --stage, --ckpt-dir refused, Ψ = 1e30 in the columns),
  test_cli_trains_under_torchrun (the printed tables).
- Communication = formula: test_communication_matches_formula, test_mixed_precision_communication,
  test_every_backward_may_reduce, test_buckets_merge_and_split_units_and_change_nothing_else,
  test_each_way_of_reducing_trains_the_same, test_direct_exchange_equals_the_native_collectives,
  test_dispatcher_count_agrees_with_zero_own_count.
- Overlap on or off, bit-identical results: test_overlap_changes_nothing_but_timing (N = 1, 2, 4),
  test_three_ranks_match_the_reference (N = 3, where stage 0's differ within rounding).
- Resume is exact: test_resume_from_state_dict_is_exact, test_a_killed_rank_restarts_and_resumes_exactly,
  test_three_ranks_match_the_reference (float64 masters),
  test_checkpoints_with_bf16_compute_and_without_optimizer_state.
- Moving to FSDP and back (a zero.py checkpoint continues under FSDP2, an FSDP2 DCP checkpoint under
  zero.py, at another N and stage; weights out as .pt, .safetensors and DCP):
  test_a_run_moves_between_zero_and_fsdp2_with_the_same_losses, test_moving_keeps_every_weight_and_adam_value,
  test_moving_refuses_bad_input_in_one_line, test_consolidate_and_init_from.
- Resharding (a checkpoint of N ranks at one stage loads at M ranks at another):
  test_reshard_keeps_every_parameter_and_optimizer_value, test_reshard_trains_on_as_if_nothing_changed,
  test_checkpoints_with_bf16_compute_and_without_optimizer_state, test_consolidate_and_init_from.
- Bad input is one line on stderr and exit code 2: test_bad_input_is_one_line_and_exit_2,
  test_checkpoint_errors_are_one_line, test_bad_checkpoints_are_refused_before_anything_changes,
  test_fsdp_demo_bf16_and_bad_input, test_ranks_that_disagree_fail_fast, test_wrap_rejects_a_bad_stage;
  a dead rank is one line and exit code 1: test_a_dead_rank_ends_the_job.
- PyTorch's counterparts (DDP, ZeroRedundancyOptimizer, FSDP2) train like zero.py:
  test_pytorch_counterpart_trains_like_zero, test_pytorch_memory_and_communication,
  test_dispatcher_count_agrees_with_zero_own_count, test_fsdp_demo_compare_end_to_end,
  test_bench_prints_every_stage_against_pytorch.
- The same code runs as one process without torchrun (`python zero.py`):
  test_cli_runs_as_one_process_without_torchrun.
- torch's convention, opt.load_state_dict(opt.state_dict()) on the same ranks:
  test_resume_from_state_dict_is_exact.
- A stage-3 model in real code: test_activation_checkpointing_trains_like_the_reference (every
  stage, reentrant or not, early stop on or off), test_reading_a_stage3_parameter_is_an_error_not_a_crash,
  test_stage3_gathers_what_each_module_computes_with, test_default_units_find_the_blocks_at_any_depth,
  test_output_tensors_are_found_at_any_depth, test_stage3_hooks_a_unit_output_of_any_structure
  (outputs of any structure).
- Parameters without a gradient, as plain torch: one no rank gave a gradient (unused, or frozen after
  wrap) is not stepped, values and optimizer state, at every stage, in mixed precision, with hybrid
  sharding: test_unused_and_frozen_parameters_are_not_stepped_as_in_torch,
  test_unused_parameters_and_out_of_place_accumulation; checkpoints stay exact:
  test_parameters_stepped_apart_checkpoint_exactly; refused by name when unfrozen after wrap:
  test_a_parameter_unfrozen_after_wrap_is_refused_by_name.
- torch's gradient conventions: .grad None after backward where unused, the mean after step() where
  another rank used it (stages 0, 1): test_an_unused_parameters_grad_is_none_as_in_torch;
  zero_grad(set_to_none=False) keeps zeros that are stepped, model.to()/.float()/.half() work or are
  refused in one line: test_torch_gradient_conventions_and_conversions,
  test_unused_parameters_and_out_of_place_accumulation.
- Sparse gradients are refused by name, at wrap or in backward: test_sparse_gradients_are_refused_by_name.
- optimizer.gathered(): full values to read (and a no_grad forward inside), one block alone at stage 3, the
  memory held inside and not after, writeback with rank 0's values into shards and fp32 masters (the others'
  fp32 bits kept), refused inside a forward, every stage, fp32 and bf16: test_gathered_parameters_read_write_back_and_memory.
- Buffers (BatchNorm's running statistics), buffers="none" or "broadcast", against plain torch fed each
  rank's rows, rank 0's, and the global batch; agreed across ranks: test_buffers_broadcast_or_kept_per_rank.
- What breaks, and why (mistakes.py): each mistake shows its symptom, by a margin rounding cannot
  reach, and the right code beside it does not: test_each_mistake_shows_its_symptom_and_the_right_code_does_not;
  the table, --json, --list and bad input (one line, exit code 2): test_the_mistakes_lab_command_line.
- Ranks that disagree fail on every rank before anything is applied:
  test_ranks_that_disagree_fail_fast, test_settings_that_change_communication_must_agree,
  test_ranks_that_reduce_different_units_stop_before_the_step,
  test_ranks_that_disagree_are_one_line_under_torchrun.
- Checkpoints under abuse (one job per directory, rank 0 chooses, divergence, rotation, the
  manifest as data, one line): test_a_job_on_a_directory_in_use_is_refused_and_a_dead_jobs_lock_is_not,
  test_rank_0_chooses_the_checkpoint_and_a_full_disk_fails_every_rank,
  test_nonfinite_steps_are_never_applied_nor_saved, test_resume_applies_the_command_lines_lr,
  test_rotation_keeps_the_new_checkpoint_and_only_reads_exact_names,
  test_a_failed_manifest_write_leaves_the_previous_checkpoint, test_the_manifest_is_data,
  test_overwriting_a_checkpoint_of_the_same_step_is_atomic,
  test_bad_flags_are_one_line.
- The memory timeline: test_timeline_events_are_what_memory_breakdown_measures,
  test_timeline_svg_has_one_band_per_kind_and_stage, test_timeline_text_fits_100_columns,
  test_timeline_bad_input_is_one_line_and_exit_2.
- Hybrid sharding: test_hybrid_sharding_matches_the_reference,
  test_hybrid_memory_and_communication_by_group,
  test_hybrid_checkpoints_load_at_any_shard_size_stage_and_world,
  test_hybrid_pytorch_counterpart_trains_like_zero, test_estimate_reproduces_the_paper.
- The same on a GPU (CUDA tensors, the reference on CPU): every test above that takes `ranks` or
  `hybrid_runs`, again for the ids cuda-gloo-N2 and cuda-gloo-N4 (N ranks sharing one GPU over
  gloo) and cuda-nccl-N1, -N2, -N4 (NCCL, a GPU per rank), which covers stage 3 on CUDA streams
  with prefetch on and off; the allocator's bytes against the formula:
  test_cuda_peak_memory_is_within_the_formula, test_cuda_memory_between_steps_is_the_model_state;
  the report and the timeline's CUDA curve: test_cuda_report_and_timeline_draw_the_allocator;
  the demo GPT at every stage: test_cuda_every_stage_trains_alike; --max-memory on CUDA:
  test_cuda_max_memory_refuses_a_run_that_cannot_fit.
- Models no rank holds whole: built on the meta device, the weights are those of the normally built
  model given the same init (test_meta_model_equals_the_normally_built_one, every stage and hybrid),
  building holds one unit at a time (test_building_a_meta_model_holds_one_unit_at_a_time),
  load_full_state_dict reads only each rank's elements and refuses what does not fit
  (test_load_full_state_dict_reads_only_each_ranks_own_elements), clear refusals
  (test_meta_models_refused_clearly), a transformers-shaped model
  (test_transformers_shaped_model_on_the_meta_device), PyTorch's recipe with the same losses
  (test_pytorch_counterpart_trains_like_zero, test_fsdp_demo_compare_end_to_end, --init-from);
  --max-memory: test_max_memory_passes_what_fits_and_refuses_what_cannot; --largest-model:
  test_a_trial_out_of_memory_ends_only_that_trial, test_largest_model_finds_the_wall_of_each_stage
  (the guess and the bracket: 9 trials with no excess over the formula and with the README's, at
  most 3 a stage with a steeper one), test_peak_data_sees_a_peak_between_samples (what a trial
  held at the most), test_trial_reports_that_arrive_together_are_all_read.

No assertion depends on how fast anything runs. Where overlap is checked, collectives report
"not finished" until zero.py waits for them (landed_only_when_waited), so what is seen in flight
is what zero.py left in flight, on any schedule; the killed rank kills itself right after a given
checkpoint, not from outside at whatever step it has reached; --bench's times are only checked
against their own ratio, within the rounding of the printed columns.
"""
import argparse
import collections
import contextlib
import copy
import dataclasses
import functools
import gc
import io
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import types
import weakref
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import memory
import mistakes
import checkpoints
import zero

HERE = os.path.dirname(os.path.abspath(__file__))
DEVICE = torch.device("cpu")  # where a rank process computes: this rank's GPU in a CUDA run (_rank_process)
V, D, H, B, T = 13, 6, 11, 3, 5  # vocab, width, hidden, rows per rank, tokens per row
STEPS = 3
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
    "sgd-accum": dict(optimizer=functools.partial(torch.optim.SGD, lr=0.1), accum=2, clip=None, units=None),
}


class Net(nn.Module):
    """Awkward on purpose: 401 trainable parameters (divisible by neither 2 nor 4) in units of
    uneven size, the output head tied to the embedding, a frozen layer and a buffer."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)  # ranks build different weights: wrap must broadcast rank 0's
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D)) for _ in range(2))
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


def run_steps(model, optimizer, clip, case, rows, world, steps, start=0, after_step=lambda: None, no_sync=True):
    """The training loop, the same for zero.py (rows: this rank's) and the reference (rows: all).
    zero.py's micro-batches but the last run in no_sync() (no_sync=False: every backward reduces)."""
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
    units = {"blocks": list(model.blocks), "each": [model.emb, *model.blocks, model.norm, model.head],
             None: None}[CASES[case]["units"]]
    return model, zero.wrap(model, stage, CASES[case]["optimizer"], units=units, **kwargs)


def layout(opt):
    return {"psi": opt.psi, "S": [u.S for u in opt.units], "root": [not u.modules for u in opt.units],
            "emb": [any(p is opt.model.emb.weight for p in u.params) for u in opt.units],
            "pieces": len(opt.optimizer.param_groups[0]["params"])}  # the tensors the optimizer steps


# ----------------------------------------------------------------------------------------------
# What each rank runs

def watch(model, opt):
    """The most a rank held at any moment, sampled from inside forward and backward: bytes from
    memory_breakdown(), units gathered, full unit gradients held, reduce-scatters in flight and
    all-gathers prefetched. The hooks hold `opt` weakly (see zero._grad_hook)."""
    seen, ref = dict.fromkeys(["params", "grads", "gathered", "grads_held", "in_flight", "prefetching",
                               "untracked"], 0), weakref.ref(opt)

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


def run_scenarios(rank, world):
    out, rows = {}, slice(rank * B, (rank + 1) * B)  # this rank's rows of every global batch
    for stage in range(4):
        for case in CASES:
            model, opt = wrapped(rank, stage, case, seed=100)
            rec = watch(model, opt)
            comm = [dict(opt.comm)]

            def after_step():
                rec["mem"] = opt.memory_breakdown()  # after the step, before zero_grad
                comm.append(dict(opt.comm))
            # "adamw" is the run with overlap that test_overlap_changes_nothing_but_timing looks into
            with landed_only_when_waited() if case == "adamw" else contextlib.nullcontext():
                run_steps(model, opt, opt.clip_grad_norm_, CASES[case], rows, world, STEPS, after_step=after_step)
            rec["comm"] = [{k: b.get(k, 0) - a.get(k, 0) for k in b} for a, b in zip(comm, comm[1:])]
            rec["full"] = opt.full_state_dict()
            rec["layout"] = layout(opt)
            out[(stage, case)] = rec

        # Resume: 1 step, a checkpoint on disk, a fresh model with other weights loads it, 2 more
        # steps; against the uninterrupted 3 steps of the "adamw" run above.
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
        try:  # another rank's part, or another stage's, is refused
            opt.load_state_dict(dict(own, rank=(rank + 1) % world) if world > 1 else
                                dict(own, layout=dict(own["layout"], stage=stage - 1)))
            refused = None
        except checkpoints.CheckpointError as e:
            refused = str(e)
        model, opt = wrapped(rank, stage, "adamw", seed=500)
        checkpoints.load_checkpoint(opt, checkpoints.latest_checkpoint(root))
        run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, world, STEPS - 1, start=1)
        out[(stage, "resume")] = {"straight": out[(stage, "adamw")]["full"],
                                  "resumed": opt.full_state_dict(), "own": own_resumed,
                                  "moved": moved, "refused": refused}

        # Buckets of 300 bytes (Net's units: 312, 596, 596, 48 bytes and the head's bias): cut
        # from the last parameter backwards, small units merged, blocks split; stage 3 ignores it.
        model, opt = wrapped(rank, stage, "adamw", seed=100, bucket_bytes=300)
        comm = [dict(opt.comm)]
        run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, world, STEPS,
                  after_step=lambda: comm.append(dict(opt.comm)))
        out[(stage, "bucketed")] = {"full": opt.full_state_dict(), "layout": layout(opt),
                                    "names": [[n for n, _ in u] for u in zero.layout(opt)["units"]],
                                    "comm": [{k: b.get(k, 0) - a.get(k, 0) for k in b} for a, b in zip(comm, comm[1:])]}

        # Overlap off: the same run, every collective waited for where it is issued (under the same
        # landed_only_when_waited as the run with overlap: what is in flight is what is not waited for)
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

        # gloo's own reduce_scatter_tensor / all_gather_into_tensor (zero.DIRECT = False), and
        # zero.py's reduce-scatter as N reduces (A2A_BYTES = 0) instead of an all-to-all: the same
        # training, the same bytes counted
        for name, setting in [("native", ("DIRECT", False)), ("reduces", ("A2A_BYTES", 0))]:
            saved = getattr(zero, setting[0])
            setattr(zero, *setting)
            try:
                model, opt = wrapped(rank, stage, "adamw", seed=100)
                comm = [dict(opt.comm)]
                run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, world, STEPS,
                          after_step=lambda: comm.append(dict(opt.comm)))
            finally:
                setattr(zero, setting[0], saved)
            out[(stage, name)] = {"full": opt.full_state_dict(),
                                  "comm": [{k: b.get(k, 0) - a.get(k, 0) for k in b} for a, b in zip(comm, comm[1:])]}

        # Every backward reduces (no no_sync() around the first micro-batch): accumulating on top
        # of reduced gradients must still give the reference, at k times the communication.
        model, opt = wrapped(rank, stage, "sgd-accum", seed=100)
        comm = [dict(opt.comm)]
        run_steps(model, opt, opt.clip_grad_norm_, CASES["sgd-accum"], rows, world, STEPS,
                  after_step=lambda: comm.append(dict(opt.comm)), no_sync=False)
        out[(stage, "every-backward")] = {"full": opt.full_state_dict(), "layout": layout(opt),
                                          "comm": {k: v - comm[-2].get(k, 0) for k, v in comm[-1].items()}}

        # Mixed precision: bf16 compute, fp32 reductions (and bf16 reductions, at stage 2)
        for name, reduce_dtype in [("bf16", None)] + [("bf16-reduce", torch.bfloat16)] * (stage == 2):
            model, opt = wrapped(rank, stage, "adamw", seed=100, param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
            comm = [dict(opt.comm)]
            rec = watch(model, opt)

            def after_step():
                rec["mem"] = opt.memory_breakdown()
                comm.append(dict(opt.comm))
            run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, world, STEPS, after_step=after_step)
            rec["comm"] = {k: v - comm[-2].get(k, 0) for k, v in comm[-1].items()}
            rec.update(full=opt.full_state_dict(), layout=layout(opt), peak=dict(opt.peak),
                       dtypes={str(p.dtype) for p in model.parameters()})
            out[(stage, name)] = rec
    return out


def parameters_alive():
    # (isinstance(o, nn.Parameter) alone runs Python code for each of the process's objects)
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and isinstance(o, nn.Parameter)]


def scenarios(rank, world):
    # Parameters of earlier runs in this rank process are not counted (and are held here, so that
    # no parameter made below can take one's id).
    before = parameters_alive()
    out = run_scenarios(rank, world)
    gc.collect()  # every model and optimizer of these scenarios is garbage now: are they freed?
    gc.collect()  # (a second pass: what the first one frees lets go of more)
    known = {id(p) for p in before}
    out["params_alive"] = sum(id(p) not in known for p in parameters_alive())
    return out


# ----------------------------------------------------------------------------------------------
# The rank processes: one pool for the module, a fresh gloo group for each run

ZERO_SETTINGS = ("PIECE", "A2A_BYTES", "DIRECT")  # zero.py's module settings that scenarios change


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_process(conn):
    """A process of the pool. Each task: join a new process group as `rank` of `world`, call each
    function fn(rank, world) in turn, from zero.py's own settings, and save what they returned.
    The group: gloo on CPU tensors, or for a CUDA run (transport "cuda-gloo" or "cuda-nccl") that
    backend on the GPU zero.setup gives this rank (NCCL: its own; gloo: local rank modulo the
    GPUs, so N ranks share one GPU where there is one). CUDA is touched in CUDA runs only."""
    global DEVICE
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    defaults = {name: copy.deepcopy(getattr(zero, name)) for name in ZERO_SETTINGS}
    while (task := conn.recv()) is not None:
        rank, world, port, fns, shared, result, transport = task
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ZERO_TEST_TMP=shared)
        try:
            backend = "nccl" if transport == "cuda-nccl" else "gloo"
            DEVICE = torch.device("cpu") if transport == "cpu" else zero.choose_device(backend, "cuda")[1]
            dist.init_process_group(backend, timeout=timedelta(seconds=60))
            out = {}
            for fn in fns:
                for name, value in defaults.items():
                    setattr(zero, name, copy.deepcopy(value))
                out[fn] = globals()[fn](rank, world)
            torch.save(out if transport == "cpu" else on_cpu(out), result)  # the tests read them on CPU
            dist.destroy_process_group()
            conn.send(None)
        except BaseException:
            conn.send(traceback.format_exc())
    os._exit(0)  # skip interpreter teardown, which gloo's threads can abort (see zero.run)


class Pool:
    """Rank processes started once and reused by every run: each costs seconds of imports (torch,
    and torch._dynamo with the first optimizer), which a process per run would pay again and again."""

    def __init__(self, size):
        self.size, self.procs, self.conns = size, [], []

    def run(self, world, fns, shared, transport="cpu"):
        """[{fn: fn(rank, world)} for rank in range(world)]: the functions run in order on `world`
        ranks, which find the directory `shared` in $ZERO_TEST_TMP (transport: see _rank_process)."""
        if not self.procs or not all(proc.is_alive() for proc in self.procs):  # none yet, or one has gone
            self.close(kill=True)
            ctx = mp.get_context("spawn")
            for _ in range(self.size):
                here, there = ctx.Pipe()
                self.procs.append(ctx.Process(target=_rank_process, args=(there,), daemon=True))
                self.procs[-1].start()
                there.close()
                self.conns.append(here)
        port = _free_port()
        with tempfile.TemporaryDirectory() as tmp:
            files = [os.path.join(tmp, f"rank{r}.pt") for r in range(world)]
            try:
                for r in range(world):
                    self.conns[r].send((r, world, port, list(fns), str(shared), files[r], transport))
                errors = self._errors(world)
            except OSError:  # a rank process has ended
                errors = {r: self._gone(r) for r in range(world) if not self.procs[r].is_alive()} or {0: "no pipe"}
            if errors:
                self.close(kill=True)  # the others may wait for the failed rank: the next run starts new ones
                raise RuntimeError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
            return [torch.load(f, weights_only=False) for f in files]

    def _gone(self, r):
        self.procs[r].join(1)
        return f"the rank process ended, exit code {self.procs[r].exitcode} (negative: killed by that signal)"

    def _errors(self, world):
        """{rank: what went wrong}, empty if every rank answered that it is done. Returns at the
        first failure: the other ranks would only wait for the failed one until the group's timeout."""
        waiting, errors = set(range(world)), {}
        for _ in range(1200):  # (seconds: a limit only for a rank that hangs outside any collective)
            if errors or not waiting:
                return errors
            wait_for_any([self.conns[r] for r in waiting] + [self.procs[r].sentinel for r in waiting], timeout=1)
            for r in list(waiting):
                if self.conns[r].poll() or not self.procs[r].is_alive():
                    waiting.discard(r)
                    try:
                        errors[r] = self.conns[r].recv()
                    except EOFError:
                        errors[r] = self._gone(r)
                    if errors[r] is None:
                        del errors[r]
        return {r: "no answer" for r in waiting}

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


@pytest.fixture(scope="module")
def pool():
    ranks = Pool(4)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ranks"))  # what one run of the ranks leaves for the next


# One run per world size: every scenario for that N (a new one is a function fn(rank, world) in
# that list, and costs no process). The resharding chain orders them: the N = 4 ranks write a
# checkpoint (reshard_write), the N = 2 ranks read it and write theirs, which the N = 4 ranks read
# in a second run (world4_again).

@pytest.fixture(scope="module")
def world1(pool, shared):
    return pool.run(1, ["scenarios"], shared)


@pytest.fixture(scope="module")
def world4(pool, shared):
    return pool.run(4, ["scenarios", "collectives", "reshard_write", "hybrid", "meta_models", "tasks", "moving_write"],
                    shared)


@pytest.fixture(scope="module")
def world2(pool, shared, world4):
    damage_copies(shared)  # of the checkpoint world4 wrote, for reshard_read to refuse
    return pool.run(2, ["scenarios", "sometimes", "collectives", "disagree", "reshard_read", "fsdp_scenarios",
                        "small_bench", "fsdp_bad_input", "straight", "cli_errors", "real_code",
                        "timeline_runs", "abused_ranks", "meta_models", "tasks", "mistakes_lab", "moving",
                        "moving_write", "buffers_runs", "gathered_runs"], shared)


@pytest.fixture(scope="module")
def world3(pool, shared):
    return pool.run(3, ["three_ranks"], shared)


@pytest.fixture(scope="module")
def world4_again(pool, shared, world2):
    return pool.run(4, ["reshard_read", "fsdp_scenarios", "moving"], shared)


# The same scenarios on a GPU: each (transport, N) below is one run of N ranks on CUDA tensors, in
# a pool of its own that starts only when a CUDA case runs and a GPU is visible (cuda_runs). N
# ranks share one GPU over gloo (NCCL refuses two ranks on one GPU); NCCL runs where there is a
# GPU per rank, and with one rank on any GPU (what `python zero.py` does on a one-GPU machine).
CUDA_RUNS = [("cuda-nccl", 1), ("cuda-gloo", 2), ("cuda-gloo", 4), ("cuda-nccl", 2), ("cuda-nccl", 4)]
CUDA_FNS = {1: ["scenarios", "cuda_report"], 2: ["scenarios", "cuda_report"], 4: ["scenarios", "hybrid"]}


def run_id(run):
    transport, world = run
    return f"N{world}" if transport == "cpu" else f"{transport}-N{world}"


def cuda_missing(transport="cuda-gloo", world=1):
    """Why a CUDA run of `world` ranks over `transport` cannot run here; None if it can."""
    if not torch.cuda.is_available():
        built = torch.version.cuda or torch.version.hip
        return f"no CUDA GPU: {'none is visible' if built else 'this torch is built without CUDA'} " \
               f"(torch {torch.__version__})"
    if transport == "cuda-nccl" and not dist.is_nccl_available():
        return f"NCCL: this torch ({torch.__version__}) is built without it"
    if transport == "cuda-nccl" and torch.cuda.device_count() < world:
        return (f"NCCL needs a GPU per rank: {world} ranks, {torch.cuda.device_count()} GPU(s) visible "
                "(the cuda-gloo cases share one)")
    return None


def on_cpu(x):
    """x with every tensor in it moved to the CPU (dicts, lists and tuples opened)."""
    if torch.is_tensor(x):
        return x.cpu()
    if isinstance(x, dict):
        return type(x)({k: on_cpu(v) for k, v in x.items()})
    return type(x)(on_cpu(v) for v in x) if isinstance(x, (list, tuple)) else x


@pytest.fixture(scope="module")
def cuda_runs(tmp_path_factory):
    """run(transport, world): the results of that CUDA run (CUDA_FNS[world] on every rank), made
    once; the test is skipped, saying what is missing, where it cannot run."""
    pool, done = [], {}

    def run(transport, world):
        missing = cuda_missing(transport, world)
        if missing:
            pytest.skip(missing)
        if (transport, world) not in done:
            if not pool:  # the first CUDA run starts the pool
                pool.append(Pool(4))
            try:
                done[transport, world] = pool[0].run(world, CUDA_FNS[world], tmp_path_factory.mktemp(
                    run_id((transport, world))), transport)
            except Exception as e:  # every test of this run fails with it, without running it again
                done[transport, world] = e
        if isinstance(done[transport, world], Exception):
            raise done[transport, world]
        return done[transport, world]
    yield run
    if pool:
        pool[0].close()


def run_results(request, run, fn):
    """Every rank's result of `fn` in `run` = (transport, N): the CPU pool's, or a CUDA run's."""
    transport, world = run
    runs = request.getfixturevalue(f"world{world}") if transport == "cpu" else \
        request.getfixturevalue("cuda_runs")(transport, world)
    return [res[fn] for res in runs]


@pytest.fixture(scope="module", params=[("cpu", 1), ("cpu", 2), ("cpu", 4), *CUDA_RUNS], ids=run_id)
def ranks(request):
    return request.param[1], run_results(request, request.param, "scenarios")


# ----------------------------------------------------------------------------------------------
# Correctness: every stage trains exactly like the single-process reference

@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stage", range(4))
def test_matches_single_process_reference(ranks, stage, case):
    world, results = ranks
    want = reference(case, world)
    initial = {n: p.detach() for n, p in Net(seed=100).named_parameters()}
    for r, res in enumerate(results):
        got = res[(stage, case)]["full"]
        assert list(got) == list(want)
        for name in want:
            diff = (got[name] - want[name]).abs().max().item()
            assert diff <= 1e-5, f"rank {r} {name}: differs from the reference by {diff:.2e}"
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
    assert max((p.detach() - clipped[n]).abs().max().item() for n, p in model.named_parameters()) > 1e-4


@pytest.mark.parametrize("stage", range(4))
def test_resume_from_state_dict_is_exact(ranks, stage):
    world, results = ranks
    for res in results:
        r = res[(stage, "resume")]
        for name, t in r["straight"].items():
            assert torch.equal(t, r["resumed"][name]), name
            assert torch.equal(t, r["own"][name]), name  # opt.load_state_dict(opt.state_dict())
        assert any(not torch.equal(t, r["moved"][n]) for n, t in r["straight"].items() if "frozen" not in n)
        assert r["refused"] and "load_checkpoint" in r["refused"]


# ----------------------------------------------------------------------------------------------
# Memory: what memory_breakdown() measures equals the ZeRO paper's formula (arXiv:1910.02054,
# fp32 AdamW; zero.memory_formula)

@pytest.mark.parametrize("stage", range(4))
def test_memory_matches_formula(ranks, stage):
    world, results = ranks
    for res in results:
        rec = res[(stage, "adamw")]
        lay = rec["layout"]
        padded = world * sum(lay["S"])  # parameters incl. padding, per rank
        shard = lambda sharded: padded // world if sharded else padded
        exact = {"params": 4 * shard(stage >= 3), "grads": 4 * shard(stage >= 2),  # + AdamW's float32
                 "optimizer": 8 * shard(stage >= 1) + 4 * lay["pieces"]}  # step counter of each piece
        assert rec["mem"] == exact
        formula = zero.memory_formula(stage, lay["psi"], world)
        for kind in formula:  # the paper's formula, up to padding (< N elements per unit) and step counters
            assert abs(rec["mem"][kind] - formula[kind]) <= 8 * world * len(lay["S"]) + 4 * lay["pieces"], kind


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_state_is_never_whole(ranks, stage):
    # Stage 2: the full gradient of the whole model never exists at once (the reduce-scatter runs
    # during backward and frees each unit's). Stage 3: neither do the full parameters.
    world, results = ranks
    if world == 1:
        pytest.skip("with one rank a shard is the whole model")
    for res in results:
        for case in CASES:
            rec = res[(stage, case)]
            full, units = 4 * world * sum(rec["layout"]["S"]), len(rec["layout"]["S"])
            assert 1 <= rec["grads_held"] <= 2 < units  # full gradients of one or two units at a time
            if stage == 3:
                # at most three at once: the one computing, the next one prefetched, and the root
                # (or, with the tied head in a unit of its own, the embedding's unit)
                assert 1 <= rec["gathered"] <= 3 and (units <= 3 or rec["gathered"] < units)
            assert rec["in_flight"] <= 1  # overlap keeps one reduce-scatter in flight, as FSDP2
        if world == 4:  # in bytes too, without overlap's in-flight buffers (with N = 2 the tiny Net's
            off = res[(stage, "no-overlap")]  # root unit plus a block is more than the model)
            full = 4 * world * sum(res[(stage, "adamw")]["layout"]["S"])
            assert 0 < off["grads"] < full
            assert 0 < off["params"] < full if stage == 3 else off["params"] == full


@pytest.mark.parametrize("stage", range(4))
def test_peak_follows_every_change(ranks, stage):
    # opt.peak grows from a running total that Meter.event corrects one unit at a time, where
    # memory changes. Sampled from inside forward and backward, the total equals a full
    # measurement (memory_breakdown()) every time: no change goes uncounted.
    world, results = ranks
    for res in results:
        for key in [(stage, case) for case in CASES] + [(stage, "no-overlap"), (stage, "bf16")]:
            assert res[key]["untracked"] == 0, key


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
            {"reduce_scatter": k * ring, "all_gather": k * (2 * ring - root + (emb if root == 0 else 0))}][stage]
    if CASES[case]["clip"] and stage >= 1:
        want["all_reduce"] = 2 * (world - 1) * 4 / world  # the sum of squares for the global norm
    want["all_reduce"] = want.get("all_reduce", 0) + CHECK * (world - 1) / world
    return want


CHECK = 2 * 16  # ring bytes of the per-step check that ranks agree (zero.check_step_agrees)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stage", range(4))
def test_communication_matches_formula(ranks, stage, case):
    world, results = ranks
    for res in results:
        rec = res[(stage, case)]
        want = expected_comm(stage, case, world, rec["layout"])
        for step in rec["comm"]:
            assert {k: v for k, v in step.items() if v} == {k: v for k, v in want.items() if v}
        if case == "sgd" and stage < 3:  # the paper's 2Ψ(N-1)/N, up to padding
            formula = sum(zero.comm_formula(stage, rec["layout"]["psi"], world).values())
            assert abs(sum(rec["comm"][0].values()) - formula) <= 8 * world * len(rec["layout"]["S"])


@pytest.mark.parametrize("stage", range(4))
def test_every_backward_may_reduce(ranks, stage):
    # Without no_sync() every backward reduces (stages 2 and 3 always do): k = 2 reductions per
    # step, and the result is still the reference's.
    world, results = ranks
    want = reference("sgd-accum", world)
    for res in results:
        rec = res[(stage, "every-backward")]
        for name in want:
            assert (rec["full"][name] - want[name]).abs().max().item() <= 1e-5, name
        ring = 4 * (world - 1) * sum(rec["layout"]["S"])
        reductions = rec["comm"].get("all_reduce" if stage == 0 else "reduce_scatter", 0)
        check = CHECK * (world - 1) / world if stage == 0 else 0
        assert reductions == 2 * (2 * ring if stage == 0 else ring) + check


@pytest.mark.parametrize("stage", range(4))
def test_buckets_merge_and_split_units_and_change_nothing_else(ranks, stage):
    world, results = ranks
    want = reference("adamw", world)
    # Walking backwards from the head's bias (52 bytes), a bucket closes once it holds 300 bytes:
    # the norm and the last Linear of block 1 (388), then block 1's first Linear (308), block 0's
    # bias and last Linear (332), and what is left, block 0's first weight with the embedding.
    buckets = [["emb.weight", "blocks.0.0.weight"], ["blocks.0.0.bias", "blocks.0.2.weight", "blocks.0.2.bias"],
               ["blocks.1.0.weight", "blocks.1.0.bias"],
               ["blocks.1.2.weight", "blocks.1.2.bias", "norm.weight", "norm.bias", "head.bias"]]
    for res in results:
        rec, plain = res[(stage, "bucketed")], res[(stage, "adamw")]
        if stage == 3:
            assert rec["layout"]["S"] == plain["layout"]["S"]  # units as given: what a module gathers
        else:
            assert rec["names"] == buckets
        for name in want:
            assert (rec["full"][name] - want[name]).abs().max().item() <= 1e-5, name
        for step in rec["comm"]:  # the same bytes as the formula, in fewer calls
            assert {k: v for k, v in step.items() if v} == {k: v for k, v in expected_comm(stage, "adamw", world, rec["layout"]).items() if v}


# ----------------------------------------------------------------------------------------------
# Overlap: asynchronous reduce-scatters (stage 2) and prefetched all-gathers (stage 3)

@pytest.mark.parametrize("stage", range(4))
def test_overlap_changes_nothing_but_timing(ranks, stage):
    results = ranks[1]
    for res in results:
        on, off = res[(stage, "adamw")], res[(stage, "no-overlap")]
        for name, t in on["full"].items():
            assert torch.equal(t, off["full"][name]), name  # bit-identical (N = 1, 2, 4: see three_ranks)
        for name, t in res[(stage, "sgd")]["full"].items():
            assert torch.equal(t, res[(stage, "no-overlap sgd")][name]), name
        # Both runs are sampled under landed_only_when_waited: "in flight" is what zero.py has
        # issued and not waited for, whatever the backend had finished by then. (That the bytes
        # really move while backward computes is a matter of timing, and not asserted.) With
        # overlap, backward goes on while a reduction it launched is not waited for, and in stage
        # 3 while the next unit's all-gather is; without, every collective is waited for at once.
        assert on["in_flight"] >= 1 and off["in_flight"] == 0
        assert (on["prefetching"] >= 1 if stage == 3 else on["prefetching"] == 0) and off["prefetching"] == 0


@pytest.mark.parametrize("way", ["native", "reduces"])
@pytest.mark.parametrize("stage", range(4))
def test_each_way_of_reducing_trains_the_same(ranks, stage, way):
    world, results = ranks
    want = reference("adamw", world)
    for res in results:
        other, direct = res[(stage, way)], res[(stage, "adamw")]
        for name, t in other["full"].items():
            assert (t - want[name]).abs().max().item() <= 1e-5, name
        assert other["comm"] == direct["comm"]


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
        self.first, self.mid, self.extra, self.last = nn.Linear(D, D), Pair(), nn.Linear(D, D), nn.Linear(D, V)
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
            x, y = torch.randn(world * B, D, generator=g)[rows], torch.randint(V, (world * B,), generator=g)[rows]
            with opt.no_sync() if hasattr(opt, "no_sync") and micro == 0 else contextlib.nullcontext():
                F.cross_entropy(model(x), y).div(2).backward(create_graph=create_graph)
        opt.step()  # the reference: plain torch, which skips a parameter whose .grad is None
        opt.zero_grad(set_to_none=set_to_none)
        if step % 2 == 0 and set_to_none:
            model.zero_grad()


SOMETIMES_OPTIMIZERS = {"adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
                        "sgd": functools.partial(torch.optim.SGD, lr=0.1)}  # SGD: sees a factor off


def sometimes(rank, world):
    out = {}
    for stage in range(4):
        for create_graph in (False, True) if stage < 2 else (False,):
            for name, optimizer in SOMETIMES_OPTIMIZERS.items():
                model = Sometimes()
                opt = zero.wrap(model, stage, optimizer, units=[model.first, model.mid, model.extra, model.last])
                sometimes_steps(model, opt, slice(rank * B, (rank + 1) * B), world, create_graph)
                out[(stage, create_graph, name)] = opt.full_state_dict()
        model = Sometimes()  # zero_grad(set_to_none=False)
        opt = zero.wrap(model, stage, SOMETIMES_OPTIMIZERS["adamw"], units=[model.first, model.mid, model.extra, model.last])
        sometimes_steps(model, opt, slice(rank * B, (rank + 1) * B), world, False, set_to_none=False)
        out[(stage, "zeros", "adamw")] = opt.full_state_dict()
    return out


def test_unused_parameters_and_out_of_place_accumulation(world2):
    # Stages 0 and 1 keep p.grad as a view into their buffer and do not zero it in zero_grad():
    # a gradient that arrives as a new tensor (after zero_grad, or accumulated out of place by
    # create_graph=True) is copied over last step's values, and a parameter that gets none has its
    # values zeroed. Wrong either way, these runs would differ from the reference. A parameter
    # unused in a step is not stepped at all, as plain torch skips it (AdamW's decay would show).
    # zero_grad(set_to_none=False) keeps zeros, which both step (AdamW decays a parameter unused).
    world, want = 2, {}
    for name, optimizer in [*SOMETIMES_OPTIMIZERS.items(), ("zeros", SOMETIMES_OPTIMIZERS["adamw"])]:
        model = Sometimes()
        sometimes_steps(model, optimizer(model.parameters()), slice(None), world, False, set_to_none=name != "zeros")
        want[name] = {n: p.detach() for n, p in model.named_parameters()}
    assert (want["zeros"]["extra.weight"] - want["adamw"]["extra.weight"]).abs().max() > 1e-4  # they differ
    for res in world2:
        for (stage, create_graph, opt_name), got in res["sometimes"].items():
            for name, t in got.items():
                key = "zeros" if create_graph == "zeros" else opt_name
                assert (t - want[key][name]).abs().max().item() <= 1e-5, (stage, create_graph, opt_name, name)


# ----------------------------------------------------------------------------------------------
# Training code as users write it: outputs of any structure at stage 3, parameters that get no
# gradient in a step (not stepped, as plain torch), frozen after wrap(), sparse gradients refused

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


TASKS_OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)  # decay: a stepped parameter moves
RARE_ROWS = {0: [], 1: [0], 2: [0, -1], 3: [-1]}  # step -> rows of the global batch that use `rare`


def tasks_steps(model, opt, rows, world, steps, around_step=None):
    for step in steps:
        model.step = step
        if step >= 2:
            model.first.weight.requires_grad_(False)  # the fine-tuning schedule: frozen mid-training
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


UNUSED = {0: {"aux.weight", "aux.bias", "rare.weight", "rare.bias"}, 1: set(),  # step -> what no rank
          2: {"aux.weight", "aux.bias", "first.weight"}, 3: {"first.weight"}}   # gives a gradient


def snapshot(opt):
    """Every parameter's fp32 values, the optimizer state of the pieces each one owns on this rank,
    and the aux unit's compute copy (bf16 in mixed precision)."""
    names, state = {p: n for n, p in opt.model.named_parameters()}, {}
    for u in opt.units:
        for piece, owners in zip(u.pieces, u.owners):
            for p in owners:
                state.setdefault(names[p], []).append({k: v.clone() for k, v in opt.optimizer.state.get(piece, {}).items()})
    aux = next(u for u in opt.units if opt.model.aux in u.modules)
    return {"values": opt.full_state_dict(), "state": state, "aux compute": aux.shard.clone()}


def tasks(rank, world):
    out, rows = {}, slice(rank * B, (rank + 1) * B)
    if world == 4:  # hybrid sharding: G = 2 groups of 2
        runs = [(stage, dict(shard_size=2)) for stage in range(1, 4)]
    else:
        runs = [(stage, kwargs) for stage in range(4) for kwargs in ({}, dict(param_dtype=torch.bfloat16))]
        runs.append((2, dict(check_steps=False)))  # the mask's all-reduce is made without the check
    for stage, kwargs in runs:
        model = Tasks()
        opt = zero.wrap(model, stage, TASKS_OPTIMIZER, units=[*model.blocks, model.head, model.aux], **kwargs)
        rec = {"around": {}, "gathered": []}
        modules = {"blocks.0": model.blocks[0], "blocks.1": model.blocks[1], "head": model.head, "aux": model.aux}
        units = {n: next(u for u in opt.units if m in u.modules) for n, m in modules.items()}

        def after_forward(module, args, output):
            if module.step == 0:  # which units the first forward left gathered
                rec["after_forward"] = {n: u.gathered for n, u in units.items()}
        model.register_forward_hook(after_forward)

        def around_step(step, do):
            rec["gathered"].append(any(u.gathered for u in opt.units if u.modules))  # after backward
            before, none = snapshot(opt), {n for n, p in model.named_parameters() if p.grad is None}
            do()
            rec["around"][step] = (before, snapshot(opt))
            rec.setdefault("grad None", {})[step] = (none, {n for n, p in model.named_parameters() if p.grad is None})
        tasks_steps(model, opt, rows, world, range(4), around_step)
        rec["full"] = opt.full_state_dict()
        rec["per parameter"] = [u.per_parameter for u in opt.units]  # which units were cut again
        out[(stage, str(kwargs))] = rec
    if world == 4:
        return out
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
    out["resumed"] = opt.full_state_dict()
    return out


@pytest.fixture(scope="module")
def tasks_runs(world2, world4):
    return [res["tasks"] for res in world2], [res["tasks"] for res in world4]


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
                if key == "resumed":
                    continue
                got = rec["full"]
                if "bfloat16" in key[1]:  # bf16 compute: close, not equal
                    off = sum((got[n] - want[n]).pow(2).sum() for n in want).sqrt()
                    assert off < 0.1 * sum((want[n] - initial[n]).pow(2).sum() for n in want).sqrt(), key
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
                        for a, b in zip(before["state"].get(name, []), after["state"].get(name, [])):
                            assert (a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)) == same
                    assert torch.equal(before["aux compute"], after["aux compute"]) == (step % 2 == 0)
                    aux = before["state"]["aux.weight"]  # no optimizer state until aux's first step (step 1)
                    assert aux and all(s == {} for s in aux) == (step <= 1)
                if key[0] == 3:  # after backward only the root unit may still be gathered: none is
                    assert rec["gathered"] == [False] * 4
                # Pieces per parameter only where a piece held parameters with and without a gradient:
                # the root unit (first and rare) on rank 0, never a unit used whole or not at all
                assert rec["per parameter"][:4] == [False] * 4 and (rec["per parameter"][4] or res is not results[0])


def test_an_unused_parameters_grad_is_none_as_in_torch(tasks_runs):
    # After backward, .grad is None for what this rank did not use (stages 2 and 3: for every
    # parameter, their gradients live in shards); after step() at stages 0 and 1, for what no rank
    # used only, as DDP: `rare`, used on one rank at steps 1 and 3, shows the mean on the other.
    for world, results in zip((2, 4), tasks_runs):
        names = set(tasks_reference(world))
        for rank, res in enumerate(results):
            for key, rec in res.items():
                for step, (after_backward, after_step) in rec.get("grad None", {}).items() if key != "resumed" else ():
                    rare = {"rare.weight", "rare.bias"}
                    here = any(i % (world * B) // B == rank for i in RARE_ROWS[step])
                    want = (names, names) if key[0] >= 2 else (UNUSED[step] | (set() if here else rare), UNUSED[step])
                    assert (after_backward, after_step) == want, (world, rank, key, step)


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
        x, y = torch.randn(world * B, D, generator=g) * (step + 1) + step, torch.randint(V, (world * B,), generator=g)
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()


def buffers_runs(rank, world):
    out = {}
    for stage in range(4):
        for buffers in ("none", "broadcast"):
            model = Normed()
            opt = zero.wrap(model, stage, TASKS_OPTIMIZER, units=list(model.blocks), buffers=buffers)
            starts = []  # the buffers as each forward starts (after zero.py's broadcast, if any)
            model.register_forward_pre_hook(lambda m, a: starts.append({n: b.clone() for n, b in model.named_buffers()}))
            normed_steps(model, opt, slice(rank * B, (rank + 1) * B), world)
            out[(stage, buffers)] = {"starts": starts, "end": {n: b.clone() for n, b in model.named_buffers()},
                                     "comm": dict(opt.comm)}
    try:
        zero.wrap(Normed(), 0, TASKS_OPTIMIZER, buffers="broadcast" if rank else "none")
    except ValueError as e:
        out["disagree"] = str(e)
    return out


def test_buffers_broadcast_or_kept_per_rank(world2, one_rank):
    # BatchNorm on N ranks normalizes by each rank's batch (as plain DDP without SyncBatchNorm),
    # so no choice makes its running statistics those of plain torch on the global batch:
    #   "none" (default): rank r's statistics are plain torch's fed rank r's rows, each rank its
    #     own; the mean over ranks of running_mean is plain torch's on the global batch (the
    #     update is linear in the batch mean); running_var is not (the variance is not).
    #   "broadcast": every forward starts from rank 0's on every rank, plain torch's fed rank 0's
    #     rows; after the last forward each rank has added its own batch once.
    world = 2

    def plain(rows):
        model, stats = Normed(), []
        model.register_forward_pre_hook(lambda m, a: stats.append({n: b.clone() for n, b in model.named_buffers()}))
        normed_steps(model, torch.optim.SGD(model.parameters(), lr=0), rows, world)
        return stats, {n: b.clone() for n, b in model.named_buffers()}
    per_rank = [plain(slice(r * B, (r + 1) * B)) for r in range(world)]
    whole = plain(slice(None))[1]
    for stage in range(4):
        none, broadcast = ([res["buffers_runs"][(stage, b)] for res in world2] for b in ("none", "broadcast"))
        for rank in range(world):
            for got, want in zip(none[rank]["starts"] + [none[rank]["end"]], per_rank[rank][0] + [per_rank[rank][1]]):
                assert all(torch.allclose(got[n], want[n]) for n in want), (stage, rank)
            assert not torch.allclose(none[rank]["end"]["norm.running_var"], whole["norm.running_var"])
            for got, want in zip(broadcast[rank]["starts"], per_rank[0][0]):  # rank 0's, on every rank
                assert all(torch.allclose(got[n], want[n]) for n in want), (stage, rank)
            assert broadcast[rank]["comm"]["broadcast"] > 0 and "broadcast" not in none[rank]["comm"]
        mean = (none[0]["end"]["norm.running_mean"] + none[1]["end"]["norm.running_mean"]) / 2
        assert torch.allclose(mean, whole["norm.running_mean"], atol=1e-6)
        assert not torch.allclose(none[0]["end"]["norm.running_mean"], none[1]["end"]["norm.running_mean"])
    for res in world2:
        assert res["buffers_runs"]["disagree"].startswith("zero: ranks disagree: rank 0 has buffers")
    with pytest.raises(ValueError, match="^zero: buffers must be 'broadcast' or 'none', not 'sync'$"):
        zero.wrap(Normed(), 0, TASKS_OPTIMIZER, buffers="sync")


def gathered_runs(rank, world):
    # opt.gathered(): full values to read (and a no_grad forward inside), one block alone, what
    # is written kept (writeback: rank 0's wins, into shards and fp32 masters), and refused
    # inside a forward; at every stage, in fp32 and bf16, each rank's weights different at first.
    out, x = {}, global_batch(0, 0, world)[0]
    for stage in range(4):
        for dtype in (None, torch.bfloat16):
            model, opt = wrapped(rank, stage, "adamw", seed=100, param_dtype=dtype)
            run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], slice(rank * B, (rank + 1) * B), world, 1)
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


def test_gathered_parameters_read_write_back_and_memory(world2):
    world = 2
    for stage in range(4):
        for dtype in ("None", "torch.bfloat16"):
            recs = [res["gathered_runs"][(stage, dtype)] for res in world2]
            plain = Net(seed=100)
            plain.load_state_dict(recs[0]["full"], strict=False)
            with torch.no_grad():
                want = plain(global_batch(0, 0, world)[0])
            for rec in recs:
                exact = dtype == "None"
                for name, t in rec["full"].items():  # what a reader sees: the model's values
                    got = rec["read"][name].float()
                    assert torch.equal(got, t) if exact else torch.allclose(got, t, atol=1e-2), (stage, dtype, name)
                assert torch.allclose(rec["logits"], want, atol=1e-5 if exact else 0.1), (stage, dtype)
                # stage 3 holds the full parameters inside only (once more than its 1/N shards)
                assert (rec["inside"] > rec["outside"]) == (stage == 3) and rec["after"] == rec["outside"]
                assert rec["one block"] == [stage < 3 or i == 1 for i in range(len(rec["one block"]))]
                w = rec["written"]["blocks.1.0.weight"]  # rank 0's value, exactly, in the fp32 masters
                assert torch.equal(w, torch.ones_like(w)) and rec["written"]["blocks.1.0.bias"][0] == 1.0
                assert torch.equal(rec["compute"], torch.ones_like(rec["compute"]))
                for name, t in rec["written"].items():
                    if name not in ("blocks.1.0.weight", "blocks.1.0.bias"):
                        assert torch.equal(t, rec["full"][name]), (stage, dtype, name)  # fp32 bits kept
                    assert torch.equal(rec["rewritten"][name], t), (stage, dtype, name)
                assert rec["refused"].startswith("zero: optimizer.gathered() inside a forward or backward")


def test_parameters_stepped_apart_checkpoint_exactly(tasks_runs, shared):
    # Stage 3 -> stage 1 -> stage 0, where parameters have no optimizer state (step 1: aux and
    # rare never got a gradient) or another step count than the rest (step 3): each parameter's
    # is saved by name, and the run goes on as the uninterrupted one.
    for res in tasks_runs[0]:
        for name, t in tasks_reference(2).items():
            assert (res["resumed"][name] - t).abs().max().item() <= 1e-5, name
    steps = lambda ckpt: {n: int(s["step"]) for n, s in full_checkpoint(os.path.join(shared, "tasks", ckpt))["scalars"].items()}
    names = set(tasks_reference(2))
    assert steps("step_00000001") == {n: 1 for n in names if not n.startswith(("aux", "rare"))}
    fewer = {"aux.weight": 1, "aux.bias": 1, "rare.weight": 2, "rare.bias": 2, "first.weight": 2}
    assert steps("step_00000003") == {n: fewer.get(n, 3) for n in names}
    state = full_checkpoint(os.path.join(shared, "tasks", "step_00000001"))
    assert all(state[key, "aux.weight"].abs().sum() == 0 for key in ("exp_avg", "exp_avg_sq"))  # no state: zeros


def test_stage3_hooks_a_unit_output_of_any_structure(tasks_runs):
    # The dataclass block is freed after forward and gathered again when backward reaches its
    # output; the __slots__ block, whose output hides its tensor, stays gathered until its
    # gradient is reduced. Both train exactly (test above).
    for results in tasks_runs:
        for res in results:
            rec = res[(3, "{}")] if (3, "{}") in res else res[(3, "{'shard_size': 2}")]
            assert rec["after_forward"] == {"blocks.0": False, "blocks.1": True, "head": False, "aux": False}


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
            self.x, self.me, self.module = t[4], self, nn.Linear(1, 1)  # a cycle; a module is not opened
    hidden = Slotted(t[5])
    output = {"pair": Pair(t[0], [t[1]]), "record": Record(t[2], {"k": (t[3], "text")}), "obj": Obj(),
              "slots": hidden, "none": None}
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_clipping_in_any_dtype_is_torchs(one_rank, dtype):
    # The norm is taken in the gradients' dtype, at least float32 (bf16 squares would round
    # away): float64 gradients keep float64, as torch's clip_grad_norm_ does (float32 raised).
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(D, D), nn.Linear(D, V)).to(dtype), torch.randn(B, D, dtype=dtype)
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
    # As plain torch: an unused parameter's .grad is None after backward; zero_grad(set_to_none=False)
    # leaves zeros, which backward adds to and AdamW steps (the middle layer, used at step 0 only,
    # decays at step 1). model.to()/.float()/.half() work where they change nothing and are
    # refused in one line where they would convert a unit's parameters.
    def build():
        torch.manual_seed(3)
        return Three(nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, V))
    plain, model = build(), build()
    ref = TASKS_OPTIMIZER(plain.parameters())
    opt = zero.wrap(model, stage, TASKS_OPTIMIZER, units=[model[0], model[1]])
    for bad, named in ((model.half, "0.weight"), (functools.partial(model.to, torch.float64), "0.weight"),
                       (model[1].double, "1.weight"), (model[2].half, "2.weight")):  # the module's own
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
    zero.wrap(model, stage, optimizer)
    with pytest.raises(RuntimeError) as e:
        model(torch.arange(B)).sum().backward()
    assert str(e.value).startswith("zero: table got a sparse gradient (torch.sparse_coo)")


class TwoDtypes(nn.Module):
    """A float64 layer, then a float32 one: buckets must not mix them (one flat buffer, one dtype)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = nn.Linear(D, D).double(), nn.Linear(D, V)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.double())).float())


def two_dtypes_steps(model, opt, rows, world, steps=range(2)):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(world * B, D, generator=g)[rows], torch.randint(V, (world * B,), generator=g)[rows]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def three_ranks(rank, world):
    out, rows = {}, slice(rank * B, (rank + 1) * B)
    for stage in range(3):
        model = TwoDtypes()
        opt = zero.wrap(model, stage, functools.partial(torch.optim.SGD, lr=0.1), bucket_bytes=1 << 20)
        two_dtypes_steps(model, opt, rows, world)
        out[(stage, "two dtypes")] = ({n: t.double() for n, t in opt.full_state_dict().items()},
                                      [sorted({str(p.dtype) for p in u.params}) for u in opt.units])
        # resumed from a checkpoint after step 1: the same bits, float64 masters included
        root = os.path.join(os.environ["ZERO_TEST_TMP"], f"two-dtypes-N{world}-{stage}")
        runs = []
        for steps in (range(2), range(1), range(1, 2)):  # straight; to the checkpoint; from it
            model = TwoDtypes()
            opt = zero.wrap(model, stage, functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), bucket_bytes=1 << 20)
            if steps.start == 1:
                checkpoints.load_checkpoint(opt, checkpoints.latest_checkpoint(root))
            two_dtypes_steps(model, opt, rows, world, steps)
            if steps.stop == 1:
                checkpoints.save_checkpoint(opt, root, 1)
            runs.append(opt.full_state_dict())
        out[(stage, "two dtypes resumed")] = (runs[0], runs[2])
    for stage in range(4):
        for case, no_sync in (("sgd", True), ("sgd-accum", True), ("sgd-accum", False)):
            for overlap in (True, False):
                model, opt = wrapped(rank, stage, case, seed=100, overlap=overlap)
                run_steps(model, opt, opt.clip_grad_norm_, CASES[case], rows, world, STEPS, no_sync=no_sync)
                out[(stage, case, no_sync, overlap)] = opt.full_state_dict()
    return out


def test_three_ranks_match_the_reference(world3):
    # N = 3, where 1/N is not exact in binary: stage 0 divides by N as it copies gradients into a
    # bucket reduced in this backward (one backward per step, or the first of several), after the
    # all-reduce otherwise; shards of 401 / 3 elements. Both within rounding of the reference.
    want = {case: reference(case, 3) for case in ("sgd", "sgd-accum")}
    model = TwoDtypes()
    two_dtypes_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), slice(None), 3)
    for res in (dict(r["three_ranks"]) for r in world3):
        for stage in range(3):  # and a model in two dtypes, bucketed: one bucket per dtype
            got, dtypes = res.pop((stage, "two dtypes"))
            assert dtypes == [["torch.float64"], ["torch.float32"]]
            straight, resumed = res.pop((stage, "two dtypes resumed"))
            assert straight["a.weight"].dtype == torch.float64 and straight["b.weight"].dtype == torch.float32
            assert all(torch.equal(straight[n], resumed[n]) for n in straight), stage
            for name, p in model.named_parameters():
                assert (got[name] - p.detach().double()).abs().max().item() <= 1e-5, (stage, name)
        for (stage, case, no_sync, overlap), got in res.items():
            for name, t in got.items():
                assert (t - want[case][name]).abs().max().item() <= 1e-5, (stage, case, no_sync, overlap, name)


def collectives(rank, world):
    """zero.reduce_scatter / zero.all_gather (their own way on gloo) against gloo's own calls; the
    reduce-scatter both as an all-to-all and (A2A_BYTES = 0) as N reduces."""
    out = []
    for dtype, a2a_bytes in itertools.product((torch.float32, torch.bfloat16), (zero.A2A_BYTES, 0)):
        zero.A2A_BYTES = a2a_bytes
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
                full, flat = torch.empty(world * S, dtype=dtype), torch.zeros(world * S, dtype=dtype)
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
def test_direct_exchange_equals_the_native_collectives(request, world):
    for rank_out in (res["collectives"] for res in request.getfixturevalue(f"world{world}")):
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
    world, results = ranks
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
    world, results = ranks
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
    world, results = ranks
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
    world, results = ranks
    assert [res["params_alive"] for res in results] == [0] * world


# ----------------------------------------------------------------------------------------------
# The library's own checks

def test_wrap_rejects_a_bad_stage():
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        zero.wrap(Net(seed=0), 4, torch.optim.SGD)


def main_printed(main, argv):
    """What main(argv) prints (in this process: no launch, no process group for these)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(argv)
    return printed.getvalue()


def estimate_rows(stdout):
    """{stage: (total GB, elements sent inside a group, across groups)} from --estimate."""
    rows = {}
    for line in stdout.splitlines():
        m = re.match(r"([0-3]) .*?([\d.]+) GB +([\d.e+]+) +([\d.e+]+)$", line)
        if m:
            rows[int(m[1])] = (float(m[2]), float(m[3]), float(m[4]))
    return rows


def test_estimate_reproduces_the_paper():
    rows = estimate_rows(main_printed(zero.main, ["--estimate", "--params", "7.5e9", "--world-size", "64"]))
    assert [rows[s][0] for s in range(4)] == [120.0, 31.4, 16.6, 1.9]
    assert [rows[s][1] for s in range(4)] == [1.477e10] * 3 + [2.215e10]  # 2Ψ or 3Ψ (N-1)/N
    assert all(rows[s][2] == 0 for s in range(4))
    out = main_printed(zero.main, ["--estimate", "--params", "1e9", "--world-size", "8"])  # 16, 5.5, 3.75, 2 GB
    assert [estimate_rows(out)[s][0] for s in range(4)] == [16.0, 5.5, 3.8, 2.0]
    # hybrid, G = 8 of N = 64: stage 3 holds 16Ψ/8; only 2Ψ/G (R-1)/R elements cross groups
    rows = estimate_rows(main_printed(zero.main, ["--estimate", "--params", "7.5e9", "--world-size", "64",
                                                  "--shard-size", "8"]))
    assert rows[3][0] == 15.0 and rows[3][2] == 1.641e9 and rows[0][2] == 1.477e10
    with pytest.raises(zero.UsageError, match="--shard-size 7 does not divide --world-size 64"):
        zero.main(["--estimate", "--params", "7.5e9", "--world-size", "64", "--shard-size", "7"])
    # --stage: that stage's row alone, and its communication; --ckpt-dir refused; Ψ = 1e30 fits
    out = main_printed(zero.main, ["--estimate", "--params", "7.5e9", "--world-size", "64", "--stage", "1"])
    assert estimate_rows(out) == {1: (31.4, 1.477e10, 0.0)} and "2Ψ(N-1)/N for stage 1" in out
    with pytest.raises(zero.UsageError, match="^--ckpt-dir is for training: --estimate trains nothing$"):
        zero.main(["--estimate", "--params", "7.5e9", "--world-size", "64", "--ckpt-dir", "x"])
    out = main_printed(zero.main, ["--estimate", "--params", "1e30", "--world-size", "64"])
    table = out.splitlines()[4:9]
    assert len({len(line) for line in table}) == 1 and len(table[0]) <= 100, table  # the columns hold
    assert [float(line.split()[-4]) for line in table[1:]] == [2e22, 4e21, 2e21, 3e20]  # total, GB


# ----------------------------------------------------------------------------------------------
# What breaks, and why (mistakes.py): every mistake, run beside the right code at N = 2

def mistakes_lab(rank, world):
    """Every mistake in quick mode (fewer steps, a hang ended after 1 s), then the command line
    as torchrun runs it, on two mistakes, with --json."""
    out = {"results": mistakes.run_lab([], quick=True)}
    path = os.path.join(os.environ["ZERO_TEST_TMP"], "mistakes.json")
    out["printed"] = main_printed(mistakes.main, ["--json", path, "no-divide-sgd", "units-out-of-order"])
    return out


def tiny_bytes(stage, kind, world):
    """The formula's bytes of mistakes.py's model (fp64 AdamW: 8, 8 and 16 bytes a parameter)."""
    psi = sum(p.numel() for p in mistakes.Tiny().parameters())
    return zero.memory_formula(stage, psi, world, 8, 8, 16)[kind]


ROUNDING = 1e-12  # float64: the right code meets the reference within rounding (1e-16 a step)
BLOCK = 8 * (mistakes.D * mistakes.H * 2 + mistakes.H + mistakes.D)  # bytes of one block unit
ROOT = 8 * (mistakes.V * mistakes.D + 2 * mistakes.D + mistakes.D * 2 + 2)  # emb, norm, aux


def mistake_symptoms(name, r, world):
    """(the wrong code shows the symptom, the right code shows it) for one mistake's results."""
    wrong, right = r["wrong"], r["right"]
    if name in ("late-reduce-scatter", "no-sync-stage-2"):
        # wrong: every unit's full gradient at once (stage 1's 8Ψ) on top of the shards; right:
        # the shards and a few unit buffers in flight (the one filling, two reductions and gloo's
        # receive buffers at a launch), far below that
        shards, full = tiny_bytes(2, "grads", world), tiny_bytes(1, "grads", world)
        trains = r["right_distance"] < ROUNDING and (r["wrong_distance"] < ROUNDING) == (name == "late-reduce-scatter")
        return wrong >= full + shards and trains, right > shards + 5 * BLOCK or r["right_distance"] > ROUNDING
    if name == "one-unit":  # the whole model gathered; right: the shards, the root and two blocks
        shards, full = tiny_bytes(3, "params", world), tiny_bytes(0, "params", world)
        return (wrong >= full + shards and r["wrong_distance"] < ROUNDING,
                right > shards + ROOT + 2 * BLOCK + 64 or r["right_distance"] > ROUNDING)
    if name == "no-regather":
        return wrong.startswith("RuntimeError: "), not isinstance(right, float)
    if name == "eval-on-rank-0":
        # (how long the 1-second timeout took to end it is the machine's: not checked)
        return wrong.startswith("hang: ") and re.search(r"timeout after \d+\.\d s", wrong), not isinstance(right, float)
    if name == "state-dict-at-stage-3":  # a file written, which only loading finds empty
        return wrong.startswith("torch.save wrote ") and "; torch.load: " in wrong, right != 0
    if name == "optimizer-before-wrap":  # nothing moved
        return wrong == 0, right < 1e-3
    if name == "step-without-gradient":  # the unused head moved; as in torch, not at all
        return wrong > 1e-4, right != 0
    if name == "no-divide-adamw":  # visible above rounding, and far below SGD's
        return wrong > 1000 * ROUNDING, right > ROUNDING
    if name == "local-clip":  # float32 (zero.py's clipping norm is float32)
        return wrong > 1e-3, right > 1e-6
    if name == "same-batch":  # both comparisons: it trained exactly like rank 0's rows alone
        return wrong > 1e-3 and r["wrong_one"] < ROUNDING, right > ROUNDING or r["right_one"] < 1e-3
    return wrong > 1e-3, right > ROUNDING  # a distance, a loss gap or the replicas' spread


@pytest.mark.parametrize("name", list(mistakes.MISTAKES))
def test_each_mistake_shows_its_symptom_and_the_right_code_does_not(world2, name):
    r = world2[0]["mistakes_lab"]["results"][name]
    shows, right_shows = mistake_symptoms(name, r, 2)
    assert shows, r
    assert not right_shows, r
    if name in ("units-out-of-order", "no-zero-grad", "state-dict-at-stage-3"):  # zero.py's guard stops it
        for res in world2:
            assert res["mistakes_lab"]["results"][name]["guard"].startswith("RuntimeError: zero: ")
    if name == "no-divide-adamw":  # the contrast: almost invisible under AdamW, not under SGD
        assert r["wrong"] < world2[0]["mistakes_lab"]["results"]["no-divide-sgd"]["wrong"] / 1e4


def test_the_mistakes_lab_command_line(world2, shared, refused, one_rank):
    printed = world2[0]["mistakes_lab"]["printed"]  # rank 0's; the other rank prints nothing
    assert world2[1]["mistakes_lab"]["printed"] == ""
    lines = printed.splitlines()
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    assert any(line.startswith("no-divide-sgd ") for line in lines) and lines[-1].startswith("wall time: ")
    assert "  with the guard: RuntimeError: zero: ranks communicated different units" in printed
    rows = json.load(open(os.path.join(shared, "mistakes.json")))
    assert [row["name"] for row in rows] == ["no-divide-sgd", "units-out-of-order"]
    assert all({"name", "stages", "measure", "wrong", "right", "why", "where"} <= set(row) for row in rows)
    assert rows[0]["where"] == "ZeRO1._reduce_grads" and rows[0]["wrong"] > 1e-3 > rows[0]["right"]
    listed = main_printed(mistakes.main, ["--list"]).splitlines()
    assert [line.split()[0] for line in listed] == list(mistakes.MISTAKES) and len(listed) >= 12
    assert all(len(line) <= 100 for line in listed)
    for argv, message in [(["nope"], "no mistake named 'nope'"), (["--nope"], "--nope"),
                          (["--json", os.path.join(shared, "none", "x.json")], "no directory"),
                          (["no-divide-sgd"], "2 or more ranks")]:  # one_rank: a group of one
        error, out = main_refused(mistakes.main, argv)
        assert error and message in error and "\n" not in error and out == "", (argv, error)
    code, out, err, message = refused["mistakes.py"]  # end to end: one line, exit code 2
    assert code == 2 and err == f"mistakes.py: error: {message}: `python mistakes.py --list` names them\n", err


# ----------------------------------------------------------------------------------------------
# The command line, end to end

MODEL = ["--n-layer", "2", "--d-model", "16", "--seq-len", "16"]  # the demo GPT, tiny
# 3 steps, at a learning rate where the loss falls visibly in 3 steps
SMALL = ["--steps", "3", *MODEL, "--batch-size", "4", "--lr", "5e-3"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def run_py(*args, torchrun=0, script=os.path.join(HERE, "zero.py"), torchrun_args=()):
    launcher = [sys.executable, *(["-m", "torch.distributed.run", f"--nproc_per_node={torchrun}", *torchrun_args]
                                  if torchrun else [])]
    return subprocess.run(launcher + [script, *args], capture_output=True, text=True, timeout=300, env=ENV, cwd=HERE)


def launcher_script(path, body):
    """A launcher script at `path` that imports zero.py from here and runs `body`."""
    with open(path, "w") as f:
        f.write(f"import os, signal, sys\nsys.path.insert(0, {HERE!r})\nimport zero\n\n{body}")
    return str(path)


# Several command lines in one torchrun launch (a launch costs seconds of imports per rank; each
# line below is a zero.main call with the arguments the command line would get, in processes that
# torchrun started, as `torchrun zero.py ARGS` runs it). Rank 0 prints a line "=== name" first.
CLI_RUNS = [(f"stage {stage}", ["--stage", str(stage), *SMALL]) for stage in range(4)] + [
    ("max-memory", ["--stage", "3", *SMALL, "--max-memory", "300MB"])]  # last: the limit stays
CLI_DRIVER = """
def main():  # as a user writes it: zero.run(main) calls it without argv
    for name, argv in {runs!r}:
        if os.environ["RANK"] == "0":
            print("=== " + name, flush=True)
        zero.main(argv)


zero.run(main)
"""


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    path = launcher_script(tmp_path_factory.mktemp("cli") / "runs.py", CLI_DRIVER.format(runs=CLI_RUNS))
    out = run_py(script=path, torchrun=4)
    parts = re.split(r"^=== (.+)\n", out.stdout, flags=re.M)[1:]
    return out, dict(zip(parts[::2], parts[1::2]))


def losses(stdout):
    return [float(x) for x in re.findall(r"^step +\d+ \| loss (\d+\.\d+)", stdout, re.M)]


@pytest.mark.parametrize("stage", range(4))
def test_cli_trains_under_torchrun(cli_runs, stage):
    assert cli_runs[0].returncode == 0, cli_runs[0].stderr[-3000:]
    out = cli_runs[1][f"stage {stage}"]
    assert f"stage {stage} (" in out and "world size       | 4 (gloo" in out
    assert len(losses(out)) == 3
    assert "model state per rank" in out and "communication per rank per step" in out
    assert out.count("step    1 |") == 1  # one line per step: rank 0 alone prints


def test_cli_every_stage_gives_the_same_losses(cli_runs):
    assert cli_runs[0].returncode == 0, cli_runs[0].stderr[-3000:]
    runs = [losses(cli_runs[1][f"stage {stage}"]) for stage in range(4)]
    assert all(len(r) == 3 for r in runs)
    for run in runs[1:]:
        assert max(abs(a - b) for a, b in zip(run, runs[0])) <= 2e-6
    assert runs[0][-1] < runs[0][0]


BAD = [["--stage", "7"], ["--steps", "0"], ["--d-model", "-3"], ["--d-model", "30", "--n-head", "4"],
       ["--clip", "-1"], ["--estimate", "--params", "abc", "--world-size", "4"],
       ["--estimate", "--params", "-1", "--world-size", "64"], ["--estimate", "--params", "nan", "--world-size", "2"],
       ["--estimate", "--params", "1e9"], ["--no-such-flag"],
       ["--max-memory", "100kB"]]  # below 1MB: a thread the runtime starts would abort the process
if not torch.cuda.is_available():
    BAD.append(["--backend", "nccl"])


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Bad command lines run end to end, each a process of its own, all at once: {name: (exit
    code, stdout, stderr, what stderr must name)}. The rest are checked in-process (zero.main),
    where the check is about the message."""
    missing = str(tmp_path_factory.mktemp("refused") / "none.pt")
    runs = {"argument": (["zero.py", *BAD[0]], "argument --stage"),
            # found once the process group exists and the model is built
            "after setup": (["zero.py", *SMALL, "--init-from", missing], f"--init-from {missing}"),
            "fsdp_demo.py": (["fsdp_demo.py", "--stage", "1", "--bf16"], "--bf16"),
            "mistakes.py": (["mistakes.py", "no-such-mistake"], "no mistake named 'no-such-mistake'")}
    procs = {name: subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=ENV, cwd=HERE) for name, (args, _) in runs.items()}
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        done[name] = (proc.returncode, out, err, runs[name][1])
    return done


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
        with pytest.raises(zero.UsageError) as e, contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
            zero.main(args)
        assert str(e.value) and "\n" not in str(e.value), args
        assert printed.getvalue() == errors.getvalue() == "", args


# ----------------------------------------------------------------------------------------------
# fsdp_demo.py: PyTorch's own implementations train exactly like zero.py

def fsdp_scenarios(rank, world):
    import fsdp_demo
    args = zero.training_parser("").parse_args(SMALL + ["--grad-accum", "2"])
    out = {}
    for stage in range(4):
        args.stage = stage
        with contextlib.redirect_stdout(io.StringIO()):  # compare() prints both reports
            theirs, ours = fsdp_demo.compare(args, keep_params=True)
        out[stage] = {"theirs": theirs, "ours": ours}
    if world == 4:
        # the command lines of fsdp_demo.py, as zero.run(fsdp_demo.main) runs them
        out["--compare"] = main_printed(fsdp_demo.main, ["--stage", "3", "--compare", *SMALL])
        out["--bf16"] = main_printed(fsdp_demo.main, ["--stage", "3", "--bf16", *SMALL])
    if world == 2:
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
        out["--init-from"] = main_printed(fsdp_demo.main, ["--stage", "2", "--compare", *SMALL, "--init-from", path])
    return out


def fsdp_bad_input(rank, world):
    import fsdp_demo
    return [(args, *main_refused(fsdp_demo.main, args)) for args in (["--stage", "5"], ["--stage", "1", "--bf16"])]


def small_bench(rank, world):
    import fsdp_demo
    saved, fsdp_demo.BENCH_MODELS = fsdp_demo.BENCH_MODELS, [
        ("tiny", dict(d_model=16, n_layer=2, n_head=2, seq_len=16, batch_size=2))]
    try:
        return main_printed(fsdp_demo.main, ["--bench", "--repeats", "1", "--steps", "2"])
    finally:
        fsdp_demo.BENCH_MODELS = saved


def test_bench_prints_every_stage_against_pytorch(world2):
    # --bench on a tiny model: no timing is asserted, only that every stage is run against its
    # counterpart, that the ratio is the one of the two times printed (within their rounding,
    # whatever the times are), and that the bytes in the table are the measured ones the formula
    # predicts.
    import fsdp_demo
    out = world2[0]["small_bench"]
    rows = [line.split() for line in out.splitlines() if line.startswith("tiny ")]
    assert [int(r[1]) for r in rows] == [0, 1, 2, 3]
    for row, name in zip(rows, fsdp_demo.PYTORCH_NAMES):
        assert " ".join(row[2:-8]) == name
        ms_torch, ms_zero, ratio = map(float, row[-8:-5])
        assert all(math.isfinite(x) and x >= 0 for x in (ms_torch, ms_zero, ratio))
        # each column is rounded (ms to 0.05, the ratio to 5e-4): ratio x ms_torch is ms_zero to within
        assert abs(ratio * ms_torch - ms_zero) <= 0.05 * (1 + ratio) + 5e-4 * ms_torch + 1e-4
    state_torch, state_zero, sent_torch, sent_zero, formula = ([int(r[k].replace(",", "")) for r in rows] for k in range(-5, 0))
    for stage in range(3):  # the formula, plus the squared norm for clipping (stages 1, 2: 2 x 1/2 x 4
        # bytes) and the per-step check that ranks agree (2 x 1/2 x 16 bytes)
        assert sent_zero[stage] - formula[stage] == (0 if stage == 0 else 4) + 16
    check = next(line for line in out.splitlines() if line.startswith("per-step check"))
    assert re.search(r"all_reduce\): \d+\.\d+ ms, \d+\.\d% of the tiny model's stage-0 step", check)
    assert sent_zero[3] < formula[3]  # stage 3 gathers its root unit once per step, not twice
    assert state_zero[3] <= state_torch[3]
    assert "zero.reduce_scatter" in out.splitlines()[-1]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"N{w}")
def fsdp_ranks(request):
    runs = request.getfixturevalue("world2" if request.param == 2 else "world4_again")
    return request.param, [res["fsdp_scenarios"] for res in runs]


@pytest.mark.parametrize("stage", range(4))
def test_pytorch_counterpart_trains_like_zero(fsdp_ranks, stage):
    world, results = fsdp_ranks
    for res in results:
        theirs, ours = res[stage]["theirs"], res[stage]["ours"]
        assert len(ours["losses"]) == 3 and ours["losses"][-1] < ours["losses"][0]
        assert max(abs(a - b) for a, b in zip(theirs["losses"], ours["losses"])) <= 1e-5
        assert list(theirs["full"]) == list(ours["full"])
        for name, t in ours["full"].items():
            assert (theirs["full"][name] - t).abs().max().item() <= 1e-5, name


@pytest.mark.parametrize("stage", range(4))
def test_dispatcher_count_agrees_with_zero_own_count(fsdp_ranks, stage):
    # fsdp_demo counts PyTorch's bytes at the dispatcher; on zero.py's run it must see exactly
    # what zero.py counted itself, or the side-by-side numbers are not measured the same way.
    world, results = fsdp_ranks
    ours = results[0][stage]["ours"]
    # On gloo with CPU tensors zero.py's reduce_scatter and all_gather run as all_to_all and
    # broadcasts (zero.DIRECT): the dispatcher sees those calls, with the same bytes.
    assert zero.DIRECT
    calls = {zero.DIRECT_CALLS.get(k, k): v for k, v in ours["comm"].items()}
    assert ours["comm_seen"] == calls and sum(ours["comm"].values()) > 0


def test_pytorch_memory_and_communication(fsdp_ranks):
    world, results = fsdp_ranks
    res = results[0]
    psi = res[0]["ours"]["psi"]
    for stage in range(4):
        theirs = res[stage]["theirs"]
        assert theirs["psi"] == psi
        # FSDP2 (stages 2, 3) shards parameters between steps; DDP and ZeroRedundancyOptimizer don't
        assert theirs["mem"]["params"] == (4 * psi if stage < 2 else pytest.approx(4 * psi / world, rel=0.02))
        assert theirs["mem"]["optimizer"] < 8 * psi * (0.6 if stage else 1.01)  # sharded from stage 1
    # DDP all-reduces 2Ψ(N-1)/N x 4 bytes per step (no_sync() for the first micro-batch); FSDP2
    # with reshard_after_forward=True gathers twice and reduce-scatters once per micro-batch:
    # 3Ψ(N-1)/N x 4 bytes each
    ring = 4 * psi * (world - 1) / world
    assert res[0]["theirs"]["comm"]["all_reduce"] == pytest.approx(2 * ring, rel=0.01)
    assert sum(res[3]["theirs"]["comm"].values()) == pytest.approx(2 * 3 * ring, rel=0.02)


def test_fsdp_demo_compare_end_to_end(world4_again, world2, shared):
    # fsdp_demo.py --compare --stage 3 at N = 4: PyTorch's FSDP2, then zero.py's stage 3, side by side
    out = world4_again[0]["fsdp_scenarios"]["--compare"]
    assert "zero.py vs PyTorch, stage 3" in out and "largest parameter difference" in out
    diff = float(re.search(r"largest loss difference (\S+)", out).group(1))
    assert diff <= 1e-5
    # and from a pretrained file (N = 2): the same losses on both sides, not those of fresh weights
    loaded = world2[0]["fsdp_scenarios"]["--init-from"]
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
        want, other = (sum(F.cross_entropy(m(x).flatten(0, 1), y.flatten()).item() for x, y in batches) / 2
                       for m in (pretrained, fresh))
    assert first[0] == first[1] and abs(first[0] - want) < 1e-4 < 1e-2 < abs(want - other), (first, want, other)


def test_fsdp_demo_bf16_and_bad_input(world2, world4_again, refused):
    out = world4_again[0]["fsdp_scenarios"]["--bf16"]
    assert "bfloat16 compute" in out and len(losses(out)) == 3
    # end to end, once: fsdp_demo.py's own command line, one line on stderr and exit code 2
    code, out, err, message = refused["fsdp_demo.py"]
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"fsdp_demo.py: error: {message}") and "Traceback" not in err + out
    for res in world2:  # and each bad input, as fsdp_demo.main raises it on every rank
        answers = res["fsdp_bad_input"]
        assert [args for args, _, _ in answers] == [["--stage", "5"], ["--stage", "1", "--bf16"]]
        for args, message, printed in answers:
            assert message and "\n" not in message and printed == "", (args, message)
        assert "--bf16" in answers[1][1]


# ----------------------------------------------------------------------------------------------
# Moving to FSDP and back: a zero.py checkpoint continues under FSDP2, an FSDP2 one (DCP) under
# zero.py, at another N and stage. The N = 4 ranks write one of each after step 1; the N = 2 ranks
# continue them and write theirs, which the N = 4 ranks continue in a second run (world4_again).

MOVE = [*MODEL, "--lr", "5e-3", "--seed", "3"]  # the global batch: 8 rows at any N


def move_args(world, stage, steps, **kwargs):
    args = zero.training_parser("").parse_args([*MOVE, "--stage", str(stage), "--steps", str(steps),
                                                "--batch-size", str(8 // world)])
    return argparse.Namespace(**{**vars(args), "ckpt_every": None, **kwargs})


def moving_write(rank, world):
    # N = 4: zero.py at stage 1 and FSDP2 at stage 3 (DCP) each write a checkpoint after step 1;
    # N = 2: zero.py at stage 0 and FSDP2 at stage 2
    import fsdp_demo
    tmp = os.environ["ZERO_TEST_TMP"]
    ours, theirs = (1, 3) if world == 4 else (0, 2)
    with contextlib.redirect_stdout(io.StringIO()):
        zero.train(move_args(world, ours, 1, ckpt_dir=os.path.join(tmp, f"zero{world}")), quiet=True)
        zero.train(move_args(world, theirs, 1, ckpt_dir=os.path.join(tmp, f"fsdp{world}")),
                   fsdp_demo.pytorch(move_args(world, theirs, 1), world), quiet=True)
        if world == 4:  # HSDP (a 2-D mesh: 2 groups of 2) continues zero.py's stage-1 run, as does
            # zero.py's stage 3 in groups of 2. (Here, in the run of the `hybrid` scenario: a 2-D
            # mesh made again after a new process group, in world4_again, found a group of the
            # old one by name, in torch 2.13.)
            path = checkpoints.latest_checkpoint(os.path.join(tmp, "zero4"))
            theirs, ours = fsdp_demo.compare(move_args(world, 3, 3, resume_from=path, shard_size=2))
            return {"first": theirs["first"], "theirs": theirs["losses"], "ours": ours["losses"]}


def moving(rank, world):
    """Each direction continued for 2 steps on both sides (fsdp_demo.compare: FSDP2, then zero.py
    at the same stage), and the state each side holds right after loading."""
    import fsdp_demo
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
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
    optimizer = fsdp_demo.parallelize(model, args, DEVICE)[1]
    fsdp_demo.Torch(model, optimizer, world).load_checkpoint(checkpoints.latest_checkpoint(os.path.join(tmp, f"zero{other}")))
    full = StateDictOptions(full_state_dict=True)
    state = get_optimizer_state_dict(model, optimizer, options=full)["state"]
    out["fsdp_loaded"] = {**{("master", n): t for n, t in get_model_state_dict(model, options=full).items()},
                          **{(k, n): v for n, st in state.items() for k, v in st.items()}}
    # zero.py right after loading FSDP2's: saved again at once, for the test to read
    with torch.device("meta"):
        model = zero.GPT(args.seq_len, args.d_model, args.n_layer, args.n_head)
    opt = zero.zero_build(move_args(world, 1, 1))(model, DEVICE)[1]
    found = checkpoints.latest_checkpoint(os.path.join(tmp, f"fsdp{other}"))
    checkpoints.load_checkpoint(opt, found)
    checkpoints.save_checkpoint(opt, os.path.join(tmp, f"resaved{world}"), 1)
    return out


@pytest.fixture(scope="module")
def moved(world4, world2, world4_again):
    return {2: world2[0]["moving"], 4: world4_again[0]["moving"], "hsdp": world4[0]["moving_write"]}


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
    assert hsdp["first"] == 2 and max(abs(a - b) for a, b in zip(hsdp["theirs"], hsdp["ours"])) <= 1e-5


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gloo's renamed collectives (in_process, below)
def test_moving_refuses_bad_input_in_one_line(world4, shared, one_rank, tmp_path):
    # --resume-from, on either side: one line (zero.run: exit code 2), nothing trained, nothing
    # written in --ckpt-dir, the source as it was
    import fsdp_demo
    dcp_dir, zero_dir = (checkpoints.latest_checkpoint(os.path.join(shared, name)) for name in ("fsdp4", "zero4"))
    for bad in ("torn", "truncated"):
        shutil.copytree(dcp_dir, tmp_path / bad)
    os.remove(tmp_path / "torn" / checkpoints.DCP_MARKER)
    os.truncate(tmp_path / "truncated" / "__1_0.distcp", 100)
    (tmp_path / "neither").mkdir()
    (tmp_path / "neither" / "notes.txt").write_text("not a checkpoint")
    with contextlib.redirect_stdout(io.StringIO()):
        zero.main(["--consolidate", zero_dir, "--out", str(tmp_path / "weights.dcp")])  # weights only
    before = sorted(os.listdir(dcp_dir))
    cases = [(zero.main, ["--resume-from", str(tmp_path / "neither")], "not a checkpoint"),
             (zero.main, ["--d-model", "32", "--resume-from", dcp_dir], "another model: tensor 'wte.weight' is [256, 16] there, [256, 32] here"),
             (fsdp_demo.main, ["--stage", "2", "--n-layer", "1", "--resume-from", zero_dir], "another model: tensor 'blocks.1."),
             (zero.main, ["--resume-from", str(tmp_path / "weights.dcp")], "holds no optimizer state"),
             (zero.main, ["--resume-from", str(tmp_path / "torn")], "complete.json: missing: the DCP checkpoint is torn"),
             (zero.main, ["--resume-from", str(tmp_path / "truncated")], "__1_0.distcp: 100 bytes")]
    for i, (main, args, message) in enumerate(cases):
        ckpt = tmp_path / f"ckpt{i}"
        error, printed = main_refused(main, [*MOVE, "--steps", "3", "--ckpt-dir", str(ckpt), *args])
        assert error and message in error and "\n" not in error, (args, error)
        assert "step    2 |" not in printed and os.listdir(ckpt) == []
    assert sorted(os.listdir(dcp_dir)) == before


def dcp_full(path):
    """{(key, parameter name): full tensor} of a DCP checkpoint, read by torch's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, os.path.join(tmp, "all.pt"))
        state = torch.load(os.path.join(tmp, "all.pt"), weights_only=False)
    full = {(k, n): v for n, st in state["optimizer"]["state"].items() for k, v in st.items()}
    return {**full, **{("master", n): state["model"][n] for (_, n) in full}}


@pytest.mark.parametrize("world", [2, 4])
def test_moving_keeps_every_weight_and_adam_value(moved, shared, world):
    # Element by element, right after the conversion: FSDP2's weights, m, v and step count are
    # those of zero.py's checkpoint; zero.py's, saved again at once, those of FSDP2's DCP.
    other = 6 - world
    want = full_checkpoint(checkpoints.latest_checkpoint(os.path.join(shared, f"zero{other}")))
    got = moved[world]["fsdp_loaded"]
    assert {k for k in want if k != "scalars"} | {("step", n) for n in want["scalars"]} == set(got) - {("master", "head.weight")}
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
    assert {n: float(s["step"]) for n, s in got["scalars"].items()} == {n: float(want["step", n]) for (k, n) in want if k == "step"}


# ----------------------------------------------------------------------------------------------
# Checkpoints: written by N ranks at one stage, read by M ranks at another

ROWS = 12  # global rows per micro-batch in the resharding runs, split evenly over 2 or 4 ranks


def train_rows(model, opt, rank, world, steps, start):
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, ROWS // B, steps, start=start)


def reshard_write(rank, world):
    # N = 4, stage 3, the optimizer handed pieces of 7 elements: 2 steps, checkpoint, 2 more steps.
    zero.PIECE = {"cpu": 7, "cuda": 7}
    model, opt = wrapped(rank, 3, "adamw", seed=100)
    train_rows(model, opt, rank, world, 2, 0)
    checkpoints.save_checkpoint(opt, os.path.join(os.environ["ZERO_TEST_TMP"], "a"), 2, extra={"note": "from N=4"})
    train_rows(model, opt, rank, world, 2, 2)
    return opt.full_state_dict()


def _load_fresh(rank, stage, path, **kwargs):
    model, opt = wrapped(rank, stage, "adamw", seed=500 + rank, **kwargs)  # other weights on each rank
    manifest = checkpoints.load_checkpoint(opt, path)
    return model, opt, manifest


def reshard_read(rank, world):
    # Load the N = 4 stage-3 checkpoint at this world size into every stage (pieces of 5), write it
    # again at once, then train on. Then the checkpoints that must be refused.
    tmp, out = os.environ["ZERO_TEST_TMP"], {}
    zero.PIECE = {"cpu": 5, "cuda": 5}
    source = os.path.join(tmp, "a" if world == 2 else "b1", "step_00000002")
    for stage in range(4):
        model, opt, manifest = _load_fresh(rank, stage, source)
        checkpoints.save_checkpoint(opt, os.path.join(tmp, f"{'b' if world == 2 else 'c'}{stage}"), 2)
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
            out.setdefault("unchanged", []).append(all(torch.equal(before[n], after[n]) for n in before))
        others = {"another model": lambda: zero.wrap(nn.Sequential(nn.Linear(4, 4)), 2, CASES["adamw"]["optimizer"]),
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
def resharded(shared, world4, world2, world4_again):
    two, two_rank1 = (res["reshard_read"] for res in world2)
    states = {name: full_checkpoint(os.path.join(shared, name, "step_00000002"))
              for name in ["a", "bf16"] + [f"{x}{s}" for x in "bc" for s in range(4)]}
    return {"straight": world4[0]["reshard_write"], "two": two, "four": world4_again[0]["reshard_read"],
            "states": states, "two_rank1": two_rank1}


def full_checkpoint(path):
    """{(key, parameter name): full tensor} of every per-element value in a checkpoint (master
    weights and optimizer state), assembled here from the parts, independently of zero.py's
    reader, plus the optimizer's scalars of each parameter ("scalars": {name: {key: value}})."""
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    parts = [torch.load(os.path.join(path, f), weights_only=True) for f in sorted(manifest["files"])]
    full = {}
    for i, params in enumerate(manifest["units"]):
        for key in ["master"] + list(parts[0]["units"][i]["state"]):
            get = (lambda unit: unit["master"]) if key == "master" else (lambda unit, key=key: unit["state"][key])
            flat = torch.cat([get(part["units"][i]) for part in parts])  # [N*S]
            o = 0
            for name, shape in params:
                n = math.prod(shape)
                full[key, name], o = flat[o:o + n].view(shape), o + n
    full["scalars"] = {n: s for part in parts for n, s in part["param_scalars"].items()}
    return full


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
                floats = lambda scalars: {n: {k: float(v) for k, v in s.items()} for n, s in scalars.items()}
                assert floats(got[key]) == floats(want[key]) == {n: {"step": 2.0} for n in want[key]}
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
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want if k != "scalars")
    before, after = resharded["two"]["sgd"]
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_bad_checkpoints_are_refused_before_anything_changes(resharded):
    refused = resharded["two"]["refused"]
    assert "corrupt" in refused["corrupt"] and "rank_00002.pt" in refused["corrupt"]
    assert "truncated" in refused["truncated"] and "rank_00003.pt" in refused["truncated"]
    assert resharded["two_rank1"]["refused"] == refused  # the same message on both ranks, whichever found it
    assert "missing" in refused["missing"] and "rank_00001.pt" in refused["missing"]
    assert "no manifest.json" in refused["incomplete"]
    assert "another model" in refused["another model"] and "'0.weight'" in refused["another model"]
    assert "AdamW" in refused["another optimizer"] and "SGD" in refused["another optimizer"]
    assert all(msg.count("\n") == 0 for msg in refused.values())
    assert resharded["two"]["unchanged"] == [True] * 4


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



def test_ranks_that_disagree_fail_fast(world2):
    for errors in (res["disagree"] for res in world2):
        assert all(e and e.startswith("zero: ranks disagree: rank 0 has ") for e in errors), errors
        assert "rank 0 has stage 3; rank 1 has stage 2" in errors[0] and "layout hash" in errors[1]


CKPT = ["--stage", "2", *MODEL, "--batch-size", "2"]
KILLED_STEPS = 12  # a checkpoint every 4 steps: rank 1 dies after the first, at step 4


def main_refused(main, argv):
    """(the message of the UsageError main(argv) raised, or None; what it printed)."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            main(argv)
    except zero.UsageError as e:
        return str(e), printed.getvalue()
    return None, printed.getvalue()


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
    if step == 4 and os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)


checkpoints.save_checkpoint = save_then_die
zero.run(zero.main)
"""


def test_a_killed_rank_restarts_and_resumes_exactly(world2, shared, tmp_path):
    # torchrun --max-restarts=1: rank 1 is SIGKILLed once the checkpoint of step 4 is complete;
    # torchrun restarts the group, which resumes from that checkpoint. The final weights and Adam
    # state equal an uninterrupted run's, bit for bit. The rank kills itself (KILLER, a launcher
    # of zero.main), always right after that checkpoint: killed from outside when the checkpoint
    # shows up, how many more steps it had trained by then would be a matter of timing.
    ckpt = str(tmp_path / "killed")
    # (Before zero.setup prefixed the store's keys by the restart attempt, the restarted ranks
    # here read the dead ranks' addresses and waited for ever: see zero._attempt_store.)
    out = run_py(*CKPT, "--steps", str(KILLED_STEPS), "--ckpt-every", "4", "--ckpt-dir", ckpt,
                 script=launcher_script(tmp_path / "killed.py", KILLER), torchrun=2, torchrun_args=["--max-restarts=1"])
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = re.findall(r"^resumed from .*step_(\d+): step (\d+)", out.stdout, re.M)
    assert resumed == [("00000004", "4")], out.stdout[-2000:]
    # steps 1-4 before the kill, 5-12 after the restart: none trained twice, none skipped
    assert re.findall(r"^step +(\d+) \|", out.stdout, re.M) == [str(s) for s in range(1, KILLED_STEPS + 1)]
    assert losses(out.stdout)[-1] == losses(world2[0]["straight"])[-1]
    a, b = (full_checkpoint(checkpoints.latest_checkpoint(path)) for path in (ckpt, os.path.join(shared, "straight")))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a if k != "scalars")
    assert a["scalars"] == b["scalars"] and {k[0] for k in a if k != "scalars"} == {"master", "exp_avg", "exp_avg_sq"}
    assert sorted(os.listdir(ckpt)) == ["step_00000008", "step_00000012"]  # the newest two are kept


@pytest.fixture(scope="module")
def one_process(world2, shared, tmp_path_factory):
    # The N = 2 stage-2 checkpoint of the straight run -> one plain state_dict (--consolidate, as
    # zero.main runs it: no process group), in each format its --out names, then `python zero.py
    # --init-from` the .pt: one process, no torchrun, a stage-3 run at N = 1.
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
    model_file = os.path.join(folder, "model.pt")
    state = torch.load(model_file, weights_only=True)
    a = zero.training_parser("").parse_args(SMALL)  # MODEL, and the batch of the --init-from run
    model = zero.GPT(a.seq_len, a.d_model, a.n_layer, a.n_head)
    model.load_state_dict(state)  # strict: every key of the model, nothing else
    assert torch.equal(state["head.weight"], state["wte.weight"])
    assert os.path.getsize(model_file) < 4 * 1.2 * sum(t.numel() for t in state.values())  # no parts
    torch.manual_seed(a.seed)  # the weights a run starts from without --init-from
    untrained = zero.GPT(a.seq_len, a.d_model, a.n_layer, a.n_head)
    data = zero.demo_data()
    x, y = zero.get_batch(data, 1, 0, 0, 1, a.batch_size, a.seq_len, a.seed)
    with torch.no_grad():
        want, fresh = (F.cross_entropy(m(x).flatten(0, 1), y.flatten()).item() for m in (model, untrained))
    assert out.returncode == 0, out.stderr[-3000:]
    assert abs(losses(out.stdout)[0] - want) < 1e-5 and want < fresh - 0.1  # trained weights, not a fresh model
    # the same tensors, under the same keys, as safetensors' own loader and torch's DCP converter read them
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    converted = os.path.join(str(folder) + "-from-dcp.pt")
    dcp_to_torch_save(os.path.join(folder, "model.dcp"), converted)
    for other in (load_file(os.path.join(folder, "model.safetensors")), torch.load(converted, weights_only=True)):
        assert sorted(other) == sorted(state) and all(torch.equal(other[k], state[k]) for k in state)


def checkpoint_error_cases(tmp):
    ckpt, plain = os.path.join(tmp, "straight"), os.path.join(tmp, "plain.pt")
    return [(["--d-model", "64", "--ckpt-dir", ckpt], "checkpoint is for another model"),
            (["--init-from", plain], "--init-from"), (["--init-from", os.path.join(tmp, "none.pt")], "No such file"),
            (["--consolidate", tmp], "needs --out"),
            (["--consolidate", os.path.join(tmp, "empty"), "--out", plain], "no complete checkpoint"),
            (["--consolidate", plain, "--out", plain + ".out.pt"], "not a directory"),
            (["--consolidate", os.path.join(tmp, "none"), "--out", plain + ".out.pt"], "no such directory"),
            (["--consolidate", ckpt, "--out", plain + ".out"], "name a .pt or .safetensors file"),
            (["--ckpt-every", "2"], "needs --ckpt-dir"), (["--bucket-mb", "-1"], "--bucket-mb")]


def cli_errors(rank, world):
    # after `straight`, whose checkpoint is the one of another model for the first case
    tmp = os.environ["ZERO_TEST_TMP"]
    if rank == 0:
        torch.save({"x": torch.zeros(2)}, os.path.join(tmp, "plain.pt"))
        os.makedirs(os.path.join(tmp, "empty"), exist_ok=True)
    dist.barrier()
    return [main_refused(zero.main, [*CKPT, "--steps", "2", *args]) for args, _ in checkpoint_error_cases(tmp)]


def test_checkpoint_errors_are_one_line(world2, shared):
    # zero.main on both ranks of N = 2: every rank refuses, with the same one-line message (which
    # zero.run prints as one line, exit code 2: test_bad_input_is_one_line_and_exit_2), and trains
    # nothing.
    cases = checkpoint_error_cases(shared)
    for res in world2:
        assert len(res["cli_errors"]) == len(cases)
        for (args, message), (error, printed) in zip(cases, res["cli_errors"]):
            assert error and message in error and "\n" not in error, (args, error)
            assert "step    1 |" not in printed
    assert [e for e, _ in world2[0]["cli_errors"]] == [e for e, _ in world2[1]["cli_errors"]]
    assert torch.load(os.path.join(shared, "plain.pt"), weights_only=True)["x"].shape == (2,)  # a failed run wrote nothing


def test_a_dead_rank_ends_the_job(tmp_path):
    # Without torchrun to stop the group: rank 1 is killed mid-training; rank 0 leaves with a
    # one-line error (gloo sees the closed connection at once; a rank that hung instead would be
    # caught by --timeout). What is asserted holds wherever rank 0 is when rank 1 dies.
    env = dict(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "zero.py"), *CKPT, "--steps", "100000",
                               "--timeout", "30"], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for line in procs[0].stdout:
        if line.startswith("step    3 |"):
            break
    procs[1].kill()
    _, err = procs[0].communicate(timeout=90)
    procs[1].communicate()
    assert procs[0].returncode == 1
    assert err.count("\n") == 1 and "rank 0: a collective failed" in err, err[-2000:]


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
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D)) for _ in range(4))
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
    for name, kwargs in [("param_dtype", dict(param_dtype=torch.bfloat16)), ("overlap", dict(overlap=False))]:
        try:
            zero.wrap(Deep(), 1 if name == "param_dtype" else 0, optimizer, **(kwargs if rank == 1 else {}))
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
    return out


@pytest.fixture(scope="module")
def real_runs(world2):
    return [res["real_code"] for res in world2]


def deep_reference(world):
    model = Deep()
    deep_steps(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), slice(None), world)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", CHECKPOINT_MODES, ids=lambda m: f"reentrant={m[0]}-early_stop={m[1]}")
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


@pytest.mark.parametrize("stage", range(4))
def test_ranks_that_reduce_different_units_stop_before_the_step(real_runs, stage):
    for res in real_runs:
        error, unchanged = res["swapped"][stage]
        assert error and "different units" in error and unchanged


def test_default_units_find_the_blocks_at_any_depth():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.mlp = nn.Linear(4, 4), nn.Linear(4, 4)

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
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.LayerNorm(4))  # no repeated blocks: children
    assert zero.default_units(flat) == [flat[0], flat[2]]


# ----------------------------------------------------------------------------------------------
# The timeline of one step (--timeline, --timeline-all): what it records, draws and prints

TINY = ["--d-model", "16", "--n-layer", "2", "--n-head", "2", "--seq-len", "16",
        "--batch-size", "2", "--steps", "3"]


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
def timelines(world2):
    return [res["timeline_runs"] for res in world2]


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
        assert [m[3] for m in rows] == [zero._si(e["params"]) for e in events]
        assert sum(m[1] == "▶" for m in rows) == len(stages)
        assert out.count("  ▶ peak ") == len(stages) and "wrote " in out
    assert "model state per rank" in timelines[0]["bf16"]["stdout"]  # --timeline: the report too


def test_timeline_bad_input_is_one_line_and_exit_2(tmp_path):
    cases = [(["--timeline", str(tmp_path)], "is a directory"),
             (["--timeline", str(tmp_path / "t.svg"), "--steps", "1"], "--steps must be 2"),
             (["--timeline", "a.svg", "--timeline-all", "b.svg"], "choose one"),
             (["--timeline-all", str(tmp_path / "t.svg"), "--ckpt-dir", str(tmp_path)],
              "--ckpt-dir"),
             (["--timeline", "t.svg", "--estimate", "--params", "1e9", "--world-size", "8"],
              "--estimate")]
    for args, message in cases:  # refused before any process group or training
        with pytest.raises(zero.UsageError, match=re.escape(message)):
            zero.main(args)
    out = run_py("--timeline", str(tmp_path / "missing" / "t.svg"))  # and from the command line
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("zero.py: error: cannot write ")
    assert "no such writable" in out.stderr
    assert "step " not in out.stdout and os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# Hybrid sharding: shard within groups of G = 2 ranks, replicate across the N/G = 2 groups

def hybrid(rank, world):
    out, rows, G = {}, slice(rank * B, (rank + 1) * B), 2
    for stage in range(1, 4):  # stage 0 shards nothing: shard_size is refused there (below)
        for case in ("adamw", "sgd-accum"):
            model, opt = wrapped(rank, stage, case, seed=100, shard_size=G)
            comm, mem = [dict(opt.comm)], []

            def after_step():
                mem.append(opt.memory_breakdown())
                comm.append(dict(opt.comm))
            run_steps(model, opt, opt.clip_grad_norm_, CASES[case], rows, world, STEPS, after_step=after_step)
            out[(stage, case)] = {"full": opt.full_state_dict(), "layout": layout(opt), "mem": mem[-1],
                                  "comm": [{k: b.get(k, 0) - a.get(k, 0) for k in b}
                                           for a, b in zip(comm, comm[1:])]}
            # every backward reduces (no no_sync; stages 2 and 3 always do): at stage 1 the landed
            # sum stays in the buffer that the next backward reduces again, across replicas too
            if stage == 1 and case == "sgd-accum":
                model, opt = wrapped(rank, stage, case, seed=100, shard_size=G)
                run_steps(model, opt, opt.clip_grad_norm_, CASES[case], rows, world, STEPS, no_sync=False)
                out[(stage, case, "every-backward")] = opt.full_state_dict()
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
    out["bad"] = []
    for stage, shard_size in [(1, 3), (0, 2)]:
        try:
            wrapped(rank, stage, case, seed=100, shard_size=shard_size)
            out["bad"].append(None)
        except ValueError as e:
            out["bad"].append(str(e))
    # PyTorch's counterpart: FSDP2 on a 2-D mesh (replicate x shard), against zero.py's stage 3
    if DEVICE.type != "cpu":
        return out
    import fsdp_demo
    args = zero.training_parser("").parse_args(SMALL + ["--stage", "3", "--shard-size", str(G)])
    theirs, ours = fsdp_demo.compare(args, keep_params=True)
    out["pytorch"] = {"theirs": theirs, "ours": ours}
    return out


@pytest.fixture(scope="module", params=[("cpu", 4), ("cuda-gloo", 4), ("cuda-nccl", 4)], ids=run_id)
def hybrid_runs(request):
    return run_results(request, request.param, "hybrid")


@pytest.mark.parametrize("case", ["adamw", "sgd-accum"])
@pytest.mark.parametrize("stage", range(1, 4))
def test_hybrid_sharding_matches_the_reference(hybrid_runs, stage, case):
    # with no_sync() around all micro-batches but the last, and with every backward reducing
    want = reference(case, 4)
    for res in hybrid_runs:
        for got in [res[(stage, case)]["full"]] + [res[key] for key in [(stage, case, "every-backward")] if key in res]:
            for name, t in want.items():
                assert (got[name] - t).abs().max().item() <= 1e-5, name


@pytest.mark.parametrize("case", ["adamw", "sgd-accum"])
@pytest.mark.parametrize("stage", range(1, 4))
def test_hybrid_memory_and_communication_by_group(hybrid_runs, stage, case):
    N, G = 4, 2
    R, k = N // G, CASES[case]["accum"]
    for res in hybrid_runs:
        rec = res[(stage, case)]
        lay, S = rec["layout"], sum(rec["layout"]["S"])  # S: a unit's 1/G, padded to a multiple of N
        # memory: what is sharded is 1/G of the model, not 1/N
        full = 4 * G * S
        adam = (2 * full // G if stage >= 1 else 2 * full) + 4 * lay["pieces"]  # m, v and step counters
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


def test_hybrid_checkpoints_load_at_any_shard_size_stage_and_world(hybrid_runs):
    for res in hybrid_runs:
        assert res["files"] == ["manifest.json"] + [f"rank_{r:05d}.pt" for r in range(4)]
        for n, t in res["straight"].items():
            assert torch.equal(t, res["own"][n]), n  # the same G and stage: bit for bit
            for name in ("G4", "G1"):  # every value loaded exactly; trained on at another G and
                assert torch.equal(res["saved"][n], res[name + " loaded"][n]), (name, n)
                assert (t - res[name][n]).abs().max().item() <= 1e-5, (name, n)  # stage: rounding
        assert res["bad"][0] and "shard_size must divide the world size 4" in res["bad"][0]
        assert res["bad"][1] and "shard_size is for stages 1-3" in res["bad"][1]


# ----------------------------------------------------------------------------------------------
# Checkpoints and the command line under abuse: one job per directory, ranks that agree, nothing
# non-finite saved, the manifest read as data, one line and never a traceback. In this process
# (a gloo group of one) where it can be; two ranks once, spawned, and one 2-rank launch.

# TINY: the tiny model's flags (the timeline section above)

in_process = pytest.mark.filterwarnings("ignore::FutureWarning")  # gloo's renamed collectives


@pytest.fixture(scope="module")
def one_rank():
    """A gloo group of one in this process, for zero.main and the checkpoint functions."""
    made = not dist.is_initialized()
    if made:
        zero.setup("gloo", "cpu")
    assert dist.get_world_size() == 1
    yield
    if made:
        dist.destroy_process_group()


def full_disk(obj, f):  # torch.save on a full disk: some bytes, then ENOSPC
    import errno
    f.write(b"\0" * 1000)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


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
    return out


@pytest.fixture(scope="module")
def abused(shared, world2):
    return shared, [res["abused_ranks"] for res in world2]


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


@in_process
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


@in_process
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
               "--skip-nonfinite"])
    assert "5 step(s) of 6 skipped" in capsys.readouterr().out
    five, six = (checkpoints.read_checkpoint(ckpt / f"step_0000000{s}")[1][0] for s in (5, 6))
    assert all(torch.equal(a["master"], b["master"]) for a, b in zip(five["units"], six["units"]))
    assert [s["step"] for s in five["param_scalars"].values()] == [s["step"] for s in six["param_scalars"].values()] \
        == [1] * len(five["param_scalars"])  # one step applied in all


@in_process
def test_resume_applies_the_command_lines_lr(one_rank, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    zero.main([*TINY, "--steps", "2", "--ckpt-dir", str(ckpt)])
    zero.main([*TINY, "--lr", "1e-3", "--ckpt-dir", str(ckpt)])
    out = capsys.readouterr().out
    assert "hyper-parameters loaded, then --lr 0.001 applied (it had 0.003)" in out
    assert checkpoints.read_checkpoint(ckpt / "step_00000003")[1][0]["hyper"][0]["lr"] == 1e-3


@in_process
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
    checkpoints.save_checkpoint(opt, str(root), 2)  # lower than both: kept all the same, once written
    kept = ["step_00000002", "step_00000004", "step_00000008"]
    assert sorted(os.listdir(root)) == sorted(kept + odd)
    assert not leftover.exists() and not torn.exists()
    checkpoints.save_checkpoint(opt, str(root), 12)
    assert sorted(os.listdir(root)) == sorted(["step_00000008", "step_00000012", *odd])


@in_process
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
    assert not torch.equal(seen[0], checkpoints.read_checkpoint(os.path.join(root, "step_00000001"))[1][0]["units"][0]["master"])
    monkeypatch.setattr(checkpoints, "_json_lines", lambda d: full_disk(None, io.BytesIO()))
    run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], slice(None), 1, 1, start=1)
    with pytest.raises(checkpoints.CheckpointError, match="^step 1 not saved: rank 0: .*No space left"):
        checkpoints.save_checkpoint(opt, root, 1)
    checkpoints.load_checkpoint(fresh, checkpoints.latest_checkpoint(root))
    assert all(torch.equal(fresh.full_state_dict()[n], t) for n, t in second.items())
    assert first.keys() == second.keys()


def test_a_dcp_checkpoint_saved_again_takes_its_name_in_one_step(tmp_path, monkeypatch):
    # fsdp_demo.py's DCP saves (checkpoints.save_dcp) commit as save_checkpoint does: a step saved again
    # is written whole beside the old one, which stays whole until the names are swapped.
    path, tmp = str(tmp_path / "step_00000003"), str(tmp_path / "step_00000003.partial")
    for d, what in ((path, "old"), (tmp, "new")):
        os.makedirs(d)
        open(os.path.join(d, "__0_0.distcp"), "w").write(what)
    seen, exchange = [], checkpoints._exchange

    def watched(new, old):  # the moment before the new one takes the name: the old one is whole
        seen.append(open(os.path.join(old, "__0_0.distcp")).read())
        exchange(new, old)
    monkeypatch.setattr(checkpoints, "_exchange", watched)
    checkpoints._commit_dcp(tmp, path, {"step": 3})
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
        "no extra": ({"extra": None}, "'extra' is missing"),
        "no files": ({"files": None}, "'files' is missing"),
        "empty files": ({"files": {}}, "'files' is missing or empty"),
        "false shape": ({"units": false_shape}, "'units' is not a list"),
        "world size": ({"world_size": 0}, "'world_size' is 0"),
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


@in_process
def test_bad_flags_are_one_line(one_rank, tmp_path, monkeypatch, capsys):
    afile, readonly = tmp_path / "afile", tmp_path / "readonly"
    afile.write_text("")
    readonly.mkdir()
    readonly.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: make the check see what a user would
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and str(p) != str(readonly))
    size = len(zero.corpus())
    cases = [(["--bucket-mb", "1e308"], "--bucket-mb"),
             (["--seq-len", str(size - 1)], "longer than the data"),
             (["--timeout", "1e20"], "--timeout"), (["--timeout", "1e-9"], "--timeout"),
             (["--seed", "99999999999999999999"], "--seed"), (["--seed", "-1"], "--seed"),
             (["--clip", "nan"], "--clip"), (["--clip", "inf"], "--clip"),
             (["--params", "1e9"], "is for --estimate"),
             (["--world-size", "8"], "is for --estimate and --largest-model"),
             (["--ckpt-dir", str(afile)], "not a directory"),
             (["--ckpt-dir", str(afile / "x")], "Not a directory"),
             (["--ckpt-dir", str(readonly)], "not writable"),
             (["--lr", "1e39"], "beyond float32's range"),
             (["--init-from", str(afile)], "not a state_dict file that torch.load can read"),
             (["--shard-size", "2"], "must divide the world size 1")]
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


def test_hybrid_pytorch_counterpart_trains_like_zero(world4):
    for res in (r["hybrid"] for r in world4):  # (on CPU: the CUDA runs leave PyTorch's out)
        theirs, ours = res["pytorch"]["theirs"], res["pytorch"]["ours"]
        assert max(abs(a - b) for a, b in zip(theirs["losses"], ours["losses"])) <= 1e-5
        for name, t in ours["full"].items():
            assert (theirs["full"][name] - t).abs().max().item() <= 1e-5, name
        # sharded over G = 2, not N = 4: twice the 1/N memory, and bytes that cross groups
        assert ours["comm"]["all_reduce across groups"] > 0
        assert ours["mem"]["params"] > 0
        seen = {zero.DIRECT_CALLS.get(k, k): v for k, v in ours["comm"].items()}
        assert ours["comm_seen"] == pytest.approx(seen)  # the dispatcher saw what zero.py counted
        across = "all_reduce across groups"  # and in PyTorch's run, HSDP's all-reduce of shards
        assert theirs["comm"][across] == pytest.approx(ours["comm"][across])


@in_process
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
# Models no rank holds whole: built on the meta device, initialized unit by unit inside wrap(),
# loaded shard by shard (load_full_state_dict), under a real memory limit (--max-memory), and the
# memory wall found by trying (--largest-model)

def net_init(m):
    """An init for Net, module by module: reset_parameters() where torch has one, and Net's own
    buffer (which has none)."""
    if isinstance(m, Net):
        nn.init.uniform_(m.scale, 0.5, 1.5)
    elif hasattr(m, "reset_parameters"):
        m.reset_parameters()


def normally_initialized(seed=7):
    """The contract's reference: Net built normally, then model.apply(net_init) (children
    first), after torch.manual_seed(seed)."""
    model = Net(seed=100)
    torch.manual_seed(seed)
    return model.apply(net_init)


def meta_models(rank, world):
    """Meta-built Nets at every stage (N = 2) and with hybrid sharding (N = 4, G = 2): the weights
    wrap() gives them, the model-state bytes at every event of wrap(), and 2 steps of training,
    against the same Net built normally and wrapped."""
    out, rows = {}, slice(rank * B, (rank + 1) * B)
    G = 2 if world == 4 else None
    for stage in range(1 if G else 0, 4):
        seen, event = [], zero.Meter.event

        def record(meter, what, unit=None):  # every event of wrap(): what is really held then
            event(meter, what, unit)
            if not hasattr(meter.zero, "optimizer"):
                seen.append((what, meter.breakdown()))
        zero.Meter.event = record
        try:
            with torch.device("meta"):
                model = Net(seed=100 + rank)  # (ranks' seeds differ: wrap() broadcasts rank 0's)
            torch.manual_seed(7)
            opt = zero.wrap(model, stage, CASES["adamw"]["optimizer"], init=net_init, shard_size=G)
        finally:
            zero.Meter.event = event
        ref = normally_initialized()
        ref_model, ref_opt = ref, zero.wrap(ref, stage, CASES["adamw"]["optimizer"], shard_size=G)
        rec = {"full": opt.full_state_dict(), "seen": seen, "build_peak": dict(opt.build_peak),
               "normal_build_peak": dict(ref_opt.build_peak),
               "replicated": {n: t.clone() for n, t in zero.replicated(model)},
               "flat": [u.flat.numel() for u in opt.units], "S": [u.S for u in opt.units],
               "root": [not u.modules for u in opt.units], "tied": model.head.weight is model.emb.weight,
               "psi": opt.psi}
        for m, o in ((model, opt), (ref_model, ref_opt)):
            run_steps(m, o, o.clip_grad_norm_, CASES["adamw"], rows, world, 2)
        rec["trained"], rec["ref_trained"] = opt.full_state_dict(), ref_opt.full_state_dict()
        out[stage] = rec
    # load_full_state_dict: a state_dict whose elements outside this rank's shards are NaN (each
    # rank its own copy): only the elements a rank holds may be read. And wrong keys or shapes.
    want = {k: v.clone() + 1 for k, v in normally_initialized().state_dict().items()}
    for stage in range(1 if G else 0, 4):
        with torch.device("meta"):
            model = Net(seed=100)
        opt = zero.wrap(model, stage, CASES["adamw"]["optimizer"], init=net_init, shard_size=G,
                        units=list(model.blocks))
        sharded = {k for k, t in model.state_dict(keep_vars=True).items() if t.requires_grad}
        poisoned = {k: v.clone() for k, v in want.items()}
        for k, v in poisoned.items():
            if k in sharded:  # (frozen parameters and buffers: every rank reads them whole)
                v.fill_(float("nan"))
        for u in opt.units:
            for p in u.params:
                a, b = max(u.offset[p], u.my_slice.start), min(u.offset[p] + p.numel(), u.my_slice.stop)
                if a < b:
                    for key in [k for k, t in model.state_dict(keep_vars=True).items() if t is p]:
                        poisoned[key].view(-1)[a - u.offset[p]:b - u.offset[p]] = \
                            want[key].view(-1)[a - u.offset[p]:b - u.offset[p]]
        opt.load_full_state_dict(poisoned)
        loaded = opt.full_state_dict()
        run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, world, 1)
        refused = []
        for bad in ({k: v for k, v in want.items() if k != "norm.weight"},
                    dict(want, extra=torch.zeros(1)),
                    dict(want, **{"blocks.0.0.weight": torch.zeros(2, 2)}),
                    dict(want, scale=torch.zeros(D, dtype=torch.long))):
            try:
                opt.load_full_state_dict(bad)
                refused.append(None)
            except ValueError as e:
                refused.append(str(e))
        out[("load", stage)] = {"loaded": loaded, "trained": opt.full_state_dict(), "refused": refused}
    return out


@pytest.fixture(scope="module")
def meta_runs(world2, world4):
    return {2: [r["meta_models"] for r in world2], 4: [r["meta_models"] for r in world4]}


@pytest.mark.parametrize("world,stage", [(2, s) for s in range(4)] + [(4, s) for s in range(1, 4)],
                         ids=lambda x: str(x))
def test_meta_model_equals_the_normally_built_one(meta_runs, world, stage):
    # Bit for bit: the weights wrap(init=net_init) gives a meta-built Net are those of a Net built
    # normally and given net_init module by module after the same seed (frozen layer and buffer
    # too), the tie kept; and it trains exactly as that model wrapped the usual way.
    ref = normally_initialized()
    for res in meta_runs[world]:
        rec = res[stage]
        assert rec["tied"]
        for n, p in ref.named_parameters():
            assert torch.equal(rec["full"][n], p.detach()), n
        whole = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
        assert sorted(rec["replicated"]) == ["frozen.bias", "frozen.weight", "scale"]
        for n, t in rec["replicated"].items():
            assert torch.equal(t, whole[n]), n
        for n, t in rec["ref_trained"].items():
            assert torch.equal(rec["trained"][n], t), n


@pytest.mark.parametrize("world,stage", [(2, s) for s in range(4)] + [(4, s) for s in range(1, 4)],
                         ids=lambda x: str(x))
def test_building_a_meta_model_holds_one_unit_at_a_time(meta_runs, world, stage):
    # The model-state bytes after every event of wrap(), counted from the storages really
    # allocated (memory_breakdown). Stage 3: this rank's shards, the root unit and one other unit
    # at the most, never every unit whole, as building the model normally does. Stages 0-2: no
    # more than the stage's own state (full parameters; its gradient buffers).
    for res in meta_runs[world]:
        rec = res[stage]
        unit_bytes = [4 * n for n in rec["flat"]]
        shard_bytes = sum(4 * s for s in rec["S"])
        root = sum(b for b, is_root in zip(unit_bytes, rec["root"]) if is_root)
        other = max(b for b, is_root in zip(unit_bytes, rec["root"]) if not is_root)
        held = [m["params"] for _, m in rec["seen"]]
        assert len(rec["seen"]) >= len(unit_bytes) and rec["build_peak"]["params"] == max(held)
        if stage == 3:
            assert max(held) <= shard_bytes + root + other
            assert max(held) < sum(unit_bytes) == rec["normal_build_peak"]["params"]
            assert held[-1] == shard_bytes  # and in the end only the shards
        else:
            assert max(held) == sum(unit_bytes)
            grads = sum(unit_bytes) if stage < 2 else shard_bytes
            assert max(m["grads"] for _, m in rec["seen"]) <= grads


@pytest.mark.parametrize("world,stage", [(2, s) for s in range(4)] + [(4, s) for s in range(1, 4)],
                         ids=lambda x: str(x))
def test_load_full_state_dict_reads_only_each_ranks_own_elements(meta_runs, world, stage):
    # Every element outside a rank's shards was NaN in what that rank was given: the loaded weights
    # are the state_dict's own on every rank, so each rank read its own elements only (stages 0-2
    # all-gather the rest). Wrong keys, shapes and dtypes: one line naming the key.
    want = {k: v + 1 for k, v in normally_initialized().state_dict().items()}
    for res in meta_runs[world]:
        rec = res[("load", stage)]
        for n, t in rec["loaded"].items():
            assert torch.equal(t, want[n]), n
        assert all(torch.isfinite(t).all() for t in rec["trained"].values())
        missing, extra, shape, dtype = rec["refused"]
        assert missing and "no 'norm.weight'" in missing
        assert extra and "'extra' is not in the model" in extra
        assert shape and "'blocks.0.0.weight' is (2, 2)" in shape
        assert dtype and "'scale' is" in dtype and "torch.int64" in dtype
        assert all("\n" not in e and e.startswith("zero: load_full_state_dict") for e in rec["refused"])


@in_process
def test_meta_models_refused_clearly(one_rank):
    # A module with meta tensors and no reset_parameters (Net's own buffer) under the default
    # init; an init that leaves a tensor unset; some parameters on the meta device and some not;
    # init= for a model that is not on the meta device. One line each, naming what.
    optimizer = CASES["adamw"]["optimizer"]
    cases = []
    with torch.device("meta"):
        cases.append((Net(0), {}, "the model (Net) has tensors on the meta device and no reset_parameters()"))
        cases.append((Net(0), {"init": lambda m: None}, "blocks.0.0.weight is not initialized"))
        cases.append((Net(0), {"init": lambda m: isinstance(m, Net) or net_init(m)}, "scale is not initialized"))
        half = Net(0)
    half.norm = nn.LayerNorm(D)
    cases.append((half, {"init": net_init}, "norm.weight is on cpu"))
    cases.append((Net(0), {"init": net_init}, "init is for a model built on the meta device"))
    with torch.device("meta"):  # an init writing into a unit not allocated yet, or already cut
        late, early = Net(0), Net(0)
    cases.append((late, {"init": lambda m: net_init(m) or m is late.emb and late.blocks[1][0].weight.data.zero_()},
                  "init(emb) writes to a tensor of a unit that is not allocated yet (zero_)"))
    cases.append((early, {"init": lambda m: net_init(m) or m is early.norm and early.blocks[0][0].bias.data.zero_()},
                  "init(norm) writes to a tensor of a unit that is built already (zero_)"))
    for model, kwargs, message in cases:
        with pytest.raises(ValueError) as e:
            zero.wrap(model, 3, optimizer, **kwargs)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_transformers_shaped_model_on_the_meta_device(one_rank):
    # The shape the transformers library builds: blocks nested in model.transformer.h, the head
    # tied to the embedding, an init that is a method taking a module (model._init_weights, with
    # GPT-2's scaled init of the residual projections, which a block's init applies over what
    # its children's init drew: so the order of model.apply, children first), a non-persistent
    # buffer. Built on the meta device and wrapped at stage 3 with init=model._init_weights: the
    # contract holds, the scaled init included.
    ref = HFLike()
    torch.manual_seed(11)
    ref.apply(ref._init_weights)
    with torch.device("meta"):
        model = HFLike()
    torch.manual_seed(11)
    opt = zero.wrap(model, 3, CASES["adamw"]["optimizer"], init=model._init_weights)
    assert [m for u in opt.units for m in u.modules] == list(model.transformer.h)  # default units
    full = opt.full_state_dict()
    assert all(torch.equal(full[n], p.detach()) for n, p in ref.named_parameters())
    assert full["transformer.h.0.c_proj.weight"].std() < 0.6 * full["transformer.h.0.c_attn.weight"].std()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.transformer.positions, ref.transformer.positions)
    x = torch.randint(V, (2, T))
    loss = model(x).logits.float().logsumexp(-1).mean()  # a model-output object, as HF returns
    loss.backward()
    opt.step()


class HFLike(nn.Module):
    """A GPT-2-shaped model as transformers lays it out."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.c_attn, self.c_proj = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)

        def forward(self, h):
            q, k, v = self.c_attn(self.ln_1(h)).chunk(3, -1)
            return h + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
            self.h = nn.ModuleList(HFLike.Block() for _ in range(3))
            self.ln_f = nn.LayerNorm(D)
            self.register_buffer("positions", torch.arange(T), persistent=False)

    def __init__(self):
        super().__init__()
        self.transformer = HFLike.Body()
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        if isinstance(module, HFLike.Block):  # over what c_proj's own init drew (apply's order)
            for name, p in module.named_parameters():
                if name == "c_proj.weight":
                    p.data.normal_(0.0, 0.02 / math.sqrt(2 * len(self.transformer.h)))
        if isinstance(module, HFLike.Body):
            module.positions.copy_(torch.arange(T))

    def forward(self, x):
        t = self.transformer
        h = t.wte(x) + t.wpe(t.positions[:x.shape[1]])
        for block in t.h:
            h = block(h)
        return types.SimpleNamespace(logits=self.lm_head(t.ln_f(h)))


def test_max_memory_passes_what_fits_and_refuses_what_cannot(cli_runs, tmp_path):
    # Under --max-memory 300MB per rank the tiny model trains as without it (4 ranks, torchrun).
    # With 4MB, stage 0's 16Ψ = 26 MB cannot even be built: every rank says so in one line
    # (which rank, where, the formula), and the job ends (no rank waits for another).
    assert losses(cli_runs[1]["max-memory"]) == losses(cli_runs[1]["stage 3"])
    used = re.search(r"^--max-memory 300MB per rank: at most (\S+)B used above the runtime, (\S+)B of it not "
                     r"model state; the runtime itself (\S+)B \(largest over the ranks\)$", cli_runs[1]["max-memory"], re.M)
    assert used, cli_runs[1]["max-memory"][-1500:]
    out = run_py("--stage", "0", "--d-model", "256", "--n-layer", "2", "--n-head", "4", "--seq-len", "16",
                 "--steps", "2", "--max-memory", "4MB", "--timeout", "30", torchrun=2)
    assert out.returncode != 0
    # (a rank whose partner ran out first may instead fail in the collective it waits in)
    lines = [line for line in out.stderr.splitlines() if line.startswith("zero.py: error: rank")
             and "a collective failed, another rank is gone" not in line]
    assert lines, out.stderr[-3000:]
    for line in lines:
        assert re.fullmatch(
            r"zero.py: error: rank [01]: out of memory in building the model \(--max-memory 4MB\); stage 0's "
            r"formula: its model state alone is 26\.\d+MB per rank \(Ψ = 1,6\d\d,\d+, N = 2\)", line), line
    assert 'zero.py", line' not in out.stderr  # no traceback from the ranks (torchrun prints its own)


def test_peak_data_sees_a_peak_between_samples():
    # Under --max-memory the data size is sampled at each block's forward and backward (note());
    # a tensor made and freed between two samples is missed there, not by Watch.peak(), which
    # takes the peak from Linux's peak of the address space. In a process of its own: the limit
    # stays with the process.
    script = "\n".join([
        "import torch, memory",
        "torch.set_num_threads(1)",
        "memory.limit_memory(200 * 10**6, torch.device('cpu'))",
        "watch = memory.Watch()",
        "watch.start()",
        "watch.note('before')",
        "x = torch.ones(40 * 10**6 // 4)  # 40 MB, made and freed between two samples",
        "del x",
        "watch.note('after')",
        "print(watch.data - watch.data0, watch.used())"])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=HERE, timeout=120)
    assert out.returncode == 0, out.stderr
    sampled, peak = map(int, out.stdout.split())
    assert sampled < 10**6 and 40 * 10**6 <= peak < 42 * 10**6, (sampled, peak)


def test_a_trial_out_of_memory_ends_only_that_trial():
    # --largest-model's trials: 2 ranks each, spawned; one that cannot fit reports its line and
    # ends, and the caller goes on. (What a trial that fits reports is what the report prints
    # under --max-memory: test_max_memory_passes_what_fits_and_refuses_what_cannot.)
    args = zero.training_parser("").parse_args([*MODEL, "--batch-size", "2", "--max-memory", "1MB"])
    args.world_size = 2
    refused = memory._trial(args, 3, 2)
    assert not refused["ok"] and "out of memory" in refused["error"] and refused["layers"] == 2
    with torch.device("meta"):
        assert refused["psi"] == sum(p.numel() for p in zero.GPT(16, 16, 2, 4).parameters())


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
    assert sorted(results) == [0, 2] and all("out of memory" in res["error"] for res in results.values())
    pipes[1][1].send({"ok": True})  # a normal trial: every rank reports, then it is over
    pipes[0][1].send({"ok": True})
    pipes[2][1].send({"ok": True})
    assert sorted(memory._collect(pipes, procs=[None] * 3, deadline=time.time() + 60)) == [0, 1, 2]


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
        return sum(zero.memory_formula(stage, psi_of(layers), 4).values()) + transient(stage) + rest(stage, layers)
    calls = []

    def trial(args, stage, layers):
        calls.append((stage, layers))
        f = sum(zero.memory_formula(stage, psi_of(layers), 4).values())
        return {"ok": need(stage, layers) <= limit, "psi": psi_of(layers), "layers": layers,
                "state": f + transient(stage), "runtime": 0, "rest": rest(stage, layers),
                "per_block": rest(stage, layers + 1) - rest(stage, layers),
                "error": "" if need(stage, layers) <= limit else "rank 0: out of memory in the forward"}
    monkeypatch.setattr(memory, "_trial", trial)
    zero.main(["--largest-model", "--max-memory", "1MB", "--world-size", "4", *MODEL])
    out = capsys.readouterr().out
    rows = {int(m[0]): (int(m[1]), int(m[2])) for m in
            re.findall(r"^(\d) +(\d+) +[\d,]+ +\S+ +\S+ +\S+ \| +(\d+) ", out, re.M)}
    assert sorted(rows) == [0, 1, 2, 3]
    for stage, (fits, refused) in rows.items():
        assert need(stage, fits) <= limit < need(stage, refused) and refused == fits + 1, (stage, fits, refused)
    assert rows[2][0] > rows[1][0] > rows[0][0] and (rows[3][0] > rows[2][0]) == (excess != "stage3_heavier")
    assert re.search(r"stage 3 trains \d+\.\dx the parameters of stage 0", out)
    # A trial to measure, then 2 a stage where the guess is right (none, and the README's excess:
    # 9, a third of the 27 the search before this one made); more where the first guesses miss by
    # several blocks, and where stage 3 fits less than the wall it starts from
    assert len(calls) == len(set(calls)) <= {"steep": 16, "stage3_heavier": 20}.get(excess, 9), calls
    assert re.search(rf"^{len(calls)} trials in \d+ s$", out, re.M)


def test_largest_model_refuses_what_it_cannot_measure(monkeypatch, capsys):
    # One rank (the stages do not differ there), a limit the ranks together cannot have on this
    # machine, a SIGTERM (the trial's ranks are killed on the way out: exit 143), and a limit in
    # which no stage trains even 1 block (the table, then one line and exit code 4).
    monkeypatch.delenv("RANK", raising=False)
    before = signal.getsignal(signal.SIGTERM)
    for args, message in [(["--max-memory", "200MB", "--world-size", "1"], "--world-size 2 at least"),
                          (["--max-memory", "1000TB", "--world-size", "2"], "more than this machine's available memory")]:
        with pytest.raises(zero.UsageError, match=message):
            zero.main(["--largest-model", *args, *MODEL])
    killed = []

    def trial(args, stage, layers):
        if stage == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        killed.append(stage)  # (what _trial's finally does with the ranks, it does on SIGTERM too)
        return {"ok": False, "psi": 1, "layers": layers, "error": "rank 0: out of memory in the forward"}
    monkeypatch.setattr(memory, "_trial", trial)
    with pytest.raises(SystemExit) as e:
        zero.main(["--largest-model", "--max-memory", "2MB", "--world-size", "2", *MODEL])
    assert e.value.code == 143 and set(killed) == {0}
    assert signal.getsignal(signal.SIGTERM) == before  # (the handler is --largest-model's only)
    monkeypatch.setattr(memory, "_trial", lambda args, stage, layers: trial(args, 0, layers))
    with pytest.raises(zero.OutOfMemory, match="not even 1 block of d_model 16 trains within --max-memory 2MB"):
        zero.main(["--largest-model", "--max-memory", "2MB", "--world-size", "2", *MODEL])
    assert re.search(r"^3 +none .*\| +1 ", capsys.readouterr().out, re.M)


# On a GPU. Every test above that takes `ranks` or `hybrid_runs` also runs on CUDA tensors (the
# ids cuda-gloo-N2, cuda-nccl-N4, ...: CUDA_RUNS), against the same single-process reference on
# CPU: every stage, fp32 and bf16, overlap and stage 3's prefetch on and off, accumulation,
# buckets, resume, hybrid sharding, and what memory_breakdown() and the bytes sent measure. The
# tests below add what only CUDA has: the allocator's own count of the bytes a rank holds, the
# report and timeline that print it, and --max-memory. Where no GPU is visible they are all
# skipped, saying what is missing.

# The demo GPT, with every tensor under 1 MiB (a block: 198,272 parameters, 793 kB in fp32): the
# caching allocator serves those from its small pool, exactly, in multiples of 512 bytes, so what
# torch.cuda.memory_allocated counts is the tensors alive, to within that rounding.
REPORT = ["--d-model", "128", "--n-layer", "8", "--n-head", "4", "--seq-len", "32", "--batch-size", "2",
          "--steps", "3"]
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
    model = zero.GPT(args.seq_len, args.d_model, args.n_layer, args.n_head).to(DEVICE)
    if args.bf16:
        model.to(torch.bfloat16)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    data = zero.demo_data()
    x, y = zero.get_batch(data, 1, 0, rank, world, args.batch_size, args.seq_len, args.seed)
    for _ in range(2):
        gc.collect()
        torch.cuda.synchronize(DEVICE)
        before = torch.cuda.memory_allocated(DEVICE)
        torch.cuda.reset_peak_memory_stats(DEVICE)
        logits = model(x.to(DEVICE)).float()
        F.cross_entropy(logits.flatten(0, 1), y.to(DEVICE).flatten()).backward()
        torch.cuda.synchronize(DEVICE)
        peak = torch.cuda.max_memory_allocated(DEVICE) - before
        del logits
    return peak


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
            torch.cuda.synchronize(DEVICE)
            base, printed = torch.cuda.memory_allocated(DEVICE), io.StringIO()
            with contextlib.redirect_stdout(printed):
                res = zero.train(args)
                zero.report(res, args)
            panel = memory.timeline_panel(res, args)
            out[(stage, bf16)] = dict(res, base=base, act=act, stdout=printed.getvalue(),
                                      text=memory.timeline_text([panel]), svg=memory.timeline_svg([panel]))
    return out


@pytest.fixture(scope="module", params=CUDA_REPORT_RUNS, ids=run_id)
def cuda_reports(request):
    """(transport, N, every rank's cuda_report)."""
    return (*request.param, run_results(request, request.param, "cuda_report"))


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
    return {"params": pb * S * (1 if stage >= 3 else world), "grads": gb * S * (1 if stage >= 2 else world),
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
    return {"model state, formula": sum(zero.memory_formula(stage, padded, world, pb, gb, ob).values()),
            "gathered units: computing, prefetched, root": 3 * pb * unit * (stage == 3),
            "full unit gradients: filling, in flight": 2 * gb * unit * (stage >= 2),
            "fp32 copies of unit gradients, reduced": 2 * 4 * unit * bf16,
            "gloo's copy of a reduce-scatter's input": 2 * 4 * unit * (backend == "gloo" and stage >= 1),
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
        assert ("(gloo on CUDA tensors:" in out) == (transport == "cuda-gloo" and stage > 0), out
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


def test_cuda_max_memory_refuses_a_run_that_cannot_fit():
    # --max-memory SIZE on CUDA caps this process's share of the GPU
    # (torch.cuda.set_per_process_memory_fraction): a run that cannot fit in 1 MB stops with one
    # line on stderr (exit code 4), while one with room enough trains.
    missing = cuda_missing()
    if missing:
        pytest.skip(missing)
    out = run_py("--device", "cuda", "--max-memory", "1MB", *SMALL)
    assert out.returncode == 4 and out.stderr.count("\n") == 1, out.stderr
    assert "out of memory" in out.stderr.lower() and "Traceback" not in out.stderr + out.stdout, out.stderr
    fits = run_py("--device", "cuda", "--max-memory", "4GB", *SMALL)
    assert fits.returncode == 0 and len(losses(fits.stdout)) == 3, fits.stderr
