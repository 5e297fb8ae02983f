"""Tests for gpu_check.py, the first command to run on a GPU machine: where no GPU is visible
it says so in one line and exits 2, having run nothing (on a GPU, it is the check itself)."""
import subprocess
import sys

from conftest import ENV, HERE


def test_gpu_check_without_a_gpu_says_so():
    out = subprocess.run([sys.executable, "gpu_check.py"], capture_output=True, text=True,
                         cwd=HERE, env=ENV, timeout=120)  # (ENV hides the GPUs)
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr == \
        "gpu_check.py: error: no CUDA GPU is visible here: nothing to check\n"
