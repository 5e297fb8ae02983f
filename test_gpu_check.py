"""Tests for gpu_check.py, the first command to run on a GPU machine: where no GPU is visible
it says so in one line and exits 2, having run nothing (on a GPU, it is the check itself)."""
import os
import sys

import pytest

from conftest import HERE, Early

WITHOUT_A_GPU = Early(script=os.path.join(HERE, "gpu_check.py"))  # (its ENV hides the GPUs)


def test_gpu_check_without_a_gpu_says_so():
    out = WITHOUT_A_GPU.result()
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr == \
        "gpu_check.py: error: no CUDA GPU is visible here: nothing to check\n"


def test_gpu_check_refuses_what_it_does_not_take(monkeypatch, capsys):
    import gpu_check  # (its parser, in this process: nothing runs before it)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--bogus", "5"])
    with pytest.raises(SystemExit) as e:
        gpu_check.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--bogus" in err, err
