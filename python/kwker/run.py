"""Run a Python program with the process settings kwker is measured under.

    python -m kwker.run [--jemalloc] [--threads N] [--cpus LIST] [--] script.py args...
    python -m kwker.run [options] -m module args...

In the manner of PyTorch's own CPU launcher (``python -m torch.backends.xeon.run_cpu``),
these must be set before the interpreter starts (the dynamic loader reads
``LD_PRELOAD``, OpenMP its variables when torch loads it), so the launcher sets
them and replaces itself with a new interpreter running the program:

- ``--jemalloc``: ``LD_PRELOAD`` of the system's jemalloc (Debian's ``libjemalloc2``)
  with ``MALLOC_CONF`` keeping freed pages mapped (JEMALLOC_CONF below);
- ``--threads N``: ``OMP_NUM_THREADS=N``, which sets ``torch.get_num_threads()`` and
  so the size of kwker's own pool; by default, one thread per CPU the program may run on;
- ``--cpus LIST`` (``0-3,6``): the CPUs the program may run on (as ``taskset -c``); with
  ``--threads`` alone, the first N of the CPUs this process may use;
- ``GOMP_SPINCOUNT=10000`` unless the environment already chooses a wait policy
  (README, "Threads": PyTorch's OpenMP threads otherwise spin for milliseconds after
  each parallel op, taking CPU time from kwker's pool).

The environment's own choices are kept (its OMP_NUM_THREADS unless ``--threads``
is given, its wait policy, its MALLOC_CONF), and one line on stderr says what the
launcher set.
"""

import argparse
import os
import sys

from kwker.threads import with_short_spin

# Freed pages are never given back to the system (decay -1), so a tensor freed at
# one step and allocated again at the next costs no page faults. PyTorch's CPU
# tuning guide gives `oversize_threshold:1,background_thread:true,
# metadata_thp:auto,dirty_decay_ms:9000000000,muzzy_decay_ms:9000000000` for
# that, but Debian's jemalloc 5.3 sets the decay of its arena for large
# allocations (all of them with `oversize_threshold:1`; from 8 MiB by default)
# to zero whenever the default decay is positive, however long: every such
# tensor was fresh pages again (a 12.6 MB linear's output, 6 MB of softmax:
# 6146 faults a step and 31.5 ms against glibc's 0 and 23.6; GPT-2 at batch 8
# run eagerly: 360-380 thousand faults a call, 1.06-1.54 s). With -1 that arena
# keeps the default and nothing is purged: 0 faults and 24.2 ms; GPT-2's call 2
# faults and 0.75 s.
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"

JEMALLOC_NAMES = ("libjemalloc.so.2", "libjemalloc.so")


def find_jemalloc(search_dirs=None) -> str:
    """The path of the shared jemalloc to preload: in the Python environment's
    own lib (a conda install), then the system's library folders."""
    if search_dirs is None:
        multiarch = getattr(sys.implementation, "_multiarch", "")
        search_dirs = [os.path.join(sys.prefix, "lib"), f"/usr/lib/{multiarch}", f"/lib/{multiarch}",
                       "/usr/lib64", "/usr/lib", "/usr/local/lib"]
    for d in search_dirs:
        for name in JEMALLOC_NAMES:
            path = os.path.join(d, name)
            if os.path.isfile(path):
                return path
    raise SystemExit("kwker.run: --jemalloc: no libjemalloc.so.2 in " + ", ".join(search_dirs)
                     + " (Debian: apt-get install libjemalloc2; scripts/dev.sh setup installs it)")


