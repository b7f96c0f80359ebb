"""Decode steps: what makes a graph one, and the callable that replays it.

A decode step is a CPU inference graph that writes non-parameter inputs in
place (the cache's index_copy_ and the counter's add_ of transformers'
StaticCache) at one query position. The cache is usually marked static, but not
when the cache was created inside a compiled prefill (model.forward compiled),
so the mark is not required. It is lowered to a plan and never given to
Inductor.
"""

import torch

from kwker.lower import block_weight, lower_to_plan
from kwker.rewrite import pack_weights, pack_weights_dtype

aten = torch.ops.aten


def static_arg_indices(gm: torch.fx.GraphModule, example_inputs) -> set[int]:
    """Inputs whose memory must be the same on every call: parameters and the
    module buffers Dynamo marked static. Not the KV cache: transformers marks it
    static without an address guard, so a new cache object (the next generate()
    call) reuses the compiled step, and the plan binds its tensors on each call."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written = {n.args[0] for n in gm.graph.nodes if n.op == "call_function" and _mutates_first_arg(n)}
    return {
        i
        for i, t in enumerate(example_inputs)
        if isinstance(t, torch.Tensor)
        and placeholders[i] not in written
        and (isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) is not None)
    }


def classify_decode_step(gm: torch.fx.GraphModule, example_inputs) -> str | None:
    """None if gm is a decode step, else why it is not."""
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


class Repacker:
    """What the plan calls when a parameter that kwker packed (a bf16 copy, or
    q/k/v's weights or biases stacked) changed in place: packs again each copy
    whose sources moved."""

    def __init__(self, groups: list[tuple[torch.Tensor, list[int], list[int]]]):
        self.groups = groups  # (packed copy, its sources' argument indices, their versions)

    def __call__(self, args):
        for packed, sources, versions in self.groups:
            now = [args[i]._version for i in sources]
            if now != versions:
                _repack(packed, [args[i] for i in sources])
                versions[:] = now


def _repack(packed: torch.Tensor, weights: list[torch.Tensor]) -> None:
    """Packs again into the plan's own tensor (same address, same layout)."""
    if packed.dtype == torch.bfloat16 and pack_weights_dtype(weights) != torch.bfloat16:
        raise RuntimeError(
            "kwker: a weight changed in place and is no longer exactly representable in bfloat16, "
            "so its compiled bfloat16 copy cannot be refreshed; call torch._dynamo.reset() and compile again"
        )
    fresh = pack_weights(weights, packed.dtype)
    packed.copy_(block_weight(fresh, packed.shape[2]) if packed.dim() == 3 else fresh)  # 3 dims: K-blocked


def compile_decode_step(gm: torch.fx.GraphModule, example_inputs):
    """The plan, which Dynamo calls directly, and the lowering's report. The
    plan checks its packed weights' sources for in-place changes in C, before
    each call, and asks a Repacker to refresh the copies."""
    plan, report, constants = lower_to_plan(gm, example_inputs, static_arg_indices(gm, example_inputs))
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    groups = [
        (constants[p.attr], [names.index(s) for s in p.sources], list(p.versions))
        for p in gm.meta.get("kwker_packed", [])
        if p.attr in constants
    ]
    if groups:
        watched = {i: v for _, sources, versions in groups for i, v in zip(sources, versions)}
        plan.watch_versions(list(watched), list(watched.values()), Repacker(groups))
    return plan, report


__all__ = ["classify_decode_step", "compile_decode_step", "static_arg_indices"]
