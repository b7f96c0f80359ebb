"""The ``kwker`` backend for torch.compile, found by torch through the
``torch_dynamo_backends`` entry point."""

import functools
import logging
import time

import torch

from kwker import choices, guards, summary
from kwker.bounds import IndicesChecked, index_inputs
from kwker.aten_graph import trace_to_aten
from kwker.decode import compile_decode_step
from kwker.freeze import FrozenGraph, cannot_win, worth_freezing
from kwker.lower import NotLowerable, first_over_storage
from kwker.options import KwkerOptions, parse_options
from kwker.plan import compile_plan, inputs_written, reserve_weights
from kwker.rewrite import rewrite_language_model
from kwker.rewrite.match import why_run_only_as_called
from kwker.routing import route_graph, size_inputs, unfit_for_kernels
from kwker.threads import ForkSafeLock, warn_once_if_openmp_spins
from kwker.tune import (TOLERANCE, TRAINING_TOLERANCE, FirstCallServed, ForwardAndBackward, TruthFailed, choose,
                        not_the_candidates, output_tolerance, quiet)

log = logging.getLogger(__name__)


def kwker_backend(gm: torch.fx.GraphModule, example_inputs, *, mode=None, options=None):
    """torch passes ``mode`` only when it is not "default" and ``options`` only when
    non-empty; both are validated here (torch does not)."""
    opts = parse_options(mode, options)
    start = time.perf_counter()
    grad_enabled = torch.is_grad_enabled()
    route = route_graph(gm, example_inputs, grad_enabled)
    kind, compiled, detail = compile_routed(route.path, gm, example_inputs, opts)
    guards.note_graph(gm, compiled, grad_enabled)
    seconds = time.perf_counter() - start
    entry = summary.record(kind=kind, nodes=len(gm.graph.nodes), seconds=seconds, reason=route.reason, **detail)
    log.info("graph %d (%d nodes): %s in %.2f s — %s", entry.index, entry.nodes, kind, seconds, entry.why)
    return compiled


def compile_routed(path: str, gm, example_inputs, opts: KwkerOptions):
    """A decode step is replayed; another CPU inference graph is tuned (the
    fastest of Inductor, eager, kwker's plan and frozen Inductor), or its
    rewritten ATen graph is run eagerly (inner="eager") or compiled by Inductor
    (inner="inductor"); a training graph is tuned (Inductor or eager, forward
    and backward timed), or run eagerly (inner="eager"); a graph of dynamic
    shapes is compiled by Inductor and checked against eager at its first call
    (TunedAtALaterCall), or a training one run eagerly (inner="eager"); a graph
    routed to eager (forward-mode AD) runs eagerly; everything else goes to
    Inductor unchanged."""
    detail = {}
    if path == "eager":
        return "eager", gm, detail
    if path == "decode" and opts.inner != "inductor":
        try:
            plan, detail = compile_decode_step(gm, example_inputs, glue=opts.glue)
            warn_once_if_openmp_spins()
            return "decode-replay", plan, dict(detail, plan=plan)
        except Exception as e:  # anything but NotLowerable is a bug of kwker's: logged, never a failed compile
            if not isinstance(e, NotLowerable):
                log.warning("kwker: a decode step it failed to compile goes elsewhere (%s: %s)", type(e).__name__, e,
                            exc_info=True)
            detail["why"] = f"decode step not replayable: {e}"
            # tuned as other inference graphs (of dynamic shapes where Dynamo made sizes inputs)
            path = "inference-dynamic" if size_inputs(example_inputs) else "cpu-inference"
    if path == "cpu-inference" and opts.inner is None:
        return tune_inference(gm, example_inputs, opts)
    if path == "training" and opts.inner is None:
        return tune_training(gm, example_inputs, opts)
    if path in ("inference-dynamic", "training-dynamic") and opts.inner is None:
        try:
            inductor = compile_with_inductor(gm, example_inputs, opts)
        except Exception as e:  # noqa: BLE001 - eager, as the first size's tuning leaves a failed Inductor out
            if not_the_candidates(e):
                raise
            why = f"{detail.get('why') or 'dynamic shapes'}; Inductor's compile failed ({type(e).__name__}: {e}): " \
                  "run eagerly"
            log.warning("kwker: %s", why)
            return "eager", gm, {"why": why}
        checked = "Inductor's graph for every size, checked against eager at its first call"
        detail["why"] = f"{detail.get('why') or 'dynamic shapes (kwker plans need static shapes)'}; {checked}"
        return "inductor", TunedAtALaterCall(gm, opts, [], path == "training-dynamic", inductor), detail
    if path in ("training", "training-dynamic") and opts.inner == "eager":  # kwker's ops have no backward
        return "eager", gm, {"why": "a training graph run eagerly (inner='eager'), not rewritten"}
    if path in ("decode", "cpu-inference") and opts.inner is not None:
        try:
            aten_gm = trace_to_aten(gm, example_inputs)
        except NotLowerable as e:
            return "inductor", compile_with_inductor(gm, example_inputs, opts), {"why": str(e)}
        counts, _ = rewrite_language_model(aten_gm, glue=opts.glue)
        detail["rewrites"] = {k: v for k, v in counts.items() if v}
        if opts.inner == "eager":
            return "eager", aten_gm, detail
        return "inductor", compile_with_inductor(aten_gm, example_inputs, opts), detail
    kind = "inductor-unchanged" if path == "inductor-unchanged" else "inductor"
    return kind, compile_with_inductor(gm, example_inputs, opts), detail


