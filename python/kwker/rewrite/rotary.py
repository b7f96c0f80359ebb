"""Rotary embedding in HF's rotate_half convention:
x * cos + cat(-x[..., half:], x[..., :half]) * sin."""

import torch

from kwker.custom_ops import ops
from kwker.rewrite.match import aten, is_call, last_dim, op_arguments, replace, val


def fuse_rotary(gm: torch.fx.GraphModule) -> int:
    count = 0
    for add in list(gm.graph.nodes):
        if is_call(add, aten.add.Tensor) and len(add.args) == 2 and not add.kwargs:  # alpha=1
            match = _match(*add.args) or _match(*reversed(add.args))
            if match:
                replace(gm.graph, add, ops.rotary.default, match)
                count += 1
    return count


def _match(x_cos, rot_sin):
    if not (is_call(x_cos, aten.mul.Tensor) and is_call(rot_sin, aten.mul.Tensor)):
        return None
    for x, cos in (x_cos.args, reversed(x_cos.args)):
        for rotated, sin in (rot_sin.args, reversed(rot_sin.args)):
            if _is_rotate_half(rotated, x) and all(isinstance(t, torch.fx.Node) for t in (x, cos, sin)):
                return x, cos, sin
    return None


def _is_rotate_half(node, x) -> bool:
    if not (is_call(node, aten.cat.default) and len(node.args[0]) == 2):
        return False
    if not (len(node.args) > 1 and last_dim(node.args[1], val(node).dim())):
        return False
    neg, first = node.args[0]
    if not is_call(neg, aten.neg.default):
        return False
    second = neg.args[0]
    half = val(x).shape[-1] // 2
    return _is_slice(first, x, 0, half) and _is_slice(second, x, half, val(x).shape[-1])


def _is_slice(node, x, start, end) -> bool:
    if not (is_call(node, aten.slice.Tensor) and node.args[0] is x):
        return False
    given = op_arguments(node)
    lo, hi = given["start"], given["end"]
    hi = val(x).shape[-1] if hi is None else min(hi, val(x).shape[-1])
    return last_dim(given["dim"], val(x).dim()) and (lo or 0) == start and hi == end and given["step"] == 1
