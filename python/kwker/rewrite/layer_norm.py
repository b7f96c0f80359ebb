"""A layer norm written out, as Cohere's CohereLayerNorm does: for h = x.to(float32)
and m = h.mean(-1, keepdim=True),

    ((h - m) * rsqrt(((h - m) ** 2).mean(-1, keepdim=True) + eps) [* w.to(float32)]).to(x.dtype)

is ATen's own native_layer_norm(x, [K], w, None, eps) (biased variance, computed
in float32, rounded once to x's dtype), which the plans lower to kwker's
layer_norm and Inductor and eager run as PyTorch's. One difference is left: a
row whose variance overflows float32 (values near 1e20) normalises to 0 written
out and in kwker's kernel, to NaN in ATen's (unrewritten graphs, inner="eager"
or "inductor"; the tuner drops a candidate that differs from eager)."""

import operator

import torch

from kwker.rewrite.match import (adds_eps, aten, fuse_each, is_call, last_dim_mean, only_user, other_arg,
                                  strip_float_upcast, val)


def fuse_layer_norm(gm: torch.fx.GraphModule) -> int:
    return fuse_each(gm, (aten.rsqrt.default,), _fuse_one)


def _centred(node, h, mean) -> bool:
    return is_call(node, aten.sub.Tensor) and node.args[:2] == (h, mean) and not node.kwargs and len(node.args) == 2


def _fuse_one(graph, rsqrt) -> int:
    add = rsqrt.args[0]
    if not adds_eps(add):
        return 0
    var = add.args[0]
    if not last_dim_mean(var):
        return 0
    pow_ = var.args[0]
    if not (is_call(pow_, aten.pow.Tensor_Scalar) and pow_.args[1] == 2):
        return 0
    centred = pow_.args[0]
    if not is_call(centred, aten.sub.Tensor):
        return 0
    h, mean = centred.args[:2]
    if not (_centred(centred, h, mean) and last_dim_mean(mean) and mean.args[0] is h and val(h).dtype == torch.float32):
        return 0
    normed = next((u for u in rsqrt.users if is_call(u, aten.mul.Tensor) and _centred(other_arg(u, rsqrt), h, mean)),
                  None)
    if normed is None:
        return 0
    x, eps = strip_float_upcast(h), add.args[1]
    out, weight = normed, None
    scaled = only_user(normed)
    if is_call(scaled, aten.mul.Tensor):
        w = strip_float_upcast(other_arg(scaled, normed))
        if isinstance(w, torch.fx.Node) and val(w).dim() == 1 and val(w).shape[0] == val(x).shape[-1]:
            out, weight = scaled, w
    if val(x).dtype != torch.float32:  # the float32 result must be rounded back to x's dtype
        cast = only_user(out)
        if not (is_call(cast, aten._to_copy.default) and cast.kwargs.get("dtype") == val(x).dtype):
            return 0
        out = cast
    if weight is not None and val(weight).dtype not in (torch.float32, val(x).dtype):
        return 0
    with graph.inserting_before(out):
        norm = graph.call_function(aten.native_layer_norm.default, (x, [val(x).shape[-1]], weight, None, eps))
        stats = val(x).new_empty((*val(x).shape[:-1], 1), dtype=torch.float32)
        norm.meta["val"] = (val(out), stats, stats)
        first = graph.call_function(operator.getitem, (norm, 0))
    first.meta["val"] = val(out)
    out.replace_all_uses_with(first)
    return 1