def tune_inference(gm: torch.fx.GraphModule, example_inputs, opts: KwkerOptions):
    """A CPU inference graph: stock Inductor, Dynamo's graph run eagerly,
    kwker's plan (when the graph lowers) and, for convolutions with batch
    norms, Inductor with the model's tensors frozen (kwker.freeze; not
    compiled where Inductor's steady call shows it cannot win), each timed
    on this call's inputs, the fastest kept (kwker.tune). The inputs the graph
    writes are put back after every run. A graph with random ops goes to
    Inductor untimed, as before tuning: every candidate draws other numbers
    than eager, the truth; so does one with an op of another library
    (traced). Where this graph was tuned before, in this process or another,
    the candidate then kept is built alone (kwker.choices)."""
    key = choices.key("inference", gm, example_inputs, opts)
    plan_detail = {}
    def build_plan(aten_gm=None, arena=None):
        try:  # its copies its own (WeightArena's shares): the tuner calls it inside Dynamo's compile lock
            arena = arena if arena is not None else reserve_weights(gm, example_inputs, shares=False)
            plan, detail = compile_plan(gm, example_inputs, opts.glue, aten_gm=aten_gm, arena=arena)
        except NotLowerable:
            raise
        except Exception:  # a bug of kwker's, which the tuning would only name among the candidates left out
            log.warning("kwker: its plan of a graph failed to build; the other candidates are timed", exc_info=True)
            raise
        plan_detail.update(detail)
        return plan

    builders = {"inductor": lambda: compile_with_inductor(gm, example_inputs, opts), "eager": lambda: gm,
                "plan": build_plan, "frozen": lambda: FrozenGraph(gm, example_inputs, dict(opts.inductor_patches))}
    recalled = build_remembered("tuned", key, builders, plan_detail)
    if recalled:
        return recalled
    aten_gm, written, why_not = traced(gm, example_inputs)
    if why_not:
        return "inductor", compile_with_inductor(gm, example_inputs, opts), {"why": why_not}
    unfit, arena = unfit_for_kernels(gm, example_inputs), None
    builders["plan"] = functools.partial(_not_lowerable, unfit)
    try:
        if not unfit:
            arena = reserve_weights(gm, example_inputs, shares=False)  # faults in while Inductor compiles
            builders["plan"] = functools.partial(build_plan, aten_gm=aten_gm, arena=arena)
    except Exception as e:  # noqa: BLE001 - the plan is left out by this error, the other candidates timed
        # Not NotLowerable: the error may be the moment's (memory, a setting), and a choice made
        # without the plan is then not remembered (remember_unless_an_error).
        log.warning("kwker: reserving its plan's weight copies failed; the other candidates are timed", exc_info=True)
        builders["plan"] = functools.partial(_raise, e)
    if not worth_freezing(aten_gm) or written:  # a written tensor is no constant
        del builders["frozen"]
    try:
        choice = choose(builders, example_inputs, reference="inductor", truth="eager", written=written,
                        tolerance=output_tolerance(gm, example_inputs, TOLERANCE), gates={"frozen": cannot_win})
    except TruthFailed as e:
        return raised_run_eagerly(e, TunedAtALaterCall(
            gm, opts, [i for i, x in enumerate(example_inputs) if any(x is w for w in written)]))
    remember_unless_an_error(key, choice, choice.fallback)
    if choice.name == "frozen" and choice.fallback is not None:  # else Dynamo's graph, FrozenGraph's own
        choice.fn.fallback = choice.built[choice.fallback]
    detail = {"candidates": choice.ms, "choice": choice.name, "left_out": choice.left_out, "busy": choice.busy}
    if choice.name == "plan":
        detail.update(plan_detail, plan=choice.fn)
    served = choice.fn if choice.outputs is None else FirstCallServed(choice.fn, example_inputs, choice.outputs)
    return "tuned", served, detail


