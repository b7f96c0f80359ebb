"""Gated activations of Llama-style MLPs: act(gate) * up as one kwker op per
activation (SwiGLU's silu, Gemma's tanh GELU). GATED maps an activation to its
fused op and the op's extra arguments read off the activation's node."""

import torch

from kwker.custom_ops import ops
from kwker.rewrite.match import aten, is_call, replace, val

GATED = {
    aten.silu.default: lambda act: (ops.silu_mul.default, ()),
    aten.gelu.default: lambda act: (ops.gelu_mul.default, (act.kwargs.get("approximate", "none"),)),
}


def fuse_gated_activations(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Counts by fused op name."""
    counts: dict[str, int] = {}
    for mul in list(gm.graph.nodes):
        if not (is_call(mul, aten.mul.Tensor) and len(mul.args) == 2):
            continue
        a, b = mul.args
        act, up = (a, b) if is_call(a, *GATED) else (b, a)
        if not is_call(act, *GATED) or not isinstance(up, torch.fx.Node):
            continue
        gate = act.args[0]
        if val(gate).shape == val(up).shape == val(mul).shape and val(gate).dtype == val(up).dtype:
            op, extra = GATED[act.target](act)
            replace(gm.graph, mul, op, (gate, up, *extra))
            counts[op._opname] = counts.get(op._opname, 0) + 1
    return counts
