"""kwker's threads and PyTorch's OpenMP threads on the same CPUs.

PyTorch's CPU wheels run intra-op work on GNU OpenMP, whose idle threads spin
before they sleep (GOMP_SPINCOUNT, 300000 pauses by default: 8 ms of CPU each
on the 2-vCPU Zen 4 machines kwker is measured on). generate() runs parallel ops
between decode steps (the copy of the logits, argmax), so when PyTorch's threads
and kwker's together outnumber the CPUs, the spinning threads take CPU time from
the replayed step: bench/decode.py --quick measured SmolLM2-360M at 25.8 tokens/s
by default and 32.6 with GOMP_SPINCOUNT=10000, which left eager (6.80 / 6.84)
and Inductor (6.97 / 7.08) as they were. OpenMP reads these variables when it
starts, before kwker is imported, so kwker can only say so.
"""

import logging
import os
import sys
import threading
import weakref

log = logging.getLogger(__name__)


class ForkSafeLock:
    """A threading.Lock that a forked child finds free. fork copies only the
    forking thread, so a lock another thread held at the fork (a generate()
    thread inside a decode step's call beside a forking DataLoader) would be
    held in the child for good, and its first call there would hang. Every
    lock kwker holds is one (the plans' own are their CallLocks, which _C
    frees in a child the same way)."""

    def __init__(self):
        self._lock = self._held = threading.Lock()
        self._owner = None  # the thread holding it
        _fork_safe_locks.add(self)

    def __enter__(self):
        lock = self._lock
        lock.acquire()
        self._held, self._owner = lock, threading.get_ident()  # the one to release: a child's fresh lock is not it
        return self

    def __exit__(self, *exc):
        self._owner = None
        self._held.release()


_fork_safe_locks: "weakref.WeakSet[ForkSafeLock]" = weakref.WeakSet()


def _after_fork_in_child():
    forker = threading.get_ident()  # the child's only thread, still inside what it holds
    for lock in list(_fork_safe_locks):
        if lock._owner != forker:
            lock._lock, lock._owner = threading.Lock(), None
    # Inductor forgets its compile process pool in a child but not its thread pool, whose threads
    # the child does not have: a graph compiled there (kwker's tuning, after a recompile for the
    # child's thread count) waited for ever on a kernel's future (torch 2.13).
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None:
        async_compile.AsyncCompile.pool.cache_clear()


os.register_at_fork(after_in_child=_after_fork_in_child)

SPIN_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")

_warned = False


def with_short_spin(environ) -> dict:
    """A copy of `environ` with GOMP_SPINCOUNT=10000 (README, "Threads") unless it
    already chooses a wait policy: what kwker.run gives a program, and bench/peers.py
    every backend."""
    env = dict(environ)
    if not any(name in environ for name in SPIN_VARIABLES):
        env["GOMP_SPINCOUNT"] = "10000"
    return env


def openmp_spin_hint(n_threads: int, n_cpus: int, environ=os.environ) -> str | None:
    """Why and how to shorten OpenMP's spinning, or None when it cannot matter:
    the user chose a wait policy, OpenMP is absent, or both pools fit the CPUs
    (kwker's pool has n_threads - 1 workers, OpenMP's team as many)."""
    import torch  # here, so that the launcher (kwker.run) reads SPIN_VARIABLES without starting torch

    if any(name in environ for name in SPIN_VARIABLES) or not torch.backends.openmp.is_available():
        return None
    if 2 * n_threads - 1 <= n_cpus:
        return None
    return (
        f"kwker: PyTorch's OpenMP threads spin for milliseconds after each parallel op, and with {n_threads} threads on "
        f"{n_cpus} CPUs they take CPU time from kwker's decode steps. Set GOMP_SPINCOUNT=10000 in the environment "
        "before Python starts (KMP_BLOCKTIME=1 with Intel OpenMP): decoding measured about 25 % faster, eager and "
        "Inductor as fast as before. Setting any of " + ", ".join(SPIN_VARIABLES) + " silences this message."
    )


def warn_once_if_openmp_spins() -> None:
    global _warned
    if _warned:
        return
    _warned = True
    import torch

    hint = openmp_spin_hint(torch.get_num_threads(), len(os.sched_getaffinity(0)))
    if hint:
        log.warning(hint)
