"""Tests for tradeoffs.py: the time model, --estimate's prediction for a cluster, and the
trade-off table of one launch (--tradeoffs).

What the README claims, and the tests that check it:

- A collective's time is the latency-bandwidth formula of a ring:
  test_collective_time_is_the_ring_formula; what overlap hides: test_overlap_hides_all_but_one_unit.
- The model says what the paper says in bytes, in time: test_stages_1_and_2_cost_stage_0s_time_
  and_stage_3_one_and_a_half_times (bandwidth alone); small units pay latency:
  test_small_units_pay_latency.
- --estimate --cluster: its memory is --estimate's, where activations are left out
  (test_cluster_estimate_memory_is_the_formulas), it names what fits and what binds
  (test_cluster_estimate_names_what_fits_and_binds), hybrid sharding over slow links
  (test_hybrid_sharding_wins_stage_3_back_over_slow_links), bad input is one line
  (test_cluster_bad_input_is_one_line), of any context length
  (test_an_estimate_takes_any_context_length).
- --tradeoffs: its memory and bytes are the report's: test_tradeoff_table_is_the_reports (a
  4-rank launch shared with test_zero.py's command-line runs); of one step, its median says so
  (test_a_one_step_table_says_its_median_holds_the_warm_up), and its waiting is that step's
  (test_the_tables_waiting_is_the_median_steps_own). Run as a script, it says where its commands
  are: test_run_as_a_script_it_says_where_its_commands_are.
"""
import os
import re
import subprocess
import sys

import pytest

import memory
import tradeoffs
import zero
from conftest import MODEL, main_printed, main_refused

# ----------------------------------------------------------------------------------------------
# The time model


def test_collective_time_is_the_ring_formula():
    link = tradeoffs.Link(alpha=1e-5, beta=1e9)
    M, n = 8e6, 4
    assert tradeoffs.collective_time("all_reduce", M, n, link) == pytest.approx(
        2 * (n - 1) * (1e-5 + M / n / 1e9))
    for kind in ("reduce_scatter", "all_gather"):
        assert tradeoffs.collective_time(kind, M, n, link) == pytest.approx(
            (n - 1) * (1e-5 + M / n / 1e9))
    assert tradeoffs.collective_time("all_reduce across groups", M, n, link) == \
        tradeoffs.collective_time("all_reduce", M, n, link)
    assert tradeoffs.collective_time("all_reduce", M, 1, link) == 0


def test_overlap_hides_all_but_one_unit():
    assert tradeoffs.overlapped(comm=1.0, compute=10.0, units=4) == pytest.approx(0.25)
    assert tradeoffs.overlapped(comm=10.0, compute=4.0, units=4) == pytest.approx(10 - 3)
    assert tradeoffs.overlapped(comm=1.0, compute=10.0, units=4, overlap=False) == 1.0


def ring_only(beta=1e9, alpha=0.0):
    link = tradeoffs.Link(alpha, beta)
    return lambda kind, nbytes, n, across: tradeoffs.collective_time(kind, nbytes, n, link)


def test_stages_1_and_2_cost_stage_0s_time_and_stage_3_one_and_a_half_times():
    units, N = [(1 << 20, False)] * 8, 8  # no latency, the same bytes for gathers and reductions
    comm = {s: tradeoffs.step_time(s, units, N, N, ring_only(), 0, 0)["comm"] for s in range(4)}
    small = {s: (2 if s == 0 else 3) * ring_only()("all_reduce", 16, N, False) for s in range(4)}
    big = {s: comm[s] - small[s] for s in range(4)}
    assert big[1] == pytest.approx(big[0]) and big[2] == pytest.approx(big[0])
    assert big[3] == pytest.approx(1.5 * big[0])
    # without compute nothing hides: all of it is exposed, and the step is the communication
    t = tradeoffs.step_time(3, units, N, N, ring_only(), 0, 0)
    assert t["exposed"] == pytest.approx(t["comm"]) and t["step"] == pytest.approx(t["comm"])
    # with compute to hide behind, overlap hides all the reductions but one unit's; stages 1 and
    # 2 wait for their all-gathers after the step, which no compute hides
    t = {s: tradeoffs.step_time(s, units, N, N, ring_only(), 100.0, 0) for s in (0, 2)}
    assert t[0]["exposed"] == pytest.approx(big[0] / 8 + small[0])
    assert t[2]["exposed"] == pytest.approx(big[2] / 2 / 8 + big[2] / 2 + small[2])
    assert t[2]["step"] == pytest.approx(t[2]["compute"] + t[2]["exposed"])


