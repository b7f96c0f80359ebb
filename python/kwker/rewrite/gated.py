"""silu(gate) * up, the SwiGLU of Llama-style MLPs."""

import torch

from kwker.custom_ops import ops
from kwker.rewrite.match import aten, is_call, replace, val


def fuse_silu_mul(gm: torch.fx.GraphModule) -> int:
    count = 0
    for mul in list(gm.graph.nodes):
        if not (is_call(mul, aten.mul.Tensor) and len(mul.args) == 2):
            continue
        a, b = mul.args
        silu, up = (a, b) if is_call(a, aten.silu.default) else (b, a)
        if not is_call(silu, aten.silu.default) or not isinstance(up, torch.fx.Node):
            continue
        gate = silu.args[0]
        if val(gate).shape == val(up).shape == val(mul).shape and val(gate).dtype == val(up).dtype:
            replace(gm.graph, mul, ops.silu_mul.default, (gate, up))
            count += 1
    return count
