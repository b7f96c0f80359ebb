"""Decode steps: what makes a graph one, and the plan that replays it.

A decode step is a CPU inference graph that writes non-parameter inputs in
place (the cache's index_copy_ and the counter's add_ of transformers'
StaticCache) at one query position. routing.py recognises the candidates on
Dynamo's graph, before anything is traced; classify_decode_step checks the
ATen trace. The step is lowered to a plan and never given to Inductor.

The plan is what Dynamo calls. It reads kwker's weight copies, and checks
their sources before every call (kwker.weights): when one changed, the copies
are packed again, or, when they cannot be made the same way, the whole step is
compiled again from Dynamo's graph with the call's arguments and the plan takes
the new one over. A second model of the same class, for which Dynamo reuses
the step, has its weights packed into the same copies.
"""

import logging

import torch

from kwker.aten_graph import trace_to_aten
from kwker.lower import NotLowerable, lower_to_plan
from kwker.rewrite import reserved_copy_bytes, rewrite_language_model
from kwker.weights import CopiedWeights, WeightArena

aten = torch.ops.aten
log = logging.getLogger(__name__)


def classify_decode_step(gm: torch.fx.GraphModule, example_inputs) -> str | None:
    """None if the ATen graph gm is a decode step, else why it is not."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    writes = [n for n in gm.graph.nodes if n.op == "call_function" and _mutates_first_arg(n)]
    cache_writes = [n for n in writes if n.target is aten.index_copy_.default]
    if not cache_writes:
        return "it writes no static cache"
    for n in writes:
        target = n.args[0]
        if target.op != "placeholder":
            return f"{n.name} writes an intermediate in place"
        if isinstance(example_inputs[placeholders.index(target)], torch.nn.Parameter):
            return f"{n.name} writes the parameter {target.name}"
    for n in cache_writes:
        dim, src = n.args[1], n.args[3]
        if src.meta["val"].shape[dim] != 1:
            return f"{n.name} writes {src.meta['val'].shape[dim]} positions (prefill, not decode)"
    return None


def _mutates_first_arg(node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.arguments and schema.arguments[0].alias_info and schema.arguments[0].alias_info.is_write)


def compile_decode_step(gm: torch.fx.GraphModule, example_inputs, glue: bool = True):
    """The plan for Dynamo's graph gm of a decode step, and what it did (rewrite
    counts, fallback ops). Raises NotLowerable when gm is not one it can replay."""
    arena = WeightArena(reserved_copy_bytes(gm, example_inputs))  # faults in while the graph is traced
    try:
        aten_gm = trace_to_aten(gm, example_inputs)
        not_decode = classify_decode_step(aten_gm, example_inputs)
        if not_decode:
            raise NotLowerable(f"not a decode step: {not_decode}")
        placeholders = [n.name for n in aten_gm.graph.nodes if n.op == "placeholder"]
        params = {name: t for name, t in zip(placeholders, example_inputs) if isinstance(t, torch.nn.Parameter)}
        counts, copies = rewrite_language_model(aten_gm, params, glue=glue, arena=arena)
    finally:
        arena.close()
    plan, report = lower_to_plan(aten_gm, example_inputs, copies)
    if copies:
        copied = CopiedWeights(copies, {name: i for i, name in enumerate(placeholders)})
        plan.watch(copied.sources, _Refresh(copied, gm, glue))
    detail = {"rewrites": {k: v for k, v in counts.items() if v}, "fallback_ops": report.fallback_ops,
              "copies": len(copies)}
    return plan, detail


class _Refresh:
    """What a plan calls when a source of its copies changed: the copies packed
    again (None), or the step compiled again for these arguments (a new Plan,
    which the plan takes over)."""

    def __init__(self, copied: CopiedWeights, gm: torch.fx.GraphModule, glue: bool):
        self.copied, self.gm, self.glue = copied, gm, glue

    def __call__(self, args):
        if self.copied.refresh(args):
            log.debug("decode step: weight copies packed again")
            return None
        log.info("decode step: a weight can no longer be copied the same way; compiling the step again")
        plan, _ = compile_decode_step(self.gm, list(args), self.glue)
        return plan


__all__ = ["classify_decode_step", "compile_decode_step"]
