"""
gpu_check.py: the first thing to run on a machine with one GPU or several.

    python gpu_check.py  # about 10 minutes on one GPU; prints a table, exit 1 on a failure

Each line of the table is one check, run as a user would run it, with what it must show:
  - the test suite's CUDA cases (python -m pytest -k cuda): every stage against the CPU
    reference on CUDA tensors, over NCCL (a GPU per rank) and over gloo (ranks sharing a GPU);
  - the demo at every stage over NCCL, one rank per GPU (up to 4), and over gloo with CUDA
    tensors, 2 ranks on GPU 0: it trains, the stages' losses agree;
  - fsdp_demo.py --compare at stage 3: PyTorch's FSDP2 and zero.py from the same weights, the
    same losses;
  - --max-memory on CUDA: a run that cannot fit stops in one line (exit code 4), one with room
    trains;
  - a checkpoint written on the GPU and loaded on the CPU: its files hold CPU tensors, and a CPU
    run resumes from it.
Without a GPU it says so and exits 2. It writes only in a temporary directory.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = ["--n-layer", "2", "--d-model", "32", "--seq-len", "32", "--batch-size", "4",
         "--steps", "3", "--timeout", "120"]


def run(args, ranks=0, timeout=600):
    """A command of this project, as a process (under torchrun with that many ranks)."""
    # (--standalone: a free port, recent torchrun's default; older torch's is port 29500)
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone",
                                    f"--nproc_per_node={ranks}"] if ranks else [])
    return subprocess.run(launcher + args, capture_output=True, text=True, cwd=HERE,
                          timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


def losses(out):
    return [float(x) for x in re.findall(r"^step +\d+ \| loss (\d+\.\d+)", out.stdout, re.M)]


def failed(out, why):
    return f"{why}: exit code {out.returncode}; " + (out.stderr or out.stdout).strip()[-300:]


def suite(tmp):
    out = run(["-m", "pytest", "-q", "-k", "cuda", "-p", "no:cacheprovider"], timeout=900)
    last = (out.stdout.strip().splitlines() or [""])[-1]
    return None if out.returncode == 0 and " passed" in last else failed(out, last)


def stages(backend, ranks, extra):
    def check(tmp):
        runs = []
        for stage in range(4):
            out = run(["zero.py", "--stage", str(stage), "--backend", backend, *extra, *MODEL],
                      ranks)
            if out.returncode or f"({backend}, device cuda)" not in out.stdout:
                return failed(out, f"stage {stage}")
            runs.append(losses(out))
        if not (runs[0][-1] < runs[0][0] and all(
                max(abs(a - b) for a, b in zip(r, runs[0])) < 1e-3 for r in runs)):
            return f"the stages' losses differ: {runs}"
        return None
    return check


def compare(tmp):
    out = run(["fsdp_demo.py", "--stage", "3", "--compare", *MODEL], min(GPUS, 4))
    found = re.search(r"largest loss difference (\S+)", out.stdout)
    if out.returncode or not found:
        return failed(out, "--compare")
    return None if float(found[1]) <= 1e-4 else f"largest loss difference {found[1]}"


def max_memory(tmp):
    small = run(["zero.py", "--device", "cuda", "--max-memory", "1MB", *MODEL])
    if small.returncode != 4 or small.stderr.count("\n") != 1:
        return failed(small, "--max-memory 1MB must stop in one line, exit code 4")
    room = run(["zero.py", "--device", "cuda", "--max-memory", "4GB", *MODEL])
    return failed(room, "--max-memory 4GB must train") if room.returncode else None


def checkpoint(tmp):
    ckpt = os.path.join(tmp, "ckpt")
    out = run(["zero.py", "--stage", "3", "--device", "cuda", "--ckpt-dir", ckpt, *MODEL])
    if out.returncode:
        return failed(out, "writing on the GPU")
    step = os.path.join(ckpt, "step_00000003")
    for name in os.listdir(step):
        if name.endswith(".pt"):
            part = torch.load(os.path.join(step, name), map_location=None, weights_only=True)
            tensors = [u["master"] for u in part["units"]] + list(part["replicated"].values())
            if any(t.device.type != "cpu" for t in tensors):
                return f"{name} holds tensors on {tensors[0].device}"
    resumed = run(["zero.py", "--stage", "1", "--device", "cpu", "--resume-from", step,
                   *MODEL[:-4], "--steps", "4"], 2)
    if resumed.returncode or "resumed from" not in resumed.stdout:
        return failed(resumed, "resuming on the CPU")
    return None


GPUS = torch.cuda.device_count()
CHECKS = [("the suite's CUDA cases (pytest -k cuda)", suite),
          (f"every stage, NCCL, {min(GPUS, 4)} rank(s), a GPU each",
           stages("nccl", min(GPUS, 4), [])),
          ("every stage, gloo, 2 ranks sharing GPU 0", stages("gloo", 2, ["--device", "cuda"])),
          ("fsdp_demo.py --compare, stage 3, FSDP2", compare),
          ("--max-memory on CUDA", max_memory),
          ("a checkpoint written on the GPU, resumed on the CPU", checkpoint)]


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, as every command here
        print(f"gpu_check.py: error: {message}", file=sys.stderr)
        sys.exit(2)


def main():
    Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if GPUS == 0:
        print("gpu_check.py: error: no CUDA GPU is visible here: nothing to check",
              file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {GPUS} GPU(s): "
          f"{torch.cuda.get_device_name(0)}")
    rows, t0 = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for name, check in CHECKS:
            start = time.time()
            try:
                problem = check(tmp)
            except subprocess.TimeoutExpired as e:
                problem = f"no answer in {e.timeout:.0f} s"
            rows.append((name, problem, time.time() - start))
            print(f"{'passed' if problem is None else 'FAILED':<7} {rows[-1][2]:6.0f} s  {name}"
                  + (f"\n        {problem}" if problem else ""), flush=True)
    bad = sum(problem is not None for _, problem, _ in rows)
    print(f"\n{len(rows) - bad} of {len(rows)} checks passed in {time.time() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