def raised_run_eagerly(e: TruthFailed, later: "TunedAtALaterCall"):
    """The graph failed run eagerly on the call's inputs (a user's error: a
    float32 input to a bf16 Linear, a token id past the vocabulary, a label
    past a loss's classes; or a training graph's backward, which the call
    itself may not run): it is run eagerly, so that this call and every later
    one that fails so raise eager's error, and tuned at the first later call
    that does not raise (`later`). Raised here, it was Dynamo's
    BackendCompilerFailed, which blamed kwker, and Dynamo compiled the graph
    again at every call; stock Inductor's graph aborts the process where its
    bounds check throws inside an OpenMP parallel region. A later call of
    other shapes or dtypes is compiled afresh (Dynamo's guards)."""
    why = f"the graph raised run eagerly on the first call's inputs{' (forward and backward)' * later.training}: " \
          f"{e}; it runs eagerly, untuned, until a call of these shapes that does not raise, which is tuned"
    log.warning("kwker: %s", why)
    return "eager", later, {"why": why}


class TunedAtALaterCall:
    """A graph whose first call raised run eagerly (raised_run_eagerly), tuned
    at the first later call that does not. An inference graph: until then each call runs it
    eagerly on copies of the inputs it writes (_on_copied_storages), so that
    one that fails again raises eager's error at the cost of eager's run and
    writes nothing (the tuning would trace and reserve weights first); the
    first that does not is tuned on its inputs as a first call is (those it
    writes that are inference tensors copied: Dynamo's compile traces them as
    fake tensors, this one as they are, and outside inference mode they may
    not be written), and the candidate kept serves it and every later call.
    Before, the graph ran eagerly, untuned, until torch._dynamo.reset(): one
    bad token id in a server's first request kept every later request of those
    shapes on eager's speed. A training graph (training=True): each later call
    is tuned as a first call is (tune_training: eager's forward and backward
    first, on inputs detached, its writes put back) and run eagerly while that
    raises; the candidate kept at the first call it does not serves every later
    call. Before, it ran eagerly until torch._dynamo.reset(): a first batch
    with a label past the classes kept a whole training run at eager's speed.
    A graph with dynamic shapes (inductor: Inductor's compile of it) is
    checked at its first call (_tuned_training, _tuned_dynamic): Inductor's
    graph serves every size unless it disagrees with eager's or fails, and
    then eager's does (every_size_keeps). It went to Inductor unchecked, and a
    training graph Inductor's gradients left out at its first size got them
    from its second size on."""

    checked_args = frozenset()  # for kwker.guards: the guards noted at the compile are all kept

    def __init__(self, gm: torch.fx.GraphModule, opts: KwkerOptions, written: list[int], training: bool = False,
                 inductor=None):
        self.gm, self.opts, self.written = gm, opts, frozenset(written)  # written: indices of the inputs
        self.training, self.inductor = training, inductor
        self.fn, self._lock = None, ForkSafeLock()

    def __call__(self, *args):
        fn = self.fn
        if fn is None:
            with self._lock:
                fn = self.fn or self._tuned(list(args))
        return fn(*args)

    def _tuned(self, inputs: list):
        """What serves this call: the candidate kept, else (eager's run in the
        tuning raised where the one on copies did not) the graph run eagerly."""
        if self.inductor is not None or self.training:
            start = time.perf_counter()
            try:
                if not self.training:
                    return self._keep(*_tuned_dynamic(self.gm, self.inductor, inputs), start)
                return self._keep(*_tuned_training(self.gm, inputs, self.opts, self.inductor), start)
            except TruthFailed as e:  # this call runs eagerly, and raises eager's error
                if self.inductor is not None:
                    log.warning("kwker: a graph of dynamic shapes raised run eagerly on its first call's inputs (%s); "
                                "it runs eagerly until a call that does not, where it is checked", e)
                return quiet(self.gm)
        written = [inputs[i] for i in self.written]
        quiet(self.gm)(*_on_copied_storages(inputs, written))  # eager's error, if it raises again
        start = time.perf_counter()
        # Outside inference mode, as Dynamo compiles (weight copies are written later, outside it);
        # inference_mode(False) turns grad mode on, which the graph's runs must not have.
        grad = torch.is_grad_enabled()
        with torch.inference_mode(False), torch.set_grad_enabled(grad):
            tuned_on = _on_copied_storages(inputs, [x for x in written if x.is_inference()])
            kind, fn, detail = tune_inference(self.gm, tuned_on, self.opts)
        if isinstance(fn, TunedAtALaterCall):
            return quiet(self.gm)
        return self._keep(kind, fn, detail, start)

    def _keep(self, kind: str, fn, detail: dict, start: float):
        seconds = time.perf_counter() - start
        why = "its first call raised run eagerly; tuned at the first later call that did not" \
            if self.inductor is None else "a graph of dynamic shapes, checked at its first call that ran"
        entry = summary.record(kind=kind, nodes=len(self.gm.graph.nodes), seconds=seconds, reason=why, **detail)
        log.info("graph %d (%d nodes): %s in %.2f s — %s", entry.index, entry.nodes, kind, seconds, entry.why)
        self.fn = fn
        return fn


