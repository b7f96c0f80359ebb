"""Candidates for one graph, timed once on the call's own inputs; the fastest is kept.

A candidate is built (compiled) first; one that fails to build or to run, or
whose outputs are not the truth's (eager's: the model as PyTorch defines it)
within a tolerance for the dtype, is left out with the reason. That includes
the reference, stock Inductor, when its outputs are not eager's (torch 2.13's
Inductor gives avg_pool2d with ceil_mode=True wrong gradients, pytorch#198119):
kwker then keeps the fastest of the others. The rest are timed in interleaved
rounds, so that a change of the machine's state (the other vCPU busy, the read
bandwidth moving) falls on all of them alike, and compared by their medians
(where a round of first runs alone is over the budget, it may be the only
round, or stand in for the second: see BUDGET_S).
The reference is kept unless another candidate's median is clearly below its
own: closer medians are within this machine's noise, and "never slower than
Inductor" matters more than a percent.
"""

import contextlib
import functools
import gc
import logging
import math
import os
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

log = logging.getLogger(__name__)

# Dynamo's own control flow, raised through a candidate's compile, never a candidate's failure: Inductor's
# compile of a graph given a float as an input that it cannot keep symbolic (`x ** self.p` after self.p
# changed) marks the float to be specialised and raises TensorifyScalarRestartAnalysis for Dynamo to trace
# the frame again. Taken for a failure, it left Inductor out of that graph (the warning said nothing more).
DYNAMO_RESTARTS = (torch._dynamo.exc.RestartAnalysis,)


def not_the_candidates(e: Exception) -> bool:
    """e is not a candidate's failure but passes through it: Dynamo's restart,
    or what a Python signal handler of the user's raised while the candidate
    compiled or ran (a timeout's alarm): that handler's frame is in e's traceback."""
    if isinstance(e, DYNAMO_RESTARTS):
        return True
    handlers = (signal.getsignal(s) for s in signal.valid_signals())
    codes = {getattr(getattr(h, "__func__", h), "__code__", None) for h in handlers}
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code not in codes:
        tb = tb.tb_next
    return tb is not None


