"""RMSNorm as HF writes it (Llama's, Gemma's and OLMo 2's), and the residual add before it."""

import operator

import torch

from kwker.custom_ops import NORM_GEMMA, NORM_LLAMA, NORM_OLMO, ops
from kwker.rewrite.match import (adds_eps, aten, fuse_each, is_call, last_dim_mean, only_user, other_arg, replace,
                                  strip_float_upcast, val)


def fuse_rms_norm(gm: torch.fx.GraphModule) -> int:
    return fuse_each(gm, (aten.rsqrt.default,), _fuse_one)


def _fuse_one(graph, rsqrt) -> int:
    """Matches rsqrt(mean(h², -1, keepdim) + eps) * h, then Llama's weight * _.to(dtype),
    Gemma's (_ * (1 + weight.float())).to(dtype) or OLMo 2's (weight * _).to(dtype),
    with h = x.to(float32). T5's multiplies x itself by the float32 rsqrt: type
    promotion makes that h. In float32 OLMo 2's is Llama's (no cast is a node)."""
    add = rsqrt.args[0]
    if not adds_eps(add):
        return 0
    mean = add.args[0]
    if not last_dim_mean(mean):
        return 0
    pow_ = mean.args[0]
    if not (is_call(pow_, aten.pow.Tensor_Scalar) and pow_.args[1] == 2):
        return 0
    h = pow_.args[0]
    if val(h).dtype != torch.float32:
        return 0
    x, eps = strip_float_upcast(h), add.args[1]
    normed = next((u for u in rsqrt.users if is_call(u, aten.mul.Tensor) and other_arg(u, rsqrt) in (h, x)), None)
    if normed is None:
        return 0
    return (_fuse_llama_tail(graph, normed, x, eps) or _fuse_gemma_tail(graph, normed, x, eps)
            or _fuse_olmo_tail(graph, normed, x, eps))


def _is_norm_weight(node, x) -> bool:
    return isinstance(node, torch.fx.Node) and val(node).dim() == 1 and val(node).shape[0] == val(x).shape[-1]


def _fuse_llama_tail(graph, normed, x, eps) -> int:
    cast = only_user(normed)
    if cast is None:
        return 0
    if is_call(cast, aten._to_copy.default):
        if cast.kwargs.get("dtype") != val(x).dtype:
            return 0
        scaled = only_user(cast)
    elif val(x).dtype == torch.float32:  # .to(float32) of a float32 tensor is no node
        cast, scaled = normed, cast
    else:
        return 0
    if not is_call(scaled, aten.mul.Tensor):
        return 0
    weight = other_arg(scaled, cast)
    if not _is_norm_weight(weight, x):
        return 0
    replace(graph, scaled, ops.rms_norm.default, (x, weight, eps, NORM_LLAMA))
    return 1


def _fuse_gemma_tail(graph, normed, x, eps) -> int:
    scaled = only_user(normed)
    if not is_call(scaled, aten.mul.Tensor):
        return 0
    one_plus = other_arg(scaled, normed)
    if not (is_call(one_plus, aten.add.Tensor) and one_plus.args[1] == 1.0 and not one_plus.kwargs):  # alpha=1
        return 0
    weight = strip_float_upcast(one_plus.args[0])
    cast = only_user(scaled)
    if not _is_norm_weight(weight, x):
        return 0
    if is_call(cast, aten._to_copy.default) and cast.kwargs.get("dtype") == val(x).dtype:
        out = cast
    elif val(x).dtype == torch.float32:
        out = scaled
    else:
        return 0
    replace(graph, out, ops.rms_norm.default, (x, weight, eps, NORM_GEMMA))
    return 1


def _fuse_olmo_tail(graph, normed, x, eps) -> int:
    """(weight * x̂).to(dtype), the product in float32 (a bf16 weight promoted, or
    Helium's weight.to(float32)), rounded once."""
    scaled = only_user(normed)
    if not is_call(scaled, aten.mul.Tensor) or val(x).dtype == torch.float32:
        return 0
    weight = strip_float_upcast(other_arg(scaled, normed))
    cast = only_user(scaled)
    if not (_is_norm_weight(weight, x) and val(scaled).dtype == torch.float32 and is_call(cast, aten._to_copy.default)
            and cast.kwargs.get("dtype") == val(x).dtype):
        return 0
    replace(graph, cast, ops.rms_norm.default, (x, weight, eps, NORM_OLMO))
    return 1


def fuse_residual_add(gm: torch.fx.GraphModule) -> int:
    """add(a, b) feeding an rms_norm becomes one add_rms_norm that writes both
    the sum (still used as the residual) and the normed value."""
    graph, count = gm.graph, 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    for norm in list(graph.nodes):
        if not is_call(norm, ops.rms_norm.default):
            continue
        add = norm.args[0]
        if not is_call(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs:
            continue
        a, b = add.args
        if not all(isinstance(t, torch.fx.Node) and val(t).shape == val(add).shape and val(t).dtype == val(add).dtype for t in (a, b)):
            continue
        if any(order.get(u, 0) < order[norm] for u in add.users if u is not norm):
            continue  # the sum is used before the norm: no place for one fused op
        with graph.inserting_before(norm):
            fused = graph.call_function(ops.add_rms_norm.default, (a, b, *norm.args[1:]))
            fused.meta["val"] = (val(add), val(norm))
            residual = graph.call_function(operator.getitem, (fused, 0))
            residual.meta["val"] = val(add)
            normed = graph.call_function(operator.getitem, (fused, 1))
            normed.meta["val"] = val(norm)
        norm.replace_all_uses_with(normed)
        add.replace_all_uses_with(residual)
        count += 1
    return count

