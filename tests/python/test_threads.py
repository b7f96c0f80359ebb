"""The hint about PyTorch's OpenMP threads spinning on kwker's CPUs."""

import os
import subprocess
import sys

import torch

from kwker.threads import SPIN_VARIABLES, ForkSafeLock, openmp_spin_hint


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


def test_a_fork_safe_lock_held_by_another_thread_at_a_fork_is_free_in_the_child():
    """fork copies only the forking thread: a threading.Lock another thread held
    (a StepPerSizes' across a decode step's call) stayed held in the child, and
    the child's first call of that step hung."""
    import signal
    import threading

    lock, inside, leave = ForkSafeLock(), threading.Event(), threading.Event()

    def hold():
        with lock:
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    assert inside.wait(30)
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # held for good: the child ends by the alarm, not 0
        with lock:
            pass
        os._exit(0)
    leave.set()
    thread.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with lock:  # the parent's lock was released by the thread that held it
        pass


def test_a_forked_child_gets_a_thread_pool_of_its_own_for_inductors_compiles(monkeypatch):
    """Inductor's compile thread pool, made in the parent, has no threads in a
    child: a graph compiled there (after a recompile for the child's thread
    count, kwker's tuning compiling Inductor's candidate) waited for ever on a
    kernel's future."""
    import signal

    from torch._inductor import async_compile
    from torch._inductor.async_compile import AsyncCompile

    # config.compile_threads is assigned lazily: patched and put back, it was gone for later compiles
    monkeypatch.setattr(async_compile, "get_compile_threads", lambda: 2)
    assert AsyncCompile.pool().submit(int, 1).result() == 1
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # the pool's threads missing: the child ends by the alarm, not 0
        os._exit(0 if AsyncCompile.pool().submit(int, 1).result(timeout=15) == 1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_fork_safe_lock_held_by_the_forking_thread_stays_its_own_in_the_child():
    """The thread that forks inside a lock goes on inside it in the child: a
    fresh lock there let another thread in beside it, and its exit released the
    other's lock (a review's reproducer)."""
    import signal
    import threading

    lock = ForkSafeLock()
    with lock:
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)
            entered = []
            other = threading.Thread(target=lambda: lock._lock.acquire(timeout=0.5) or entered.append("waited"))
            other.start()
            other.join()
    if pid == 0:
        os._exit(0 if entered == ["waited"] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