def test_small_units_pay_latency():
    psi, N = 1 << 24, 8
    coarse, fine = [(psi // 4, False)] * 4, [(psi // 256, False)] * 256
    slow = ring_only(alpha=50e-6)
    assert tradeoffs.step_time(3, fine, N, N, slow, 0, 0)["comm"] > \
        2 * tradeoffs.step_time(3, coarse, N, N, slow, 0, 0)["comm"]


# ----------------------------------------------------------------------------------------------
# Predicted for a cluster: --estimate --cluster

SEVEN_B = ["--estimate", "--params", "7e9", "--world-size", "16", "--n-layer", "32",
           "--d-model", "4096", "--seq-len", "4096", "--batch-size", "1"]


def rows(out):
    """[(stage, G, ckpt, model state, activations, fits, step ms)] of --cluster's table."""
    return [(int(m[0]), int(m[1]), m[2] == "yes", m[3], m[4], m[5] == "yes", float(m[6]))
            for m in re.findall(r"^(\d) +(\d+) +(yes|no) +(\S+)B +(\S+)B +\S+B +(yes|NO) +\S+ "
                                r"+\S+ +\S+ +(\S+) +\S+$", out, re.M)]


def test_cluster_estimate_memory_is_the_formulas():
    out = main_printed(zero.main, SEVEN_B + ["--cluster", "gpus_per_node=8"])
    table = rows(out)
    assert len(table) == 2 * (1 + 3 * 2)  # stage 0 at G = N; stages 1-3 at G = 16 and 8
    for stage, G, _, state, _, _, _ in table:
        want = sum(zero.memory_formula(stage, 7e9, 16, 2, 2, 12, G).values())
        assert state == memory._si(want)
    # the same numbers as --estimate's own table, which prints first
    estimated = re.findall(r"^(\d) .* (\S+) GB +\S+ +\S+$", out, re.M)
    for stage, total in estimated:
        want = sum(zero.memory_formula(int(stage), 7e9, 16, 2, 2, 12).values()) / 1e9
        assert float(total) == pytest.approx(want, abs=0.06)
    # activations: checkpointing keeps less
    act = {ckpt: a for _, _, ckpt, _, a, _, _ in table}
    assert act[True] != act[False]
    assert "given:\n  gpus_per_node=8\n" in out and "\nassumed (the defaults" in out
    # --stage: that stage's rows only, in both tables (every stage's times came with one's memory)
    out = main_printed(zero.main, SEVEN_B + ["--cluster", "gpus_per_node=8", "--stage", "3"])
    assert {r[0] for r in rows(out)} == {3} and len(rows(out)) == 4
    assert [s for s, _ in re.findall(r"^(\d) .* (\S+) GB +\S+ +\S+$", out, re.M)] == ["3"]


def test_cluster_estimate_names_what_fits_and_binds():
    out = main_printed(zero.main, SEVEN_B + ["--cluster", ""])
    assert re.search(r"^verdict: stage \d.* fits and is fastest", out, re.M), out
    fitting = [r for r in rows(out) if r[5]]
    assert fitting and not any(r[0] == 0 for r in fitting)  # 7B at stage 0: 112 GB a rank
    # stages 1 and 2 take the same time here; of the two, the one that holds less is named
    step = {(s, G, c): t for s, G, c, _, _, _, t in rows(out)}
    assert step[1, 8, False] == step[2, 8, False] and "verdict: stage 2 with G = 8" in out
    out = main_printed(zero.main, SEVEN_B + ["--cluster", "gpu_memory=1e9"])
    assert "verdict: no stage fits in gpu_memory" in out and "memory binds" in out
    out = main_printed(zero.main, SEVEN_B + ["--cluster", "", "--stage", "0"])  # 112 GB a rank
    assert "verdict: stage 0 does not fit in gpu_memory" in out and "or another stage)" in out


def test_hybrid_sharding_wins_stage_3_back_over_slow_links():
    out = main_printed(zero.main, SEVEN_B + ["--cluster", "inter_bw=1.25e9"])
    step = {(s, G, c): t for s, G, c, _, _, _, t in rows(out)}
    assert step[3, 8, False] < step[3, 16, False]  # the gathers stay inside a node
    # Its rings across the groups (one per rank of a group, all at once) share each node's link;
    # a ring over the whole job crosses each node's link once; inside a node, NVLink
    c = tradeoffs.Cluster()
    assert c.ring(2, True, 16, 8) == tradeoffs.Link(c.inter_latency, c.inter_bw / 8)
    assert c.ring(4, True, 16, 4) == tradeoffs.Link(c.inter_latency, c.inter_bw / 4)
    assert c.ring(16, False, 16, 16) == tradeoffs.Link(c.inter_latency, c.inter_bw)
    assert c.ring(8, False, 16, 8) == c.ring(2, True, 8, 4) == tradeoffs.Link(c.intra_latency,
                                                                               c.intra_bw)


def test_cluster_bad_input_is_one_line():
    for argv, message in [(["--cluster", "speed=3"], "--cluster: no key 'speed'"),
                          (["--cluster", "flops=fast"], "--cluster flops=fast: not a number"),
                          (["--cluster", "gpus_per_node=2.5"], "not a whole number"),
                          (["--cluster", "flops=1e15,flops=2e15"], "'flops' twice"),
                          (["--cluster", "flops=-1"], "must be positive"),
                          (["--cluster", "flops=1e-300"], "from 1e-09 to 1e+21"),  # (inf, nan)
                          (["--cluster", "inter_latency=1e308"], "from 1e-09 to 1e+21"),
                          (["--cluster", "gpus_per_node=3"], "does not divide --world-size 16"),
                          # (1e24: a million layers, one by one; it ran for minutes)
                          (["--params", "1e24", "--cluster", ""],
                           "at most 1e+15 parameters with --cluster"),
                          (["--params", "0.5"], "--params 0.5: at least 1 parameter"),
                          # (16Ψ bytes overflowed to inf: a traceback in the table)
                          (["--params", "2e307"], "at most 1e+300 parameters"),
                          (["--params", "7.5"], "--params 7.5: a whole number of parameters"),
                          # training's flags, which it would ignore
                          (["--init-from", "x.pt"], "--init-from is for training"),
                          (["--data", __file__], "--data is for training"),
                          (["--bucket-mb", "25"], "--bucket-mb is for training")]:
        error, _ = main_refused(zero.main, SEVEN_B + argv)
        assert error and message in error and "\n" not in error, (argv, error)
    error, _ = main_refused(zero.main, ["--cluster", ""])
    assert error == "--cluster is for --estimate"


# ----------------------------------------------------------------------------------------------
# Measured here, in one launch: --tradeoffs (a run of test_zero.py's 4-rank launch, cli_runs)

def test_tradeoff_table_is_the_reports(cli_runs):
    _, printed = cli_runs
    table = printed["tradeoffs"]
    got = {int(m[0]): (int(m[1].replace(",", "")), int(m[2].replace(",", "")), m[3:])
           for m in re.findall(r"^(\d) +block +([\d,]+) +([\d,]+) +(\S+) +(\S+) +(\S+) \| +(\S+) "
                               r"+(\S+) +(\S+)$", table, re.M)}
    assert sorted(got) == [0, 1, 2, 3], table
    for stage, (state, sent, numbers) in got.items():
        report = printed[f"stage {stage}"]
        assert state == int(re.search(r"^  total +([\d,]+) ", report, re.M)[1].replace(",", ""))
        comm = re.search(r"^communication per rank.*?^  total +([\d,]+)", report, re.M | re.S)
        assert sent == int(comm[1].replace(",", ""))
        step, waiting, tokens, predicted, _, ratio = map(float, numbers)
        assert 0 <= waiting <= step and predicted > 0
        assert ratio == pytest.approx(step / predicted, rel=0.02, abs=0.01)
        assert tokens == pytest.approx(4 * 4 * 16 / (step / 1e3), rel=0.02)
    assert "calibrated here" in table and "On CPU compute and communication share" in table


def test_cluster_estimate_assumes_a_shape_from_psi_where_none_is_given():
    out = main_printed(zero.main, ["--estimate", "--params", "7e9", "--world-size", "16",
                                   "--cluster", ""])
    # GPT-3's and Llama's 7B are 32 layers of 4096: Ψ ≈ 12·L·d² with d = 128·L gives about that
    assert "33 layers of d_model 4224, 1 row(s) x\n2048 tokens per rank" in out
    assert "(assumed, not given: layers and d_model from Ψ, d_model = 128·layers)" in out
    assert "(assumed, not given: seq_len 2048)" in out
    out = main_printed(zero.main, SEVEN_B + ["--cluster", ""])  # every shape flag given
    assert "32 layers of d_model 4096, 1 row(s) x\n4096 tokens" in out and "not given" not in out
    out = main_printed(zero.main, ["--estimate", "--params", "7e9", "--world-size", "16",
                                   "--n-lay", "32", "--cluster", ""])  # (abbreviated)
    assert "32 layers of d_model 4288" in out and "d_model from Ψ and layers" in out
    assert "note:" not in out  # (the shape given agrees with Ψ: SEVEN_B, above, too)
    out = main_printed(zero.main, ["--estimate", "--params", "7e9", "--world-size", "16",
                                   "--n-layer", "2", "--d-model", "256", "--cluster", ""])
    assert "(note: --params is 4,450x the blocks' 12·layers·d_model² (embeddings?):" in out
    out = main_printed(zero.main, ["--estimate", "--params", "1000", "--world-size", "2",
                                   "--cluster", ""])  # the least shape: 1 layer of 64, 49,152
    assert "1 layers of d_model 64" in out and "(note: --params is 0.02x the blocks'" in out


def test_a_one_step_table_says_its_median_holds_the_warm_up(one_rank):
    # the median leaves the first step out, unless it is the only one
    out = main_printed(zero.main, ["--tradeoffs", "--steps", "1", *MODEL])
    assert "median step\n(one step, with its warm-up)" in out and "left out" not in out


def test_tradeoffs_refuses_what_it_would_not_apply():
    # --max-memory's limit stays with the process: the next stage's run would start under it
    # (every stage is trained: --stage had no say)
    for argv in (["--max-memory", "1MB"], ["--ckpt-dir", "d"], ["--stage", "2"], ["--sta=1"]):
        error, _ = main_refused(zero.main, ["--tradeoffs", *argv, *MODEL])
        assert error and error.startswith("--tradeoffs trains every stage from the start: not "
                                          "with"), (argv, error)


def test_the_tables_waiting_is_the_median_steps_own():
    # the step time is the median step's (the first left out), and its waiting is that step's,
    # as the legend's "waiting: of it" says, not a median of the waits taken apart
    args = zero.training_parser("").parse_args([])
    res = {"times": [9.0, 1.0, 3.0, 2.0], "waits": [0.5, 0.3, 0.4, 0.1], "mem": {"params": 1},
           "comm": {"all_reduce": 2.0}, "world": 1}
    row = tradeoffs.measured_row(res, args)
    assert (row["step"], row["waiting"]) == (2.0, 0.1)


def test_an_estimate_under_torchrun_is_printed_once(monkeypatch, capsys):
    # --estimate starts no process group: each rank would print it; rank 0 does, bad input on all
    monkeypatch.setenv("RANK", "1")
    assert zero.main(SEVEN_B + ["--cluster", ""]) in (0, None) and capsys.readouterr().out == ""
    assert main_refused(zero.main, SEVEN_B + ["--cluster", "flops=0"])[0].startswith("--cluster")
    monkeypatch.setenv("RANK", "0")
    assert "verdict: stage" in main_printed(zero.main, SEVEN_B + ["--cluster", ""])


def test_an_estimate_takes_any_context_length():
    # --estimate reads no data: a sequence longer than the demo's corpus is an estimate's to make
    long = main_printed(zero.main, SEVEN_B + ["--cluster", "", "--seq-len", "262144"])
    short = main_printed(zero.main, SEVEN_B + ["--cluster", ""])
    assert rows(long) and [r[4] for r in rows(long)] != [r[4] for r in rows(short)]


def test_run_as_a_script_it_says_where_its_commands_are():
    done = subprocess.run([sys.executable, "tradeoffs.py"], cwd=os.path.dirname(__file__),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == "" and done.stderr.count("\n") == 1
    assert "python zero.py --tradeoffs" in done.stderr
