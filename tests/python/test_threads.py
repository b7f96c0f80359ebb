"""The hint about PyTorch's OpenMP threads spinning on kwker's CPUs."""

import os
import subprocess
import sys

import torch

from kwker.threads import SPIN_VARIABLES, openmp_spin_hint


def test_the_hint_names_the_variable_when_both_pools_outnumber_the_cpus():
    hint = openmp_spin_hint(n_threads=2, n_cpus=2, environ={})
    assert hint is not None and "GOMP_SPINCOUNT=10000" in hint and "2 threads on 2 CPUs" in hint


def test_no_hint_when_the_pools_fit_or_a_wait_policy_is_set():
    assert openmp_spin_hint(n_threads=4, n_cpus=8, environ={}) is None
    assert openmp_spin_hint(n_threads=1, n_cpus=1, environ={}) is None
    for name in SPIN_VARIABLES:
        assert openmp_spin_hint(n_threads=2, n_cpus=2, environ={name: "1"}) is None


GENERATE = """
import torch
from kwker.testing import small_model
import kwker
torch.set_num_threads({threads})
model = small_model("llama")
ids = torch.tensor([[1, 2, 3, 4]])
for _ in range(2):
    model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static",
                   compile_config=kwker.compile_config())
"""


def run_generate(threads: int, **env) -> str:
    base = {k: v for k, v in os.environ.items() if k not in SPIN_VARIABLES and k != "TORCH_LOGS"}
    result = subprocess.run([sys.executable, "-c", GENERATE.format(threads=threads)], capture_output=True, text=True,
                            timeout=600, env={**base, **env})
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_compiling_a_decode_step_says_it_once_and_only_when_it_matters():
    cpus = len(os.sched_getaffinity(0))
    stderr = run_generate(threads=cpus)
    if torch.backends.openmp.is_available() and cpus > 1:
        assert stderr.count("GOMP_SPINCOUNT=10000") == 1, stderr
    assert "GOMP_SPINCOUNT=10000" not in run_generate(threads=cpus, GOMP_SPINCOUNT="10000")
    assert "GOMP_SPINCOUNT=10000" not in run_generate(threads=1)