def _tuned_dynamic(gm: torch.fx.GraphModule, inductor, inputs: list):
    """An inference graph with dynamic shapes, at its first call: Inductor's
    compile of it (which serves every size) and Dynamo's graph run eagerly,
    checked and timed on the call's inputs (their writes put back), and kept
    as every_size_keeps says; raises TruthFailed where eager's run raises.
    Only these two: kwker's plans and a frozen graph need static shapes. Not
    remembered (kwker.choices keys a graph by its static shapes). A graph
    tune_inference would not time (traced's why) keeps Inductor's."""
    aten_gm, written, why_not = traced(gm, inputs)
    if why_not:
        return "inductor", inductor, {"why": why_not}
    choice = choose({"inductor": lambda: inductor, "eager": lambda: gm}, inputs, reference="inductor",
                    truth="eager", written=written, tolerance=output_tolerance(gm, inputs, TOLERANCE))
    kept = every_size_keeps(choice)
    return "tuned", choice.built[kept], {"candidates": choice.ms, "choice": kept, "left_out": choice.left_out,
                                         "busy": choice.busy}


def every_size_keeps(choice) -> str:
    """The candidate a graph of dynamic shapes keeps: Inductor's unless its
    outputs differ from eager's or it failed, whichever was faster. The first
    call's size is one of many (Dynamo makes a graph dynamic at its second
    size: often an epoch's smaller last batch), and eager, faster at it, kept
    a whole training run off Inductor's speed at its full batches."""
    return "inductor" if "inductor" in choice.built else choice.name


