"""Native kernels and thread pool against this machine's memory bandwidth.

    python bench/ops.py [--quick] --out FILE [--threads N]

Configures and builds bench/ops_bench.c (CMake, Release, -DKW_BENCH=ON, into
build/bench), runs it, writes its JSON to FILE and prints it as markdown tables.
What each field means is in bench/README.md ("ops") and at the top of
bench/ops_bench.c. --quick (fewer repeats and sizes) finishes in under two
minutes; --threads defaults to the CPUs this process may run on.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "bench"

TARGETS = {"gemv_frac_of_read": 0.85, "barrier_us_2": 0.5, "attention_ratio": 1.2}


def build() -> Path:
    subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(BUILD), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DKW_BENCH=ON",
         "-DKW_TESTS=OFF", "-DKW_PYTHON=OFF"],
        check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(BUILD), "-j2", "--target", "ops_bench"], check=True,
                   stdout=subprocess.DEVNULL)
    return BUILD / "bench" / "ops_bench"


def cpu_busy_s() -> float:
    """CPU seconds all processes have spent busy (/proc/stat), and the share of it
    that was this process's children: the difference is everyone else."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run(exe: Path, threads: int, quick: bool) -> dict:
    cmd = [str(exe), "--threads", str(threads)] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out)


def markdown(r: dict) -> str:
    read = r["read_gbs"]
    lines = [f"Threads: {r['threads']}, ISA: {r['isa']}, read bandwidth: **{read:.1f} GB/s**; other processes "
             f"used {100 * r['others_cpu_share']:.0f} % of the CPUs meanwhile", "",
             "| GEMV (M = 1, Llama-3.2-1B shapes) | GB/s | of read bandwidth | target | best run: of best read |",
             "|---|---|---|---|---|"]
    for g in r["gemv"]:
        ok = "met" if g["frac_of_read"] >= TARGETS["gemv_frac_of_read"] else "**missed**"
        lines.append(f"| {g['weights']} weights, {g['acts']} acts | {g['gbs']:.1f} | {g['frac_of_read']:.2f} "
                     f"| ≥ 0.85: {ok} | {g['frac_best']:.2f} |")
    lines += ["", "| per-op barrier (empty kernel) | µs |", "|---|---|"]
    for n, us in r["barrier_us"].items():
        target = ""
        if n == "2":
            target = " (target ≤ 0.5: " + ("met" if us <= TARGETS["barrier_us_2"] else "**missed**") + ")"
        lines.append(f"| {n} thread{'s' if n != '1' else ''} | {us:.3f}{target} |")
    a = r["attention_us"]
    ratio = a["S4096"] / a["S256"]
    ok = "met" if ratio <= TARGETS["attention_ratio"] else "**missed**"
    lines += ["", "| decode attention, 128 valid positions | µs |", "|---|---|",
              f"| S = 256 | {a['S256']:.1f} |", f"| S = 4096 | {a['S4096']:.1f} |",
              f"| ratio | {ratio:.2f} (target ≤ 1.2: {ok}) |"]
    lines += ["", "| decode op (bf16, with its barrier) | µs |", "|---|---|"]
    lines += [f"| {name} | {us:.2f} |" for name, us in r["ops_us"].items()]
    for dt, c in r["dnnl_crossover"].items():
        lines += ["", f"| {dt} gate+up+down, M | linear µs | matmul_dnnl µs |", "|---|---|---|"]
        lines += [f"| {m} | {l:.0f} | {'-' if d is None else f'{d:.0f}'} |"
                  for m, l, d in zip(c["M"], c["linear_us"], c["dnnl_us"])]
        cross = c["crossover_m"]
        if c["dnnl_us"][0] is None:
            lines.append(f"| crossover | none: oneDNN makes no {dt} matmul on this CPU | |")
        else:
            lines.append(f"| crossover | {'none in range' if cross < 0 else f'M ≥ {cross}'} | |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and sizes (< 2 minutes)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    t0 = time.time()
    exe = build()
    # Other processes on the machine skew every figure here: record how much CPU
    # they used while the benchmark ran (a share of all CPUs), and the load average.
    load_before, busy0, own0, t_run = os.getloadavg()[0], cpu_busy_s(), children_cpu_s(), time.time()
    result = run(exe, args.threads, args.quick)
    others = (cpu_busy_s() - busy0) - (children_cpu_s() - own0)
    result["others_cpu_share"] = round(max(others, 0.0) / ((time.time() - t_run) * os.cpu_count()), 3)
    result["loadavg_1min"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}
    result["wall_s"] = round(time.time() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
