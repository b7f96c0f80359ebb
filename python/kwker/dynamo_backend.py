"""The ``kwker`` backend for torch.compile, found by torch through the
``torch_dynamo_backends`` entry point."""

import logging
import time

import torch

from kwker import summary
from kwker.aten_graph import has_static_shapes, trace_to_aten
from kwker.decode import classify_decode_step, compile_decode_step
from kwker.lower import NotLowerable
from kwker.options import KwkerOptions, parse_options
from kwker.rewrite import WeightArena, copied_weight_bytes, rewrite_language_model
from kwker.routing import graph_devices, route_graph
from kwker.threads import warn_once_if_openmp_spins

log = logging.getLogger(__name__)


def kwker_backend(gm: torch.fx.GraphModule, example_inputs, *, mode=None, options=None):
    """torch passes ``mode`` only when it is not "default" and ``options`` only when
    non-empty; both are validated here (torch does not)."""
    opts = parse_options(mode, options)
    start = time.perf_counter()
    route = route_graph(graph_devices(gm, example_inputs), torch.is_grad_enabled(), has_static_shapes(example_inputs))
    if route.path == "cpu-inference":
        kind, compiled, detail = compile_cpu_inference(gm, example_inputs, opts)
    else:
        kind, compiled, detail = route.path, compile_with_inductor(gm, example_inputs, opts), {}
    seconds = time.perf_counter() - start
    entry = summary.record(kind=kind, nodes=len(gm.graph.nodes), seconds=seconds, reason=route.reason, **detail)
    log.info("graph %d (%d nodes): %s in %.2f s — %s", entry.index, entry.nodes, kind, seconds, entry.why)
    return compiled


def compile_cpu_inference(gm, example_inputs, opts: KwkerOptions):
    """The rewritten ATen graph: replayed when it is a decode step, else run
    eagerly (inner="eager") or compiled by Inductor."""
    arena = WeightArena(copied_weight_bytes(gm, example_inputs))  # faults in while the graph is traced
    aten_gm = trace_to_aten(gm, example_inputs)
    params = {
        n.name: t
        for n, t in zip((n for n in aten_gm.graph.nodes if n.op == "placeholder"), example_inputs)
        if isinstance(t, torch.nn.Parameter)
    }
    rewrites = rewrite_language_model(aten_gm, params, glue=opts.glue, arena=arena)
    arena.close()
    detail = {"rewrites": {k: v for k, v in rewrites.items() if v}}
    not_decode = classify_decode_step(aten_gm, example_inputs)
    if not_decode is None and opts.inner != "inductor":
        try:
            plan, report = compile_decode_step(aten_gm, example_inputs)
            warn_once_if_openmp_spins()
            return "decode-replay", plan, {**detail, "fallback_ops": report.fallback_ops}
        except NotLowerable as e:
            detail["why"] = f"decode step not replayable: {e}"
    elif not_decode is not None:
        detail["why"] = f"not a decode step: {not_decode}"
    if opts.inner == "eager":
        return "eager", aten_gm, detail
    if opts.inner == "inductor":
        return "inductor", compile_with_inductor(aten_gm, example_inputs, opts), detail
    # Until kwker's ops inside Inductor are timed against stock Inductor, the
    # default for graphs that are not decode steps is stock Inductor: never slower.
    return "inductor", compile_with_inductor(gm, example_inputs, opts), detail


def compile_with_inductor(gm: torch.fx.GraphModule, example_inputs, opts: KwkerOptions):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=dict(opts.inductor_patches))
