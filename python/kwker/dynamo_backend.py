"""The ``kwker`` backend for torch.compile, found by torch through the
``torch_dynamo_backends`` entry point."""

import logging
import time

import torch

from kwker import _C, guards, summary
from kwker.aten_graph import trace_to_aten
from kwker.decode import compile_decode_step
from kwker.freeze import FrozenGraph, worth_freezing
from kwker.lower import NotLowerable
from kwker.options import KwkerOptions, parse_options
from kwker.plan import compile_plan, inputs_written
from kwker.rewrite import rewrite_language_model
from kwker.routing import route_graph, unfit_for_kernels
from kwker.threads import warn_once_if_openmp_spins
from kwker.tune import choose

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
    fastest of Inductor, eager and kwker's plan), or its rewritten ATen graph is
    run eagerly (inner="eager") or compiled by Inductor (inner="inductor");
    everything else goes to Inductor unchanged."""
    detail = {}
    if path == "decode" and opts.inner != "inductor":
        try:
            plan, detail = compile_decode_step(gm, example_inputs, glue=opts.glue)
            warn_once_if_openmp_spins()
            return "decode-replay", plan, dict(detail, plan=plan)
        except (NotLowerable, _C.PlanError) as e:  # a PlanError here is a lowering bug: logged, never a failed compile
            detail["why"] = f"decode step not replayable: {e}"
            path = "cpu-inference"
    if path == "cpu-inference" and opts.inner is None:
        return tune_inference(gm, example_inputs, opts)
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
    norms, Inductor with the model's tensors frozen (kwker.freeze), each timed
    on this call's inputs, the fastest kept (kwker.tune). A graph that writes one of its inputs in place is
    not run more than once: it goes to Inductor."""
    why_not = None
    try:
        aten_gm = trace_to_aten(gm, example_inputs)
        written = inputs_written(aten_gm, example_inputs)
        if written:
            why_not = f"{written[0][0].name} writes the input {written[0][1].name}: run once, not timed"
    except NotLowerable as e:  # what kwker's trace cannot follow, Inductor may
        why_not = str(e)
    if why_not:
        return "inductor", compile_with_inductor(gm, example_inputs, opts), {"why": why_not}
    plan_detail = {}

    def build_plan():
        unfit = unfit_for_kernels(gm, example_inputs)
        if unfit:
            raise NotLowerable(unfit)
        plan, detail = compile_plan(gm, example_inputs, opts.glue, aten_gm=aten_gm)
        plan_detail.update(detail)
        return plan

    builders = {"inductor": lambda: compile_with_inductor(gm, example_inputs, opts), "eager": lambda: gm,
                "plan": build_plan}
    if worth_freezing(aten_gm):
        builders["frozen"] = lambda: FrozenGraph(gm, example_inputs, dict(opts.inductor_patches))
    choice = choose(builders, example_inputs, reference="inductor")
    if choice.name == "frozen":
        choice.fn.fallback = choice.fallback
    detail = {"candidates": choice.ms, "choice": choice.name, "left_out": choice.left_out}
    if choice.name == "plan":
        detail.update(plan_detail, plan=choice.fn)
    return "tuned", choice.fn, detail


def compile_with_inductor(gm: torch.fx.GraphModule, example_inputs, opts: KwkerOptions):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=dict(opts.inductor_patches))
