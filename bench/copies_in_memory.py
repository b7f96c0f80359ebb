"""Decode speed where the memory left holds only some of kwker's weight copies.

A float32 model whose weights are bf16-valued (a bf16 checkpoint loaded in
float32) decodes from bf16 copies, half the bytes; kwker makes them until the
memory left for them runs out (kwker.weights.WeightArena) and reads the rest of
the weights as stored. Each run is a fresh process in a memory cgroup (v1 or
v2; run as root) of the given limit, or none ("none"), runs interleaved:

    GOMP_SPINCOUNT=10000 python bench/copies_in_memory.py --limits-gib 4.0,4.2,none --repeats 3

Per run: decode tokens/s (56 tokens: a 64-token generate() less an 8-token
one, median of 3), the copies made and the bytes refused, peak RSS. Model:
bench/models.py's SmolLM2-360M shape (724 MB of bf16 copies).
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time


def child() -> None:
    import torch

    import kwker
    from kwker import summary
    from kwker.testing import bench_model

    model = bench_model("SmolLM2-360M")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    config = kwker.compile_config()

    def generate(n):
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                       max_cache_len=128, compile_config=config)
        return time.perf_counter() - start

    generate(8)  # compiles
    rates = [56 / (generate(64) - generate(8)) for _ in range(3)]
    graph = summary.graphs()[0]
    print(f"{statistics.median(rates):.1f} tokens/s ({min(rates):.1f}-{max(rates):.1f}), {graph.copies} copies, "
          f"{graph.copies_refused / 2**20:.0f} MiB refused, peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB", flush=True)


def new_cgroup(limit_gib: str) -> str:
    """A new memory cgroup of this limit, below this process's."""
    nbytes = int(float(limit_gib) * 2**30)
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    v1 = next((path for _, controllers, path in lines if "memory" in controllers.split(",")), None)
    folder = f"/sys/fs/cgroup/memory{v1}" if v1 is not None else \
        f"/sys/fs/cgroup{next(path for _, controllers, path in lines if controllers == '')}"
    folder = f"{folder.rstrip('/')}/kwker-bench-{os.getpid()}"
    os.makedirs(folder, exist_ok=True)
    limit_file = "memory.limit_in_bytes" if v1 is not None else "memory.max"
    with open(f"{folder}/{limit_file}", "w") as f:
        f.write(str(nbytes))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limits-gib", default="4.0,4.2,none")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child()
    for repeat in range(args.repeats):
        for limit in args.limits_gib.split(","):
            folder = new_cgroup(limit) if limit != "none" else None
            prefix = ["sh", "-c", f'echo $$ > {folder}/cgroup.procs && exec "$@"', "sh"] if folder else []
            run = subprocess.run([*prefix, sys.executable, __file__, "--child"], capture_output=True, text=True)
            if folder:
                os.rmdir(folder)
            result = run.stdout.strip() or f"exit {run.returncode}: {run.stderr.strip().splitlines()[-1:]}"
            print(f"repeat {repeat + 1}, limit {limit} GiB: {result}", flush=True)


if __name__ == "__main__":
    main()