def out_of_memory(e: Exception) -> bool:
    """e is an allocation's failure (PyTorch's CPU allocator raises a RuntimeError)."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)


# Another candidate replaces the reference when its median is below this share of the reference's.
MARGIN = 0.97
# Rounds of timing: at least MIN_ROUNDS; more, up to MAX_ROUNDS, while under BUDGET_S seconds.
# SEPARATED_ROUNDS are enough when the fastest candidate's slowest call beats every
# other's fastest: more rounds would not change the choice, and they cost compile
# time (BERT-base at batch 8: 0.43 s against 0.93 s a call, where a third round of
# every candidate cost 2.3 s; ResNet-50 at batch 1, frozen 46 ms against 71-97, 0.6 s
# of rounds up to the budget). When another round would end past the budget, the
# rounds so far are enough if no other candidate's fastest call was under MARGIN of
# the reference's median: the reference would be kept, and more rounds could only
# find a win these had not shown (DistilBERT at batch 8 on the Intel VM: 331, 336
# and 345 ms a call, where the second and third rounds cost 2.0 s of a 10.5 s compile);
# nor need they when one round's fastest call was CLEAR times under every other's:
# a second round would have to undo a gap wider than this machine's noise
# (DistilBERT fp32 with bf16-valued weights at batch 8: plan 140 ms against Inductor's
# 270 and eager's, where that round cost 0.7 s of a 7.7 s compile).
MIN_ROUNDS, SEPARATED_ROUNDS, MAX_ROUNDS, BUDGET_S, CLEAR = 3, 2, 15, 1.0, 1.5
# A candidate's time in a round is one sample: where its calls are shorter than WARM_S,
# one call to warm up, then as many as fill SAMPLE_S (up to SAMPLE_CALLS; one where a
# call is SAMPLE_S or more), their mean; else one call. (The warm-up is timed too: a
# call of WARM_S or more, from a candidate no faster so far, is the sample.) A call
# right after another candidate's pays for waking its threads (PyTorch's OpenMP
# threads, kwker's pool), which slept while the other ran, and for its memory out of
# cache; a user's loop calls the one kept back to back. A
# 256 -> 512 -> 512 -> 64 float32 MLP at batch 8 (2-vCPU Intel Xeon, seven tunings
# each, fresh caches): one call a round timed its plan at 0.13-0.27 ms, samples at
# 0.053-0.061; eager (0.09 ms a call in the user's own loop) at 0.83-2.39 ms,
# Inductor at 0.17-1.8. Samples timed those two right (0.093-0.104, 0.075-0.081)
# in three tunings of seven (Inductor in a fourth):
# in the others PyTorch's OpenMP thread shared a core with the calling thread all
# through the tuning, each of its barriers a context switch (the second core idle:
# this VM's scheduler packs its vCPUs), which samples do not undo. From SAMPLE_S
# on, a wake-up (tens of microseconds each for a few threads) is a share of a call
# under this machine's noise. The cost: four candidates of 0.1 ms a call that
# overlap, timed to MAX_ROUNDS, take 0.13 s in samples against 0.008 in single calls.
# Up to WARM_S, a wake-up's tenth of a millisecond could still be a share of a call
# near MARGIN's: one candidate timed cold at 2.0 ms warm and 2.1 cold was beaten by
# one 2 % faster timed warm, had the cold call been its sample from SAMPLE_S on.
SAMPLE_S, SAMPLE_CALLS, WARM_S = 0.002, 256, 0.02
# Where a round of the candidates' first (checking) runs alone took longer than the
# budget, it is the only round when it shows the choice against a steady call of
# the reference (its first run, else one more run of it alone): none under MARGIN
# of it keeps the reference; one CLEAR times under it and under every other's
# first run is kept. At that length a first run's one-off costs (fresh memory's
# page faults) are a few percent of a call, 0-13 % at batch 8 in float32 on the
# Intel VM (BERT-base, ViT-base, GPT-2 and DistilBERT, 0.29-0.92 s a call, whose
# candidates were within 3 %), where a timed round cost 0.8-2.6 s of 8-15 s
# compiles. A first run is no faster than its candidate, so what this can cost is
# a win of a few percent not taken, never a candidate slower than the reference
# kept. For the same reason they stand in for the second of the SEPARATED_ROUNDS
# there (GPT-2 at batch 8 in float32: plan 7 % under Inductor, apart after one
# timed round of 1.8 s).
# Where calls are that long, the first runs stand in for the third of the
# MIN_ROUNDS too: two timed rounds are the most that candidates that overlap get.
# A third would take the median of three calls instead of two for a round of
# every candidate (ViT-base at batch 8 in float32 on the Intel VM: 1.07-1.11 s a
# call, all three within 4 %, 3.3 s a round; one first compile took 23 s against
# Inductor's 10.7, where others took 14.4-14.9, as a third round and more would).
# There, too, a candidate other than the reference whose first run was not under
# MARGIN of the reference's steady call is not timed: its first run stands in for
# its calls, the evidence on which all rounds stop where every candidate's is so
# (GPT-2 at batch 8 in float32: eager's first run 0.85 s against Inductor's steady
# 0.60, where eager's timed call, 0.73 s, was 5 % of a 14.3 s first compile).
# A candidate other than the reference whose SEPARATED_ROUNDS calls (first runs
# counted where they stand in for a round) were each slower than each of another
# candidate's cannot be kept: it sits out later rounds, the same evidence as for
# stopping them all (GPT-2 at batch 8 in float32: eager at 0.69-0.74 s a call,
# the plan at 0.49-0.53 and Inductor within 3 % of it, so rounds go on).

# How far a candidate's floating outputs may be from the reference's, by dtype, as
# the relative L2 distance ‖out − ref‖ / ‖ref‖: the same computation summed in
# another order (measured: 2e-6 for ResNet-50 in float32, whose elements differ by
# up to 6e-4 between Inductor and eager), not another computation (a stale or
# wrong weight is off by a share of one). ‖ref‖ has a floor of ABS_FLOOR per element:
# a value that is zero in exact arithmetic is rounding noise in both (BERT's key
# biases' gradients, zero because softmax ignores what every key adds alike: 2e-10
# in eager and Inductor, 0.66 apart relatively).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
# A training run's, whose gradients sum over the batch and through batch norms in
# training mode: ResNet-18's, batch 8, float32, eager against Inductor, differ by up
# to 4e-3 (the first convolution's weight, the batch norms' biases).
TRAINING_TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 1e-1, torch.float16: 5e-2}
ABS_FLOOR = 1e-5  # torch.testing.assert_close's absolute tolerance for float32
# An output farther from the truth's than the tolerance still agrees where the
# value is zero in exact arithmetic, the truth's rounding noise (the truth's
# computation in float64 under a tenth of the truth's distance from it), and it is
# no more than EXACT_MARGIN times as far from the float64 one as the truth's
# (torch._dynamo.utils.same's fp64 reference, with its margin of 2 and room for
# the noise of two roundings): a linear's bias gradient before a BatchNorm1d in
# training mode, 7e-7 against its weight's 17, where Inductor was left out at
# 0.016. A value that is not zero (a cancellation that left the truth's all
# noise, whose sign a wrong candidate may flip) is held to the tolerance. Asked
# only where the tolerance is not met, not where an input written shares memory
# with another, and not past EXACT_BYTES of float64 copies of the inputs.
EXACT_MARGIN = 4.0
EXACT_BYTES = 512 << 20
# The machine was busy while the candidates ran when other processes took more than BUSY_CPUS of a CPU
# meanwhile, on average, from the CPUs this process's threads needed (of those it may run on, what was
# not spare: see _MachineLoad), and BUSY_MIN_CPU_S at least (/proc/stat counts in ticks of 10 ms). Another
# process on the second vCPU made kwker's plan 10-50x slower (its barrier waits became context switches)
# and Inductor was kept; such a choice is this process's, but is not remembered (kwker.choices) for the
# next. An idle VM's other processes used under 1 % of a CPU.
BUSY_CPUS, BUSY_MIN_CPU_S = 0.25, 0.05


def output_tolerance(gm: torch.fx.GraphModule, example_inputs, tolerance: dict) -> dict:
    """The tolerance for gm's outputs: an output computed from values of a
    lower precision is as far apart as one of that precision, whatever its own
    dtype. So for a floating input of a lower precision (a float32 norm
    weight times bf16 x̂: Inductor, which leaves x̂ unrounded, 1.5e-3 from
    eager), and where CPU autocast computes any part of the graph, around it
    or inside it (a small Llama's float32 logits of bf16 products: 1.8e-3,
    where float32's 1e-4 left a right Inductor out; a part where the graph
    turns autocast off again still counts: which outputs it feeds is not
    followed); and where PyTorch may compute float32 matmuls, convolutions
    or RNNs in a lower precision (`torch.set_float32_matmul_precision("medium")`:
    eager's float32 linears in bf16 on oneDNN, 2.4e-3 from float64 against
    2.9e-7, where float32's 1e-4 left Inductor, 3.6e-4 from eager, and kwker's
    plan, which computes in float32, out of a small Llama's prefill)."""
    lower = {x.dtype for x in example_inputs if isinstance(x, torch.Tensor) and x.is_floating_point()}
    lower |= {torch.get_autocast_dtype("cpu")} if torch.is_autocast_enabled("cpu") else set()
    lower |= float32_computed_as(gm)
    lower |= {n.args[1] or torch.get_autocast_dtype("cpu") for n in gm.graph.nodes  # None: autocast's default
              if n.target is torch.amp.autocast_mode._enter_autocast and n.args[0] == "cpu" and n.args[2]}
    widest = max((tolerance.get(dtype, 0.0) for dtype in lower), default=0.0)
    return {dtype: max(tol, widest) for dtype, tol in tolerance.items()}


# What oneDNN's float32 precision settings let PyTorch compute float32 in, where the CPU can: TF32 (float16's
# 10 bits) only with AMX-FP16; set_float32_matmul_precision("high") leaves float32 as it is elsewhere.
FP32_PRECISION_DTYPES = {"bf16": (torch.bfloat16, lambda: torch.cpu._is_avx512_bf16_supported()
                                  or torch.cpu._is_amx_tile_supported()),
                         "tf32": (torch.float16, lambda: torch.cpu._is_amx_fp16_supported())}
# The graph's ops each of oneDNN's settings is for (a Dynamo graph calls torch's functions and operators).
FP32_PRECISION_OPS = {"matmul": lambda name: name in {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm",
                                                       "einsum", "bilinear", "tensordot"},
                      "conv": lambda name: name.startswith("conv"),
                      "rnn": lambda name: name in {"lstm", "gru", "rnn_tanh", "rnn_relu"}}


def fp32_precision_settings() -> dict[str, str]:
    """The precision PyTorch may compute float32 matmuls, convolutions and RNNs
    in on the CPU: oneDNN's settings (torch.backends.mkldnn's fp32_precision,
    each op's, "none" for the one of all ops, "none" there for IEEE's), which
    set_float32_matmul_precision sets for matmuls. Read here, not by
    torch.get_float32_matmul_precision(), which raises once a program has set
    these."""
    mkldnn = torch.backends.mkldnn
    every = mkldnn.fp32_precision if mkldnn.fp32_precision != "none" else "ieee"
    return {op: getattr(mkldnn, op).fp32_precision.replace("none", every) for op in FP32_PRECISION_OPS}


def float32_computed_as(gm: torch.fx.GraphModule) -> set[torch.dtype]:
    """The dtypes PyTorch may compute gm's float32 matmuls, convolutions and RNNs in on this CPU."""
    names = {getattr(n.target, "__name__", str(n.target)).lower() for n in gm.graph.nodes
             if n.op in ("call_function", "call_method")}
    found = set()
    for op, setting in fp32_precision_settings().items():
        dtype, supported = FP32_PRECISION_DTYPES.get(setting, (None, None))
        if dtype is not None and supported() and any(map(FP32_PRECISION_OPS[op], names)):
            found.add(dtype)
    return found


@dataclass
class Choice:
    name: str
    fn: Callable
    ms: dict[str, float] = field(default_factory=dict)  # median per candidate timed
    left_out: dict[str, str] = field(default_factory=dict)  # candidate -> why it was not timed
    # The name of the candidate that would be kept without the one kept (None when the reference is
    # kept, or no other was timed): what a kept candidate that gives up later runs
    # instead (kwker.freeze).
    fallback: str | None = None
    built: dict[str, Callable] = field(default_factory=dict)  # each candidate whose outputs agreed
    # What the kept candidate returned for the inputs timed (None where the graph
    # writes its inputs: a call must write them again): see FirstCallServed.
    outputs: object = None
    errors: dict[str, Exception] = field(default_factory=dict)  # candidate -> what it raised, left out so
    busy: str | None = None  # how busy other processes kept the machine while the candidates ran, if they did


class FirstCallServed:
    """A kept candidate whose first call, given the very tensors the tuning
    ran it on, unchanged since (the same objects, data pointers and version
    counts), returns what the tuning's run of it returned instead of running
    it again: Dynamo makes that call right after the compile, with those
    tensors, and a run of a large graph is a share of the compile (GPT-2 at
    batch 8 in float32: 0.64 s of the 5.3 s tuning adds). Any other first
    call, and every later call, runs the candidate. An inference tensor has
    no version count to show it unchanged: with one among the inputs, the
    first call runs too; so does one under inference mode, whose outputs are
    inference tensors (Dynamo compiles, and the tuning ran, outside it)."""

    def __init__(self, fn: Callable, inputs: list, outputs):
        self.fn = fn
        self.checked_args = getattr(fn, "checked_args", frozenset())  # for kwker.guards, as fn's
        self._first = None if any(map(_is_inference, inputs)) else (outputs, [(x, _state(x)) for x in inputs])

    def __call__(self, *args):
        if self._first is not None:
            (outputs, inputs), self._first = self._first, None
            if not torch.is_inference_mode_enabled() and len(args) == len(inputs) and \
                    all(a is x and _state(a) == state for a, (x, state) in zip(args, inputs)):
                log.debug("first call: the tuning's outputs for these inputs, unchanged since")
                return outputs
        return self.fn(*args)


def _is_inference(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_inference()


def _state(x) -> tuple | None:
    """What changes when a tensor is written or reseated (None for another input)."""
    return (x.data_ptr(), x._version) if isinstance(x, torch.Tensor) else None


def call(fn: Callable, inputs: list):
    """An inference graph's run: what it returns."""
    return fn(*inputs)


def quiet(fn: Callable) -> Callable:
    """fn, or a GraphModule's forward: its __call__ prints the failing line of
    its code to stderr before it raises, and a candidate's failure is the
    tuning's to report. For the runs that may fail: the first and the float64
    one, and every call of a graph whose eager run failed on the first call's
    inputs (a user's error, raised at the call as eager raises it: see
    dynamo_backend.raised_run_eagerly); the timed runs go through __call__, as
    Dynamo's calls of a kept GraphModule do."""
    if not isinstance(fn, torch.fx.GraphModule):
        return fn
    _LazyGraphModule.force_recompile(fn)  # a lazy one's forward calls __call__ until its code is made
    return fn.forward


class ForwardAndBackward:
    """A training graph's run, `run(fn, inputs)`: its outputs, then the
    gradients of the sum of the outputs that require grad, each element
    weighted by a random sign, with respect to each input that requires grad,
    through torch.autograd.grad (no .grad field is written). Signs, not the
    plain sum, whose gradient through an output of constant sum (a batch norm's
    in training mode, a softmax) is zero: every gradient before it was rounding
    noise, and no candidate's backward of it was checked. One object serves one
    tuning: each output's signs are drawn once, as int8 (drawn at every run they
    cost several times a ones_like: 282 ms for 20M elements), the same in every
    run, the float64 one too. The inputs are those that require grad before the
    run: one it writes a value requiring grad into requires it after. Each is
    detached first, a leaf of this run's own: where one input comes from another
    through the autograd history of an earlier graph (a tied weight and the
    hidden state computed from it, across a graph break), the backward would
    run through that graph and free what it saved for the user's own backward."""

    def __init__(self):
        self.signs: dict[tuple, torch.Tensor] = {}

    def __call__(self, fn: Callable, inputs: list) -> list:
        inputs = [x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.requires_grad else x
                  for x in inputs]
        leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        outputs = _flat_tensors(fn(*inputs))
        roots = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
        weights = [self._signs(i, t.shape).to(t.dtype) for i, t in enumerate(roots)]
        grads = torch.autograd.grad(roots, leaves, weights, allow_unused=True) if roots and leaves else ()
        return [t.detach() if isinstance(t, torch.Tensor) else t for t in outputs] + list(grads)

    def _signs(self, i: int, shape) -> torch.Tensor:
        key = (i, tuple(shape))
        if key not in self.signs:
            drawn = torch.randint(0, 2, key[1], generator=torch.Generator().manual_seed(i), dtype=torch.int8)
            self.signs[key] = drawn.mul_(2).sub_(1)
        return self.signs[key]


# A gate: given the median ms of the candidates built before its own, why its
# candidate is not worth building, or None.
Gate = Callable[[dict[str, float]], str | None]


def choose(builders: dict[str, Callable[[], Callable]], inputs: list, reference: str, truth: str | None = None,
           run: Callable[[Callable, list], list] = call, written: list | tuple = (),
           tolerance: dict = TOLERANCE, gates: dict[str, Gate] | None = None) -> Choice:
    """builders: name -> a function that compiles that candidate and returns
    what to call. A candidate that fails to build or run is left out, logged;
    the reference's failure propagates where there is no truth. truth: the
    candidate whose outputs the others must give (the reference when None,
    or where the truth's run failed for want of memory: Inductor's fused
    kernels may need far less than eager's intermediates), built and run
    first: where it fails otherwise, TruthFailed, and no other candidate runs
    on these inputs (a user's error, which another candidate may not raise:
    stock Inductor's bounds check of a token id past the vocabulary throws
    inside an OpenMP parallel region, and the process aborts).
    run: one timed run of a candidate (`call`, or a `ForwardAndBackward` with
    TRAINING_TOLERANCE as the tolerance).
    written: the inputs the graph writes in place, put back as they were after
    every run, so that each candidate, and the call that follows the tuning,
    sees them unchanged. (Dynamo puts the random number generator back after a
    backend's compile: the runs here draw nothing the user's call would.)
    gates: name -> a Gate, asked before that candidate is built (a compile
    that cannot win is not paid for). It is given steady times: each candidate
    built so far whose outputs agree with the truth's is run once more, as the
    first round of timing (a first run pays one-off costs: Inductor's has
    measured 20-80x its later calls on small graphs)."""
    # Each with whether it had autograd history: a training graph's write of a value that requires
    # grad (a cache written from a parameter's product) gives the input history, which a put-back
    # value must not keep (the next run's backward would go through the freed graph); tune_training
    # keeps views, which cannot shed it in place, and inputs requiring grad out of timing.
    saved = [(x, x.detach().clone(), x.requires_grad) for x in written]
    # Dynamo compiles with inference mode off, and an inference tensor (the call's own, under
    # torch.inference_mode) may only be written inside it: so are the runs and put-backs that write one
    # (the candidates are built outside it: a plan's weight copies, made there, are written later).
    writing = torch.inference_mode if any(x.is_inference() for x in written) else contextlib.nullcontext

    def put_back():
        with torch.no_grad(), writing():
            for x, before, had_history in saved:
                x.copy_(before)
                if x.requires_grad and not had_history:
                    x.detach_()

    def run_and_restore(fn):
        try:  # put back after a run that fails too: it may have written them before it raised
            with writing():
                out = run(fn, inputs)
            return [t.clone() if isinstance(t, torch.Tensor) else t for t in _flat_tensors(out)] if saved else out
        finally:
            put_back()

    built, outputs, left_out, times, first, errors = {}, {}, {}, {}, {}, {}
    load = _MachineLoad()

    @functools.cache
    def exact(of: str) -> list | None:
        if _aliased(written, inputs):
            return None
        try:  # its float64 copies are written, not the inputs, but for those of other dtypes (a count)
            return _in_float64(run, built[of], inputs)
        finally:
            put_back()

    def timed_run(fn):
        try:
            return run_and_restore(fn)
        except Exception as e:
            raise _LaterRunFailed(next(n for n, f in built.items() if f is fn), e) from e

    def sample(name: str, call_s: float | None = None) -> float:
        """One sample of the candidate's call, seconds (see SAMPLE_S): a call,
        which is the sample where neither it nor call_s (the candidate's fastest
        call so far; its first run where it has no other) is under WARM_S, else
        the warm-up before the calls that fill SAMPLE_S at the faster of the two
        (fewer where they are slower: the sample ends once SAMPLE_S has passed)."""
        fn = built[name]
        start = time.perf_counter()
        timed_run(fn)
        once = time.perf_counter() - start
        call_s = min(once, min(times.get(name) or [first[name]]) if call_s is None else call_s)
        if call_s >= WARM_S:
            return once
        calls = min(SAMPLE_CALLS, math.ceil(SAMPLE_S / call_s) if call_s > 0 else SAMPLE_CALLS)
        start, made = time.perf_counter(), 0
        while made < calls and (made == 0 or time.perf_counter() - start < SAMPLE_S):  # calls slower than call_s
            timed_run(fn)
            made += 1
        return (time.perf_counter() - start) / made

    def measured(measure):
        """measure(), again without each candidate whose later run fails: it is
        left out as one whose first run fails (a reference so, for the truth)."""
        nonlocal reference
        while True:
            try:
                with load.timing():
                    return measure()
            except _LaterRunFailed as failed:
                if not_the_candidates(failed.error):
                    raise failed.error from None
                left_out[failed.name] = f"{type(failed.error).__name__}: {failed.error} (a later run)"
                errors[failed.name] = failed.error
                log.warning("candidate %s left out: %s", failed.name, left_out[failed.name])
                for found in (built, outputs, times, first):
                    found.pop(failed.name, None)
                if not built:
                    raise failed.error from None
                if failed.name == reference:
                    reference = truth if truth in built else next(iter(built))

    for name in sorted(builders, key=lambda name: name != truth):  # the truth first, the others in order
        build, gate = builders[name], (gates or {}).get(name)
        if gate is not None:
            steady = measured(lambda: _gate_ms(built, outputs, times, truth or reference, tolerance, sample, exact))
            why = gate(steady)
            if why:
                left_out[name] = why
                continue
        start = ran = time.perf_counter()
        try:
            fn = build()
            with load.timing():
                ran = time.perf_counter()
                outputs[name] = run_and_restore(quiet(fn))
                first[name] = time.perf_counter() - ran
            built[name] = fn
        except Exception as e:
            if (name == reference and truth is None) or not_the_candidates(e):
                raise
            if name == truth and not out_of_memory(e):
                raise TruthFailed(e) from e
            left_out[name], errors[name] = f"{type(e).__name__}: {e}", e
        log.info("candidate %s built in %.2f s, run once in %.3f s", name, ran - start, time.perf_counter() - ran)
    if truth in errors and reference in errors:
        raise TruthFailed(errors[truth]) from errors[truth]
    truth = truth if truth in built else reference
    for name in list(built):
        why = _differs(outputs[name], outputs[truth], tolerance, truth, functools.partial(exact, truth)) \
            if name != truth else None
        if why:
            left_out[name] = why
            del built[name]
    for name, why in left_out.items():
        (log.warning if name == reference else log.info)("candidate %s left out: %s", name, why)
    if reference not in built:  # the truth then stands in for it: the time the others must beat
        reference = truth
    ms = measured(lambda: _first_runs_ms(first, times, built, reference, sample))
    how = "first runs" if ms else "medians"
    if ms is None:
        ms = measured(lambda: _median_ms(built, sample, {name: t for name, t in times.items() if name in built},
                                         reference, first))
    best = _fastest(ms, reference)
    log.info("candidates (%s) %s: %s kept", how, ", ".join(f"{n} {t:.3f} ms" for n, t in ms.items()), best)
    rest = {n: t for n, t in ms.items() if n != best}
    fallback = _fastest(rest, reference) if best != reference and rest else None
    return Choice(best, built[best], ms, left_out, fallback, built, None if saved else outputs[best], errors,
                  load.busy())


class TruthFailed(Exception):
    """The truth's first run failed (and the reference's, where the truth ran
    out of memory): the graph does not run on these inputs, a user's error
    that eager raises. `error` is the truth's."""

    def __init__(self, error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


class _LaterRunFailed(Exception):
    """A candidate's run after its first (a gate's or a timing round's) raised."""

    def __init__(self, name: str, error: Exception):
        super().__init__(name, error)
        self.name, self.error = name, error


@contextlib.contextmanager
def _collector_paused():
    """Python's garbage collector off while candidates are timed, as timeit turns
    it off: a full collection during a compile took 0.18-0.35 s (GPT-2 at batch
    8), and would fall in whichever timed call made the object that set it off.
    It runs after, outside the timing."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _MachineLoad:
    """The seconds the candidates ran, and the CPU seconds every CPU was busy
    meanwhile, less this process's threads': other processes' use of the CPUs
    it may run on. On a machine with more CPUs than this process's threads,
    others may keep the rest busy: only what they took of the CPUs its threads
    needed counts. Which CPUs those are is read at the end: OpenMP's threads,
    which OMP_PROC_BIND pins to other CPUs than the main thread's, may start in
    the first run."""

    def __init__(self):
        self.seconds, self.own_cpu_s, self.windows = 0.0, 0.0, 0
        self.cpu_s: dict[int, float] = {}  # busy seconds per CPU (NaN: no /proc/stat)

    @contextlib.contextmanager
    def timing(self):
        with _collector_paused():
            start, cpus, own = time.perf_counter(), _busy_cpu_s(), _own_cpu_s()
            try:
                yield
            finally:
                self.seconds += time.perf_counter() - start
                self.own_cpu_s += _own_cpu_s() - own
                self.windows += 1
                for cpu, busy in _busy_cpu_s().items():
                    self.cpu_s[cpu] = self.cpu_s.get(cpu, 0.0) + busy - cpus.get(cpu, math.nan)

    def busy(self) -> str | None:
        """How busy, where other processes left this process's threads less than
        1 - BUSY_CPUS of the free CPUs they needed, and more than the counters'
        rounding could give (each counter's difference may be a tick short or
        over, in each window); never without /proc/stat."""
        cpus = _process_cpus()
        threads = min(torch.get_num_threads(), len(cpus))
        others = sum(self.cpu_s.get(cpu, math.nan) for cpu in cpus) - self.own_cpu_s
        rounding = (len(cpus) + 1) * self.windows / os.sysconf("SC_CLK_TCK")
        spare = len(cpus) - threads
        if not others > max(BUSY_MIN_CPU_S, rounding, (spare + BUSY_CPUS) * self.seconds):
            return None
        return (f"other processes used {others / self.seconds:.0%} of a CPU (of the {len(cpus)} this process runs on, "
                f"with {threads} thread{'s' * (threads > 1)}) while the candidates ran")


def _busy_cpu_s() -> dict[int, float]:
    """CPU seconds every process has spent busy on each CPU (not idle, waiting
    on a disk or taken by the host: steal); empty without /proc/stat."""
    ticks = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit():
                    user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[:7])
                    ticks[int(name[3:])] = user + nice + system + irq + softirq
    except (OSError, ValueError):
        return {}
    tick_s = 1 / os.sysconf("SC_CLK_TCK")
    return {cpu: n * tick_s for cpu, n in ticks.items()}


def _process_cpus() -> list[int]:
    """The CPUs any of this process's threads may run on: OMP_PROC_BIND=true pins
    the main thread to one CPU and OpenMP's to the others."""
    cpus = set(os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                cpus |= os.sched_getaffinity(int(tid))
    return sorted(cpus)


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _fastest(ms: dict[str, float], reference: str) -> str:
    best = min(ms, key=ms.get)
    return best if reference not in ms or ms[best] < MARGIN * ms[reference] else reference


def _gate_ms(built: dict, outputs: dict, times: dict[str, list[float]], truth: str, tolerance: dict,
             sample: Callable[[str], float], exact: Callable[[str], list | None]) -> dict[str, float]:
    """The median ms so far of each candidate built whose outputs agree with the
    truth's (none while the truth is not built: a fast wrong candidate must not
    keep another out), each sampled once if it has no time yet (the time goes
    into `times`, the first round's)."""
    if truth not in outputs:
        return {}
    truth_exact = functools.partial(exact, truth)
    agree = [n for n in built if not _differs(outputs[n], outputs[truth], tolerance, truth, truth_exact)]
    for name in agree:
        if name not in times:
            times[name] = [sample(name)]
    return {name: statistics.median(times[name]) * 1e3 for name in agree}


def _first_runs_ms(first: dict[str, float], times: dict[str, list[float]], built: dict, reference: str,
                   sample: Callable[[str], float]) -> dict[str, float] | None:
    """The first runs (s), or a gate's steady run where there was one, as the
    only round (ms) when that round took longer than the budget and shows the
    choice against the reference's first run, or its second, then timed into
    `times` (see BUDGET_S); else None."""
    round_ = {name: times[name][:1] if times.get(name) else [first[name]] for name in built}
    if sum(t[0] for t in round_.values()) <= BUDGET_S:
        return None
    if not _unbeaten(round_, reference) and not times.get(reference):
        times[reference] = round_[reference] = [sample(reference)]
    if not (_unbeaten(round_, reference) or _separated(round_, CLEAR)):
        return None
    return {name: t[0] * 1e3 for name, t in round_.items()}


def _median_ms(built: dict[str, Callable], sample: Callable[[str, float], float],
               times: dict[str, list[float]], reference: str, first: dict[str, float]) -> dict[str, float]:
    """Interleaved rounds of samples over `built`, after the times (s a call) some have already.
    Where the first runs took longer than the budget, they stand in for the
    second of the SEPARATED_ROUNDS: a first run is no faster than its candidate,
    so with them the fastest's slowest call can only be later; and for the
    third of the MIN_ROUNDS, so that two timed rounds are the most that
    overlapping candidates get there (the medians are the timed calls'); and
    for every call of a candidate whose first run was not under MARGIN of the
    reference's steady call. A candidate those calls show slower than another
    (_outrun) sits out the later rounds; one with a call already made in a
    round's place (a gate's steady run, the reference's second run) is not run
    in that round."""
    times = {name: list(times.get(name, [])) for name in built}
    long_calls = sum(first[name] for name in built) > BUDGET_S
    timed = dict(built)
    if long_calls and times[reference]:
        bar = MARGIN * statistics.median(times[reference])
        for name in [n for n in built if n != reference and not times[n] and first[n] >= bar]:
            times[name] = [first[name]]  # its first run stands in for its calls (see BUDGET_S)
            del timed[name]
    start = time.perf_counter()
    for round_ in range(MAX_ROUNDS):
        calls = {n: t + [first[n]] for n, t in times.items()} if long_calls else times
        if round_ >= SEPARATED_ROUNDS and _separated(times) or long_calls and round_ >= 1 and _separated(calls):
            break
        spent = time.perf_counter() - start
        if round_ >= MIN_ROUNDS - long_calls and spent > BUDGET_S:
            break
        if round_ >= 1 and spent * (round_ + 1) / round_ > BUDGET_S and \
                (_unbeaten(times, reference) or _separated(times, CLEAR)):
            break  # another round would end past the budget, and could not change the choice
        for name in _outrun(calls, reference):
            timed.pop(name, None)
        for name in timed:
            if len(times[name]) > round_:
                continue
            times[name].append(sample(name, min(times[name] or [first[name]])))
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _outrun(calls: dict[str, list[float]], reference: str) -> set[str]:
    """The candidates other than the reference whose every call, of SEPARATED_ROUNDS
    at least, was slower than every call of another's: timed no more."""
    enough = {name: t for name, t in calls.items() if len(t) >= SEPARATED_ROUNDS}
    return {name for name, t in enough.items()
            if name != reference and any(min(t) > max(u) for other, u in enough.items() if other != name)}


def _unbeaten(times: dict[str, list[float]], reference: str) -> bool:
    """Every candidate timed, and no other's fastest call under MARGIN of the reference's median."""
    if reference not in times or not all(times.values()):
        return False
    bar = MARGIN * statistics.median(times[reference])
    return all(min(t) >= bar for name, t in times.items() if name != reference)


def _separated(times: dict[str, list[float]], factor: float = 1.0) -> bool:
    """The fastest candidate's slowest call, times factor, under every other's fastest."""
    fastest = min(times, key=lambda name: statistics.median(times[name]))
    return all(factor * max(times[fastest]) < min(t) for name, t in times.items() if name != fastest)


def _flat_tensors(out) -> list:
    if isinstance(out, (list, tuple)):
        return [t for x in out for t in _flat_tensors(x)]
    return [out]


def _as_real(x: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the float pairs it holds (a conjugate view's resolved)."""
    return torch.view_as_real(x.resolve_conj())


def _widened(x: torch.Tensor) -> torch.dtype | None:
    """The dtype of x's copy in float64's run: float64 (complex128 for a complex
    x); None for a tensor that stays as it is (integers, bools)."""
    return torch.complex128 if x.is_complex() else torch.float64 if x.is_floating_point() else None


def _in_float64(run: Callable[[Callable, list], list], fn: Callable, inputs: list) -> list | None:
    """What run gives for fn on float64 copies of the floating (and complex)
    inputs, flat (None where that run fails: an op without float64; or where
    the copies would take more than EXACT_BYTES)."""
    widened = [isinstance(x, torch.Tensor) and _widened(x) for x in inputs]
    if sum(x.numel() * dtype.itemsize for x, dtype in zip(inputs, widened) if dtype) > EXACT_BYTES:
        log.info("the truth's run in float64 not made: its copies would take over %d MiB", EXACT_BYTES >> 20)
        return None
    wide = [x.detach().to(dtype, copy=True).requires_grad_(x.requires_grad) if dtype else x
            for x, dtype in zip(inputs, widened)]
    try:  # it may fail (a float32 buffer the graph writes: a static cache), quietly (see quiet)
        with _collector_paused():
            return _flat_tensors(run(quiet(fn), wide))
    except Exception as e:  # noqa: BLE001 - no second opinion then: the tolerance alone decides
        log.info("the truth's run in float64 failed (%s: %s)", type(e).__name__, e)
        return None


def _aliased(written: list | tuple, inputs: list) -> bool:
    """Whether an input written shares its memory with another input, which
    copies in float64 would not."""
    storages = [x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)]
    return any(storages.count(x.untyped_storage().data_ptr()) > 1 for x in written)


def _differs(out, ref, tolerance: dict = TOLERANCE, ref_name: str = "the reference",
             exact: Callable[[], list | None] | None = None) -> str | None:
    """Why out is not ref (None: it is), output by output. exact: ref's
    computation in float64 (EXACT_MARGIN), asked for where an output is
    farther from ref's than the tolerance."""
    out, ref = _flat_tensors(out), _flat_tensors(ref)
    if len(out) != len(ref):
        return f"{len(out)} outputs, {ref_name} has {len(ref)}"
    for i, (a, b) in enumerate(zip(out, ref)):
        if not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {i} is {a!r}, {ref_name}'s {b!r}"
            continue
        if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i} is not a tensor like {ref_name}'s ({b.dtype}, {tuple(b.shape)})"
        if a.layout != b.layout:
            return f"output {i} is {a.layout}, {ref_name}'s {b.layout}"
        if b.is_sparse:  # an embedding's sparse gradient: compared by value
            a, b = a.to_dense(), b.to_dense()
        if b.is_complex():  # as their real and imaginary parts, at their float dtype's tolerance; NaN by element
            if not torch.equal(a.isnan(), b.isnan()):
                return f"output {i} has NaN where {ref_name}'s has not, or the other way"
            a, b = (_as_real(t.masked_fill(t.isnan(), 0)) for t in (a, b))
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return f"output {i} differs from {ref_name}'s"
            continue
        a64, b64 = a.double(), b.double()
        finite = b64.isfinite()
        infinite = b64.isinf()
        if not torch.equal(a64.isnan(), b64.isnan()) or not torch.equal(a64[infinite], b64[infinite]) \
                or not a64[finite].isfinite().all():
            return f"output {i} has NaN or infinities where {ref_name}'s has not, or the other way"
        scale = float(b64[finite].norm()) + ABS_FLOOR * math.sqrt(int(finite.sum()))
        distance = float((a64[finite] - b64[finite]).norm()) / max(scale, 1e-30)
        if distance > tolerance.get(b.dtype, 1e-6) and not _as_near_exact(a64, b64, finite, i, exact):
            return f"output {i} differs from {ref_name}'s by {distance:.3g} (relative L2)"
    return None


def _as_near_exact(a64: torch.Tensor, b64: torch.Tensor, finite: torch.Tensor, i: int,
                   exact: Callable[[], list | None] | None) -> bool:
    """Whether the float64 computation's output i is zero up to b64's noise
    and a64 within EXACT_MARGIN of b64's distance from it, where b64 is finite."""
    wide = exact() if exact is not None else None
    w = wide[i] if wide is not None and i < len(wide) else None
    w = _as_real(w) if isinstance(w, torch.Tensor) and w.is_complex() else w
    if not isinstance(w, torch.Tensor) or w.shape != b64.shape or not w.is_floating_point():
        return False
    w = w.detach().double()[finite]
    if not w.isfinite().all():
        return False
    near, truths = float((a64[finite] - w).norm()), float((b64[finite] - w).norm())
    if 10 * float(w.norm()) > truths or near > EXACT_MARGIN * truths:  # not zero in exact arithmetic, or far
        return False
    log.info("output %d: %.3g from its float64 computation, the truth's %.3g: they agree", i, near, truths)
    return True
