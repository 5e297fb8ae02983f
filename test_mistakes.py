"""Tests for mistakes.py, the lab of classic mistakes: each mistake shows its symptom, by a
margin rounding cannot reach, and the right code beside it does not
(test_each_mistake_shows_its_symptom_and_the_right_code_does_not); its table, --json, --list and
bad input, one line and exit code 2 (test_the_mistakes_lab_command_line).
"""
import json
import os
import re

import pytest

import mistakes
import zero
from conftest import main_printed, main_refused, scenario

@scenario(2)
def mistakes_lab(rank, world):
    """Every mistake in quick mode (fewer steps, a hang ended after 1 s), then the command line
    as torchrun runs it, on two mistakes, with --json."""
    out = {"results": mistakes.run_lab([], quick=True)}
    path = os.path.join(os.environ["ZERO_TEST_TMP"], "mistakes.json")
    out["printed"] = main_printed(mistakes.main,
                                  ["--json", path, "no-divide-sgd", "units-out-of-order"])
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
        trains = (r["right_distance"] < ROUNDING
                  and (r["wrong_distance"] < ROUNDING) == (name == "late-reduce-scatter"))
        return (wrong >= full + shards and trains,
                right > shards + 5 * BLOCK or r["right_distance"] > ROUNDING)
    if name == "one-unit":  # the whole model gathered; right: the shards, the root and two blocks
        shards, full = tiny_bytes(3, "params", world), tiny_bytes(0, "params", world)
        return (wrong >= full + shards and r["wrong_distance"] < ROUNDING,
                right > shards + ROOT + 2 * BLOCK + 64 or r["right_distance"] > ROUNDING)
    if name == "no-regather":
        return wrong.startswith("RuntimeError: "), not isinstance(right, float)
    if name == "eval-on-rank-0":
        # (how long the 1-second timeout took to end it is the machine's: not checked)
        return (wrong.startswith("hang: ") and re.search(r"timeout after \d+\.\d s", wrong),
                not isinstance(right, float))
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
def test_each_mistake_shows_its_symptom_and_the_right_code_does_not(ran, name):
    lab = ran(mistakes_lab, 2)
    r = lab[0]["results"][name]
    shows, right_shows = mistake_symptoms(name, r, 2)
    assert shows, r
    assert not right_shows, r
    # zero.py's guard stops it
    if name in ("units-out-of-order", "no-zero-grad", "state-dict-at-stage-3"):
        for res in lab:
            assert res["results"][name]["guard"].startswith("RuntimeError: zero: ")
    if name == "no-divide-adamw":  # the contrast: almost invisible under AdamW, not under SGD
        assert r["wrong"] < lab[0]["results"]["no-divide-sgd"]["wrong"] / 1e4


def test_the_mistakes_lab_command_line(ran, shared, refused, one_rank):
    lab = ran(mistakes_lab, 2)
    printed = lab[0]["printed"]  # rank 0's; the other rank prints nothing
    assert lab[1]["printed"] == ""
    lines = printed.splitlines()
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    assert (any(line.startswith("no-divide-sgd ") for line in lines)
            and lines[-1].startswith("wall time: "))
    assert ("  with the guard: RuntimeError: zero: ranks communicated different units or orders"
            in printed)
    rows = json.load(open(os.path.join(shared, "mistakes.json")))
    assert [row["name"] for row in rows] == ["no-divide-sgd", "units-out-of-order"]
    assert all({"name", "stages", "measure", "wrong", "right", "why", "where"} <= set(row)
               for row in rows)
    assert rows[0]["where"] == "ZeRO1._reduce_grads" and rows[0]["wrong"] > 1e-3 > rows[0]["right"]
    listed = main_printed(mistakes.main, ["--list"]).splitlines()
    assert [line.split()[0] for line in listed] == list(mistakes.MISTAKES) and len(listed) >= 12
    assert all(len(line) <= 100 for line in listed)
    for argv, message in [(["nope"], "no mistake named 'nope'"), (["--nope"], "--nope"),
                          (["--json", os.path.join(shared, "none", "x.json")], "no directory"),
                          (["--json", "/proc/x.json"], "cannot write in /proc"),  # (root too)
                          (["--list", "no-divide-sgd"], "not with names"),
                          (["--list", "--json", "x.json"], "not with names or --json"),
                          (["--json", ""], "--json '': an empty name"),
                          (["no-divide-sgd"], "2 or more ranks")]:  # one_rank: a group of one
        error, out = main_refused(mistakes.main, argv)
        assert error and message in error and "\n" not in error and out == "", (argv, error)
    code, out, err, message = refused["mistakes.py"]  # end to end: one line, exit code 2
    assert code == 2 and err == (f"mistakes.py: error: {message}; "
                                 "see `python mistakes.py --list`\n"), err
