"""The tanh GELU written out as ATen ops (transformers' NewGELUActivation,
"gelu_new": GPT-2, GPT-J, ...) as one aten.gelu(approximate="tanh"), which the
plan runs as one native step and Inductor and eager as one op:

    0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))

the same formula with the same constants; only the rounding between the steps
differs. Written out, a plan ran it as eight passes over the activations (GPT-2
at 128 tokens: 65 of its 143 ms, its tanh on the scalar path)."""

import math

import torch

from kwker.rewrite.match import aten, is_call, other_arg, val

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def fuse_tanh_gelu(gm: torch.fx.GraphModule) -> int:
    count = 0
    for mul in list(gm.graph.nodes):
        if not (is_call(mul, aten.mul.Tensor) and len(mul.args) == 2):
            continue
        for half, rest in (mul.args, mul.args[::-1]):
            x = _times(half, 0.5)
            if x is not None and _one_plus_tanh_of_inner(rest, x) and val(x).shape == val(mul).shape \
                    and val(x).dtype == val(mul).dtype and val(x).is_floating_point():
                with gm.graph.inserting_before(mul):
                    gelu = gm.graph.call_function(aten.gelu.default, (x,), {"approximate": "tanh"})
                gelu.meta["val"] = val(mul)
                mul.replace_all_uses_with(gelu)
                count += 1
                break
    return count


def _times(node, constant: float):
    """x for x * constant (either order), else None."""
    if not (is_call(node, aten.mul.Tensor) and len(node.args) == 2):
        return None
    a, b = node.args
    if isinstance(b, float) and math.isclose(b, constant, rel_tol=1e-6) and isinstance(a, torch.fx.Node):
        return a
    if isinstance(a, float) and math.isclose(a, constant, rel_tol=1e-6) and isinstance(b, torch.fx.Node):
        return b
    return None


def _one_plus_tanh_of_inner(node, x) -> bool:
    """node is 1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))."""
    if not (is_call(node, aten.add.Tensor) and len(node.args) == 2 and not node.kwargs):
        return False
    a, b = node.args
    tanh = a if b == 1.0 else b if a == 1.0 else None
    if not is_call(tanh, aten.tanh.default):
        return False
    inner = _times(tanh.args[0], SQRT_2_OVER_PI)
    if not (is_call(inner, aten.add.Tensor) and len(inner.args) == 2 and not inner.kwargs):
        return False
    cube = _times(other_arg(inner, x), 0.044715)
    return is_call(cube, aten.pow.Tensor_Scalar) and cube.args[0] is x and cube.args[1] == 3.0