def parse_cpus(text: str, allowed_cpus) -> list[int]:
    """`0-3,6` -> [0, 1, 2, 3, 6], as taskset -c reads it, each CPU one of
    allowed_cpus (a range is checked before it is counted out: `0-10000000`
    took 0.8 GB)."""
    allowed = set(allowed_cpus)
    cpus = set()
    try:
        for part in text.split(","):
            first, dash, last = part.partition("-")
            lo, hi = int(first), int(last if dash else first)
            if lo < 0 or hi < lo:
                raise ValueError
            if hi > max(allowed) or not allowed.issuperset(range(lo, hi + 1)):
                raise SystemExit(f"kwker.run: --cpus {text}: this process may only use CPUs {sorted(allowed)}")
            cpus.update(range(lo, hi + 1))
    except ValueError:
        raise SystemExit(f"kwker.run: --cpus {text!r}: expected a list such as 0-3,6") from None
    return sorted(cpus)


def _count(text: str) -> int:
    """OMP_NUM_THREADS as OpenMP reads it (" 8" is 8), 0 for what it would not."""
    try:
        return int(text)
    except ValueError:
        return 0


def launch_settings(args, environ, allowed_cpus) -> tuple[dict, list[int] | None]:
    """The environment and CPU set for the program: what the options ask, the
    user's own variables kept. `allowed_cpus` are the CPUs this process may use."""
    env = with_short_spin(environ)
    cpus = None
    if args.cpus is not None:
        cpus = parse_cpus(args.cpus, allowed_cpus)
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"kwker.run: --threads {args.threads}: expected at least 1")
        if cpus is None and args.threads < len(allowed_cpus):
            cpus = sorted(allowed_cpus)[:args.threads]
        env["OMP_NUM_THREADS"] = str(args.threads)
    else:
        env.setdefault("OMP_NUM_THREADS", str(len(cpus or allowed_cpus)))
    threads, usable = env["OMP_NUM_THREADS"], len(cpus or allowed_cpus)
    if _count(threads) > usable:
        where = f"--threads {threads}" if args.threads is not None else f"OMP_NUM_THREADS={threads}"
        print(f"kwker.run: warning: {where} on {usable} CPUs: threads share a CPU, and each barrier between them "
              "waits for a context switch (torch runs no more threads than the machine has CPUs)", file=sys.stderr)
    if args.jemalloc:
        preload = [p for p in environ.get("LD_PRELOAD", "").split(":") if p]
        env["LD_PRELOAD"] = ":".join([find_jemalloc()] + preload)
        env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    return env, cpus


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """The launcher's own options and the program's command line (`script.py
    args`, `-m module args`, or whatever follows `--`), split where python
    itself would stop reading options: the program's own `--help` is its own."""
    i = 0
    while i < len(argv):
        if argv[i] == "--":
            return argv[:i], argv[i + 1:]
        if argv[i] == "-m" or not argv[i].startswith("-"):
            return argv[:i], argv[i:]
        i += 2 if argv[i] in ("--threads", "--cpus") else 1
    return argv, []


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kwker.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # split_argv knows the options' full names only
        usage="%(prog)s [--jemalloc] [--threads N] [--cpus LIST] [--] script.py args... | -m module args...")
    parser.add_argument("--jemalloc", action="store_true", help="preload the system's jemalloc with MALLOC_CONF")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS (kwker's pool follows torch's thread count)")
    parser.add_argument("--cpus", help="the CPUs the program may run on, e.g. 0-3,6")
    own, program = split_argv(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(own)
    if not program:
        parser.error("name a script (or -m module) to run")
    if program[0].startswith("-") and program[0] not in ("-m", "-"):  # after --: python would take it for its own
        parser.error(f"{program[0]!r} after --: name a script (or -m module) to run; python's own options are not "
                     "passed on")
    env, cpus = launch_settings(args, os.environ, os.sched_getaffinity(0))
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # kept across exec, by the program and every thread it starts
    changed = " ".join(f"{k}={env[k]}" for k in sorted(env) if env[k] != os.environ.get(k))
    print(f"kwker.run: {changed or 'nothing to set'}" + (f" cpus={','.join(map(str, cpus))}" if cpus else ""),
          file=sys.stderr, flush=True)
    os.execve(sys.executable, [sys.executable] + program, env)


if __name__ == "__main__":
    main()