def _on_copied_storages(inputs: list, tensors: list[torch.Tensor]) -> list:
    """inputs, each tensor that shares memory with one of `tensors` remade over
    one copy of that memory, at its offset, size and strides: a run on these
    writes none of them, and sees its own writes through every input that
    aliases the one written, as a run on the inputs does."""
    storages = {_memory(t) for t in tensors} - {None}
    copies, out = {}, []
    for x in inputs:
        if _memory(x) in storages:
            storage = x.untyped_storage()
            copy = copies.get(storage.data_ptr())
            if copy is None:
                copy = copies[storage.data_ptr()] = storage.clone()
            x = torch.empty(0, dtype=x.dtype).set_(copy, x.storage_offset(), x.shape, x.stride())
        out.append(x)
    return out


def _memory(x) -> int | None:
    """Where x's storage starts; None for what is no tensor or has no storage
    of its own to read (sparse, a wrapper subclass, an empty one)."""
    try:
        return x.untyped_storage().data_ptr() or None if isinstance(x, torch.Tensor) else None
    except (RuntimeError, NotImplementedError):
        return None


def remember_unless_an_error(key: str, choice, fallback: str | None):
    """choice, remembered under key (kwker.choices), unless a candidate was left
    out by an error other than NotLowerable (a plan kwker does not build for
    this graph): such an error may be the moment's (memory; a user's signal
    handler raising a timeout inside a candidate's compile, which the tuning
    cannot tell from the candidate's own failure), and a record would keep the
    candidate out in every later process. That graph is tuned again there; so
    is one whose candidates ran while other processes kept the machine busy
    (tune.BUSY_CPUS): their times were those processes' as much as their own.
    The first such choice of a process is warned about."""
    erred = [name for name, e in choice.errors.items() if not isinstance(e, NotLowerable)]
    if erred:
        log.info("kwker: the choice is not remembered: %s left out by an error", ", ".join(erred))
        return
    global _warned_busy
    if choice.busy:
        (log.info if _warned_busy else log.warning)(
            "kwker: %s; the choice (%s) may not be the fastest on an idle machine and is not remembered",
            choice.busy, choice.name)
        _warned_busy = True
        return
    choices.remember(key, choices.Record(choice.name, fallback, choice.ms))


_warned_busy = False


def _not_lowerable(why: str):
    raise NotLowerable(why)


def _raise(e: Exception):
    raise e


def build_remembered(kind: str, key: str, builders: dict, plan_detail: dict):
    """(kind, the compiled graph, detail) from the choice remembered under key
    (kwker.choices): the kept candidate built alone, and a frozen graph's
    fallback; None where there is none, or it no longer builds (logged: the
    graph is tuned again)."""
    record = choices.recall(key)
    if record is None:
        return None
    try:
        fn = builders[record.choice]()
        if record.choice == "frozen" and record.fallback is not None:
            fn.fallback = builders[record.fallback]()
    except Exception as e:  # noqa: BLE001 - tuned again, as without the record
        if not_the_candidates(e):
            raise
        log.warning("kwker: the remembered choice %r did not build (%s: %s); the graph is tuned again", record.choice,
                    type(e).__name__, e)
        return None
    detail = {"candidates": record.candidates, "choice": record.choice, "recalled": True,
              "why": "the choice remembered from an earlier tuning of this graph (kwker.choices)"}
    if record.choice == "plan":
        detail.update(plan_detail, plan=fn)
    return kind, fn, detail


