"""The ``kwker`` backend for torch.compile, found by torch through the
``torch_dynamo_backends`` entry point."""

import logging
import time

import torch

from kwker.options import KwkerOptions, parse_options
from kwker.routing import graph_devices, route_graph

log = logging.getLogger(__name__)

_graph_counter = 0


def kwker_backend(gm: torch.fx.GraphModule, example_inputs, *, mode=None, options=None):
    """torch passes ``mode`` only when it is not "default" and ``options`` only when
    non-empty; both are validated here (torch does not)."""
    global _graph_counter
    opts = parse_options(mode, options)
    graph_id = _graph_counter
    _graph_counter += 1
    route = route_graph(graph_devices(gm, example_inputs))
    log.info("graph %d (%d nodes, %s): %s — %s", graph_id, len(gm.graph.nodes), _grad_mode(), route.path, route.reason)
    start = time.perf_counter()
    compiled = compile_with_inductor(gm, example_inputs, opts)
    log.info("graph %d compiled in %.2f s", graph_id, time.perf_counter() - start)
    return compiled


def compile_with_inductor(gm: torch.fx.GraphModule, example_inputs, opts: KwkerOptions):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=dict(opts.inductor_patches))


def _grad_mode() -> str:
    return "training" if torch.is_grad_enabled() else "inference"
