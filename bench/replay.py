"""Replay overhead: what a plan costs beyond its kernels.

    python bench/replay.py [--quick] --out FILE

Synthetic plans, built with kwker._C.PlanBuilder and called from Python:

* per op, 400-step plans at 1 and 2 threads (median over repeats, the cost of an
  empty plan's call subtracted):
  - ``chain``: binary add over 2048 floats, each step reading the previous one's
    output, so a barrier precedes every step (dispatch + barrier + a tiny kernel);
  - ``independent``: the same adds into disjoint slices (no barriers: dispatch + kernel);
  - ``nop_barrier``: empty kernels with a barrier before each (dispatch + barrier);
  - ``nop``: empty kernels, no barriers (dispatch alone);
* per Python call: a plan of one empty kernel and 10 per-call inputs (every input
  checked: type, device, dtype, shape, strides, pointer), no outputs; the same with
  one fresh output.

JSON: ``per_op_us`` {"<threads>": us} is the chain; ``per_op_by_kind_us`` has every
kind; ``python_call_us`` is the 10-input call at 1 thread, ``python_call_by_threads_us``
at each; ``*_best_*`` hold the fastest repeat instead of the median (on a shared
machine, the cost without contention). A markdown table is printed.
"""

import argparse
import json
import os
import platform
import statistics
import time

import torch

from kwker import _C

N_OPS = 400
N_FLOATS = 2048
F32 = torch.float32
P = _C.op_params()


def chain_plan(n_threads, n_ops=N_OPS):
    """y_{i+1} = y_i + c, ping-ponging between two arena buffers."""
    b = _C.PlanBuilder()
    c = b.constant(torch.ones(N_FLOATS), "c")
    v_c = b.view(c, F32, (N_FLOATS,))
    bufs = [b.arena(N_FLOATS * 4, name) for name in ("ping", "pong")]
    views = [b.view(buf, F32, (N_FLOATS,)) for buf in bufs]
    b.op("binary", [views[0], v_c, v_c], ip=[P["BINARY_ADD"]], fp=[0.0])
    for i in range(1, n_ops):
        b.op("binary", [views[i % 2], views[(i - 1) % 2], v_c], ip=[P["BINARY_ADD"]], fp=[0.0])
    return b.finish(n_threads)


def independent_plan(n_threads, n_ops=N_OPS):
    """n_ops adds of c + c into disjoint slices of one buffer: nothing to wait for."""
    b = _C.PlanBuilder()
    c = b.constant(torch.ones(N_FLOATS), "c")
    v_c = b.view(c, F32, (N_FLOATS,))
    big = b.arena(n_ops * N_FLOATS * 4, "slices")
    for i in range(n_ops):
        v = b.view(big, F32, (N_FLOATS,), None, i * N_FLOATS * 4)
        b.op("binary", [v, v_c, v_c], ip=[P["BINARY_ADD"]], fp=[0.0])
    return b.finish(n_threads)


def nop_plan(n_threads, n_ops=N_OPS, barriers=False, n_inputs=0, output=False):
    b = _C.PlanBuilder()
    inputs = [b.input(f"x{i}", F32, (4, 64)) for i in range(n_inputs)]
    for _ in range(n_ops):
        b.op("nop", [])
    if output:
        out = b.output_buffer("out", F32, (4, 64))
        v = b.view(out, F32, (4, 64))
        b.op("binary", [v, b.view(inputs[0], F32, (4, 64)), None], ip=[P["BINARY_MUL"]], fp=[1.0])
        b.output(v)
    return b.finish(n_threads, barrier_every_step=barriers)


def time_call(fn, args, calls, repeats, best=None):
    """Median over repeats of the mean time of one call, in microseconds; the
    fastest repeat goes to best[0] (on a shared machine, the uncontended cost)."""
    for _ in range(max(calls // 4, 10)):
        fn(*args)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn(*args)
        samples.append((time.perf_counter_ns() - t0) / calls / 1e3)
    if best is not None:
        best.append(min(samples))
    return statistics.median(samples)


def measure(quick):
    repeats, calls = (5, 200) if quick else (15, 1000)
    threads = [1, 2]
    kinds = {
        "chain": lambda n: chain_plan(n),
        "independent": lambda n: independent_plan(n),
        "nop_barrier": lambda n: nop_plan(n, barriers=True),
        "nop": lambda n: nop_plan(n),
    }
    per_op = {kind: {} for kind in kinds}
    per_op_best = {kind: {} for kind in kinds}
    for n in threads:
        e_best = []
        empty = time_call(nop_plan(n, n_ops=0), (), calls, repeats, e_best)
        for kind, make in kinds.items():
            plan = make(n)
            assert plan.n_steps == N_OPS
            best = []
            t = time_call(plan, (), calls // 4, repeats, best)
            per_op[kind][str(n)] = max(t - empty, 0.0) / N_OPS
            per_op_best[kind][str(n)] = max(best[0] - e_best[0], 0.0) / N_OPS
    xs = [torch.randn(4, 64) for _ in range(10)]
    call_us, call_best, call_out_us = {}, {}, {}
    for n in threads:
        best = []
        call_us[str(n)] = time_call(nop_plan(n, n_ops=1, n_inputs=10), xs, calls * 10, repeats, best)
        call_best[str(n)] = best[0]
        call_out_us[str(n)] = time_call(nop_plan(n, n_ops=1, n_inputs=10, output=True), xs, calls * 10, repeats)
    return {
        "per_op_us": per_op["chain"],
        "per_op_by_kind_us": per_op,
        "per_op_best_by_kind_us": per_op_best,
        "python_call_us": call_us["1"],
        "python_call_by_threads_us": call_us,
        "python_call_best_by_threads_us": call_best,
        "python_call_with_output_us": call_out_us,
        "n_ops": N_OPS,
        "n_floats": N_FLOATS,
        "repeats": repeats,
        "quick": quick,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "isa": _C.cpu_isa(),
            "load_avg": os.getloadavg(),
            "torch": torch.__version__,
        },
    }


def table(r):
    rows = [
        "| measure | 1 thread | 2 threads | target |",
        "|---|---|---|---|",
    ]
    labels = {
        "chain": "per op, 2048-float add chain (dispatch + barrier + kernel)",
        "independent": "per op, 2048-float adds, no barriers (dispatch + kernel)",
        "nop_barrier": "per op, empty kernel + barrier",
        "nop": "per op, empty kernel (dispatch)",
    }
    for kind, label in labels.items():
        v, b = r["per_op_by_kind_us"][kind], r["per_op_best_by_kind_us"][kind]
        target = "≤ 0.5 µs at 2 threads" if kind in ("chain", "nop_barrier") else ""
        rows.append(f"| {label} | {v['1']:.3f} ({b['1']:.3f}) µs | {v['2']:.3f} ({b['2']:.3f}) µs | {target} |")
    c, cb, co = r["python_call_by_threads_us"], r["python_call_best_by_threads_us"], r["python_call_with_output_us"]
    rows.append(
        f"| Python call, 10 inputs, empty kernel | {c['1']:.2f} ({cb['1']:.2f}) µs | {c['2']:.2f} ({cb['2']:.2f}) µs "
        "| ≤ 5 µs |"
    )
    rows.append(f"| Python call, 10 inputs + 1 fresh output | {co['1']:.2f} µs | {co['2']:.2f} µs | |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args()
    r = measure(args.quick)
    with open(args.out, "w") as f:
        json.dump(r, f, indent=2)
    print("median (fastest repeat) over repeats\n")
    print(table(r))
    print(f"\nload average during the run: {r['machine']['load_avg']}")


if __name__ == "__main__":
    main()