def tune_training(gm: torch.fx.GraphModule, example_inputs, opts: KwkerOptions):
    """A training graph: stock Inductor and Dynamo's graph run eagerly, each timed
    on this call's inputs over its forward and backward (gradients of the
    outputs' sum, each element weighted by a random sign, through
    torch.autograd.grad on inputs detached from earlier graphs' history, so no
    .grad is written: tune.ForwardAndBackward), the fastest kept. kwker's own
    ops have no backward formulas: no plan here. A graph with random ops goes to
    Inductor untimed (Inductor draws its own random numbers, so no two
    candidates' outputs could be compared), and so does one with an op of
    another library (traced), one that writes an input requiring grad or a view
    (autograd would record every timing run's write) or whose inputs have
    gradient hooks (the timing's backward passes would call them). A choice
    remembered from an earlier tuning of this graph is built alone
    (kwker.choices)."""
    try:
        return _tuned_training(gm, example_inputs, opts)
    except TruthFailed as e:
        return raised_run_eagerly(e, TunedAtALaterCall(gm, opts, [], training=True))


def _tuned_training(gm: torch.fx.GraphModule, example_inputs, opts: KwkerOptions, inductor=None):
    """tune_training's; raises TruthFailed where eager's run raised.
    inductor: Inductor's compile of a graph with dynamic shapes, which serves
    every size, checked and timed on these inputs as it is (one compiled for
    their sizes would serve no other), kept as every_size_keeps says and not
    remembered (kwker.choices keys a graph by its static shapes). Stock Inductor's gradients of
    avg_pool2d(ceil_mode=True), wrong (pytorch#198119), were left out of a
    training graph's first size and went unchecked into the graph Dynamo made
    dynamic at its second, which then served every size, the first too."""
    def inductor_timed():
        # The backward compiled with the forward: compiled lazily, at the timing's
        # first backward, it would be compiled inside this compile, which Dynamo refuses.
        # Not written to Inductor's caches, whose keys leave that out: the compile of the
        # Inductor kept, and stock Inductor's in later processes, loaded this one, whose
        # backward takes the saved tensors' buffers, and backward(retain_graph=True)'s
        # second pass read them overwritten (gradients 3.2 off).
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            return compile_with_inductor(gm, example_inputs, opts, caches=False)

    if inductor is None:
        key = choices.key("training", gm, example_inputs, opts)
        builders = {"inductor": lambda: compile_with_inductor(gm, example_inputs, opts), "eager": lambda: gm}
        recalled = build_remembered("training", key, builders, {})
        if recalled:
            return recalled
        timed = {**builders, "inductor": inductor_timed}
    else:
        key, builders = None, {"inductor": lambda: inductor, "eager": lambda: gm}
        timed = builders  # the compile that then serves the calls, as stock Inductor's does
    with torch.no_grad():  # the forward's ATen ops are all that is read here
        aten_gm, written, why_not = traced(gm, example_inputs)
    if why_not is None and any(x.requires_grad for x in written):  # its value put back, not its autograd history
        why_not = "a training graph that writes an input requiring grad: run once, not timed"
    if why_not is None and any(x._base is not None for x in written):  # a view's history is not shed in place
        why_not = "a training graph that writes a view of a tensor: run once, not timed"
    if why_not is None and any(isinstance(x, torch.Tensor) and x._backward_hooks for x in example_inputs):
        why_not = "a training graph whose inputs have gradient hooks, which timing runs would call: not timed"
    if why_not is None and torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        # the user's pack and unpack hooks (an offload to disk, a count) ran 191 times at one call, not 4
        why_not = "a training graph called inside saved_tensors_hooks, which timing runs would call: not timed"
    if why_not:
        return "inductor", builders["inductor"](), {"why": why_not}
    choice = choose(timed, example_inputs, reference="inductor", truth="eager", run=ForwardAndBackward(),
                    written=written, tolerance=output_tolerance(gm, example_inputs, TRAINING_TOLERANCE))
    if key is not None:
        remember_unless_an_error(key, choice, None)
    # Inductor kept (of static shapes) is compiled again as stock Inductor compiles it, its backward lazily: the
    # timed one's, compiled before any backward said whether it keeps the graph, takes
    # the saved tensors' buffers for its own and refuses backward(retain_graph=True) and
    # create_graph=True (a second compile of the forward: the timed one is kept out of
    # Inductor's caches, see inductor_timed).
    name = choice.name if inductor is None else every_size_keeps(choice)
    kept = builders["inductor"]() if name == "inductor" else choice.fn
    return "training", kept, {"candidates": choice.ms, "choice": name, "left_out": choice.left_out,
                              "busy": choice.busy}


