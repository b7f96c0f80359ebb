"""Candidates for one graph, timed once on the call's own inputs; the fastest is kept.

A candidate is built (compiled) first; one that fails to build or to run, or
whose outputs are not the reference's within a tolerance for the dtype, is left
out with the reason. The rest are timed in interleaved rounds, so that a change
of the machine's state (the other vCPU busy, the read bandwidth moving) falls on
all of them alike, and compared by their medians. The reference (stock
Inductor) is kept unless another candidate's median is clearly below its own:
closer medians are within this machine's noise, and "never slower than
Inductor" matters more than a percent.
"""

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

# Another candidate replaces the reference when its median is below this share of the reference's.
MARGIN = 0.97
# Rounds of timing: at least MIN_ROUNDS; more, up to MAX_ROUNDS, while under BUDGET_S seconds.
MIN_ROUNDS, MAX_ROUNDS, BUDGET_S = 3, 15, 1.0

# How far a candidate's floating outputs may be from the reference's, by dtype, as
# the relative L2 distance ‖out − ref‖ / ‖ref‖: the same computation summed in
# another order (measured: 2e-6 for ResNet-50 in float32, whose elements differ by
# up to 6e-4 between Inductor and eager), not another computation (a stale or
# wrong weight is off by a share of one).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@dataclass
class Choice:
    name: str
    fn: Callable
    ms: dict[str, float] = field(default_factory=dict)  # median per candidate timed
    left_out: dict[str, str] = field(default_factory=dict)  # candidate -> why it was not timed
    # The candidate that would be kept without the one kept (None when the reference is
    # kept): what a kept candidate that gives up later runs instead (kwker.freeze).
    fallback: Callable | None = None


def choose(builders: dict[str, Callable[[], Callable]], inputs: list, reference: str) -> Choice:
    """builders: name -> a function that compiles that candidate and returns
    what to call. The reference's failures propagate; the others' are logged."""
    built, outputs, left_out = {}, {}, {}
    for name, build in builders.items():
        start = time.perf_counter()
        try:
            fn = build()
            outputs[name] = _flat_tensors(fn(*inputs))
            built[name] = fn
        except Exception as e:
            if name == reference:
                raise
            left_out[name] = f"{type(e).__name__}: {e}"
        log.info("candidate %s built and run once in %.2f s", name, time.perf_counter() - start)
    for name in list(built):
        why = _differs(outputs[name], outputs[reference])
        if name != reference and why:
            left_out[name] = why
            del built[name]
    for name, why in left_out.items():
        log.info("candidate %s left out: %s", name, why)
    ms = _median_ms(built, inputs)
    best = _fastest(ms, reference)
    log.info("candidates %s: %s kept", ", ".join(f"{n} {t:.3f} ms" for n, t in ms.items()), best)
    fallback = None if best == reference else built[_fastest({n: t for n, t in ms.items() if n != best}, reference)]
    return Choice(best, built[best], ms, left_out, fallback)


def _fastest(ms: dict[str, float], reference: str) -> str:
    best = min(ms, key=ms.get)
    return best if ms[best] < MARGIN * ms[reference] else reference


def _median_ms(built: dict[str, Callable], inputs: list) -> dict[str, float]:
    times = {name: [] for name in built}
    start = time.perf_counter()
    for round_ in range(MAX_ROUNDS):
        if round_ >= MIN_ROUNDS and time.perf_counter() - start > BUDGET_S:
            break
        for name, fn in built.items():
            t = time.perf_counter()
            fn(*inputs)
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _flat_tensors(out) -> list:
    if isinstance(out, (list, tuple)):
        return [t for x in out for t in _flat_tensors(x)]
    return [out]


def _differs(out: list, ref: list) -> str | None:
    if len(out) != len(ref):
        return f"{len(out)} outputs, the reference has {len(ref)}"
    for i, (a, b) in enumerate(zip(out, ref)):
        if not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {i} is {a!r}, the reference's {b!r}"
            continue
        if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i} is not a tensor like the reference's ({b.dtype}, {tuple(b.shape)})"
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return f"output {i} differs from the reference's"
            continue
        a64, b64 = a.double(), b.double()
        finite = b64.isfinite()
        infinite = b64.isinf()
        if not torch.equal(a64.isnan(), b64.isnan()) or not torch.equal(a64[infinite], b64[infinite]) \
                or not a64[finite].isfinite().all():
            return f"output {i} has NaN or infinities where the reference's has not, or the other way"
        distance = float((a64[finite] - b64[finite]).norm() / b64[finite].norm().clamp_min(1e-30))
        if distance > TOLERANCE.get(b.dtype, 1e-6):
            return f"output {i} differs from the reference's by {distance:.3g} (relative L2)"
    return None
