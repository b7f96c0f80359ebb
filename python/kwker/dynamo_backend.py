"""The ``kwker`` backend for torch.compile, found by torch through the
``torch_dynamo_backends`` entry point."""

import logging
import time

import torch

from kwker import _C, summary
from kwker.aten_graph import trace_to_aten
from kwker.decode import compile_decode_step
from kwker.lower import NotLowerable
from kwker.options import KwkerOptions, parse_options
from kwker.rewrite import rewrite_language_model
from kwker.routing import route_graph
from kwker.threads import warn_once_if_openmp_spins

log = logging.getLogger(__name__)


def kwker_backend(gm: torch.fx.GraphModule, example_inputs, *, mode=None, options=None):
    """torch passes ``mode`` only when it is not "default" and ``options`` only when
    non-empty; both are validated here (torch does not)."""
    opts = parse_options(mode, options)
    start = time.perf_counter()
    route = route_graph(gm, example_inputs, torch.is_grad_enabled())
    kind, compiled, detail = compile_routed(route.path, gm, example_inputs, opts)
    seconds = time.perf_counter() - start
    entry = summary.record(kind=kind, nodes=len(gm.graph.nodes), seconds=seconds, reason=route.reason, **detail)
    log.info("graph %d (%d nodes): %s in %.2f s — %s", entry.index, entry.nodes, kind, seconds, entry.why)
    return compiled


def compile_routed(path: str, gm, example_inputs, opts: KwkerOptions):
    """A decode step is replayed; another CPU inference graph is stock Inductor's,
    or its rewritten ATen graph run eagerly (inner="eager") or compiled by
    Inductor (inner="inductor"); everything else goes to Inductor unchanged."""
    detail = {}
    if path == "decode" and opts.inner != "inductor":
        try:
            plan, detail = compile_decode_step(gm, example_inputs, glue=opts.glue)
            warn_once_if_openmp_spins()
            return "decode-replay", plan, dict(detail, plan=plan)
        except (NotLowerable, _C.PlanError) as e:  # a PlanError here is a lowering bug: logged, never a failed compile
            detail["why"] = f"decode step not replayable: {e}"
            path = "cpu-inference"
    if path in ("decode", "cpu-inference") and opts.inner is not None:
        aten_gm = trace_to_aten(gm, example_inputs)
        counts, _ = rewrite_language_model(aten_gm, glue=opts.glue)
        detail["rewrites"] = {k: v for k, v in counts.items() if v}
        if opts.inner == "eager":
            return "eager", aten_gm, detail
        return "inductor", compile_with_inductor(aten_gm, example_inputs, opts), detail
    # Until kwker's ops inside Inductor are timed against stock Inductor, the
    # default for graphs that are not decode steps is stock Inductor: never slower.
    kind = "inductor-unchanged" if path == "inductor-unchanged" else "inductor"
    return kind, compile_with_inductor(gm, example_inputs, opts), detail


def compile_with_inductor(gm: torch.fx.GraphModule, example_inputs, opts: KwkerOptions):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=dict(opts.inductor_patches))