# The most bytes of written inputs that tuning keeps a copy of, to put back after each run.
WRITTEN_BYTES_TO_TUNE = 64 << 20


def traced(gm: torch.fx.GraphModule, example_inputs):
    """(ATen graph, the inputs it writes in place, None) for a graph to tune,
    or (..., why not) for one Inductor compiles untimed: one kwker's trace
    cannot follow (Inductor may), one with random ops (no candidate draws the
    numbers eager draws) or ops of another library (a custom op may draw them,
    or count its calls: rewrite.match.why_run_only_as_called), or one whose
    written inputs (a KV cache) hold more than WRITTEN_BYTES_TO_TUNE, which
    tuning would copy to put back after each run. The caller compiles with
    Inductor outside any `except` block: inside the one that caught the
    trace's failure, Inductor's compile of a graph with a symbolic float failed
    (GuardOnDataDependentSymNode) instead of having Dynamo specialise the float
    (test_guards, _zero_attention_scaling)."""
    try:
        aten_gm = trace_to_aten(gm, example_inputs)
    except NotLowerable as e:
        return None, [], str(e)
    once = next(filter(None, map(why_run_only_as_called, aten_gm.graph.nodes)), None)
    if once:
        return aten_gm, [], f"{once}: each candidate's run would be a call eager does not make; not timed"
    found = inputs_written(aten_gm, example_inputs)
    written = list({id(x): x for _, _, x in found}.values())
    size = sum(x.nbytes for x in written)
    if size > WRITTEN_BYTES_TO_TUNE:
        return aten_gm, written, f"{found[0][0].name} and others write {size >> 20} MiB of inputs: run once, not timed"
    return aten_gm, written, None


def compile_with_inductor(gm: torch.fx.GraphModule, example_inputs, opts: KwkerOptions, caches=True):
    """Inductor's compile of gm, the indices it reads from inputs checked
    before each call (kwker.bounds); with caches=False (tune_training's timed compile)
    neither read from nor written to Inductor's FX-graph and AOTAutograd caches,
    local or remote.
    Without the AOTAutograd cache too where two inputs share a storage: torch
    2.13's cache key leaves out which inputs overlap, so an entry compiled for
    views of one tensor was loaded for separate ones (AssertionError: wrong
    number of dimensions) and one compiled for separate inputs was loaded for
    views of one tensor, one of them written (outputs 65 off eager's, with stock
    Inductor too)."""
    from torch._inductor.compile_fx import compile_fx

    shared = any(first != i for i, first in enumerate(first_over_storage(example_inputs)))
    patches = dict(opts.inductor_patches)
    if not caches:
        patches.update(fx_graph_cache=False, fx_graph_remote_cache=False)
    autograd_cache = torch._functorch.config.enable_autograd_cache and caches and not shared
    remote_autograd_cache = torch._functorch.config.enable_remote_autograd_cache and caches
    try:  # read before Inductor, which may change the graph it is given
        checks = index_inputs(gm, example_inputs)
    except Exception:  # a bug of kwker's: Inductor's graph as stock Inductor runs it, logged
        log.warning("kwker: finding the graph's index inputs failed; they are not checked", exc_info=True)
        checks = None
    with torch._functorch.config.patch(enable_autograd_cache=autograd_cache,
                                       enable_remote_autograd_cache=remote_autograd_cache):
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
    return IndicesChecked(compiled, gm, checks) if checks else compiled
