"""Attention of one or more query positions over a static KV cache, without
repeat_kv (causality, for several positions, is in the mask).

HF's sdpa path expands each cache to all query heads (repeat_kv: unsqueeze,
expand, clone, view) and passes an additive mask made from the bool mask by
where(mask, 0, -inf), or no mask and is_causal where the mask would be plain
causal (the first chunk of a prefill, a whole sequence): SDPA's is_causal keeps
key j for query i where j <= i (torch.ones(L, S).tril()), which becomes a bool
mask the plan folds into a constant. kwker's op reads the caches as they are."""

import math
import operator

import torch

from kwker.custom_ops import attention_output, ops
from kwker.rewrite.match import aten, fuse_each, is_call, val

SDPA = (aten._scaled_dot_product_flash_attention_for_cpu.default,)


def fuse_attention(gm: torch.fx.GraphModule) -> int:
    return fuse_each(gm, SDPA, _fuse_one)


def _fuse_one(graph, sdpa) -> int:
    q, k, v = sdpa.args[:3]
    dropout = sdpa.args[3] if len(sdpa.args) > 3 else sdpa.kwargs.get("dropout_p", 0.0)
    causal = sdpa.args[4] if len(sdpa.args) > 4 else sdpa.kwargs.get("is_causal", False)
    if dropout != 0.0 or val(q).dim() != 4 or (causal and sdpa.kwargs.get("attn_mask") is not None):
        return 0
    k_cache, v_cache = _unrepeat(k), _unrepeat(v)
    hq, hkv = val(q).shape[1], val(k_cache).shape[1]
    if val(k_cache).shape != val(v_cache).shape or hq % hkv or val(k_cache).shape[-1] != val(q).shape[-1]:
        return 0
    outs = [u for u in sdpa.users if u.target is operator.getitem and u.args[1] == 0]
    if len(outs) != 1 or not _same_layout(attention_output(val(q), val(v_cache)), val(outs[0])):
        return 0  # the graph after it reads SDPA's output in a layout the op does not give
    scale = sdpa.kwargs.get("scale")
    scale = 1.0 / math.sqrt(val(q).shape[-1]) if scale is None else scale
    out = outs[0]
    with graph.inserting_before(out):
        mask = _causal_mask(graph, val(q).shape[2], val(k_cache).shape[2], val(q)) if causal else \
            _bool_mask(sdpa.kwargs.get("attn_mask"))
        new = graph.call_function(ops.attention.default, (q, k_cache, v_cache, mask, float(scale)))
    new.meta["val"] = val(out)
    out.replace_all_uses_with(new)
    # Erased here, not left to dead-code elimination, which keeps the SDPA of
    # some traces (SmolLM2's 8-position step): with it would stay repeat_kv's
    # copies and the mask's where, all computed for nothing.
    for user in list(sdpa.users):
        if not user.users:
            graph.erase_node(user)
    if not sdpa.users:
        graph.erase_node(sdpa)
    return 1


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements at the same offsets: a dim of size 1 has no stride that matters."""
    return a.shape == b.shape and all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride()))


def _unrepeat(node):
    """The cache [B, H, S, D] under repeat_kv's
    _unsafe_view(clone(expand(unsqueeze(cache, 2)))): expanded to [B, H, n, S, D]
    and viewed as [B, H·n, S, D], so that head h·n + i is the cache's head h.
    The same ops shaped otherwise (n copies merged into the positions, or
    heads split) are other tensors, kept as they are."""
    view = node
    if is_call(view, aten._unsafe_view.default, aten.view.default, aten.reshape.default):
        clone = view.args[0]
        if is_call(clone, aten.clone.default):
            clone = clone.args[0]
        if is_call(clone, aten.expand.default) and is_call(clone.args[0], aten.unsqueeze.default):
            unsq = clone.args[0]
            cache = unsq.args[0]
            if unsq.args[1] == 2 and val(cache).dim() == 4:
                b, h, s, d = val(cache).shape
                n = val(clone).shape[2]
                if tuple(val(clone).shape) == (b, h, n, s, d) and tuple(val(view).shape) == (b, h * n, s, d):
                    return cache
    return node


def _causal_mask(graph, L: int, S: int, like: torch.Tensor):
    """SDPA's is_causal as a bool mask [1, 1, L, S]: ones(L, S).tril(), from no input."""
    ones = graph.call_function(aten.ones.default, ([L, S],), {"dtype": torch.bool, "device": like.device})
    ones.meta["val"] = like.new_ones((L, S), dtype=torch.bool)
    tril = graph.call_function(aten.tril.default, (ones,))
    tril.meta["val"] = val(ones).tril()
    mask = graph.call_function(aten.view.default, (tril, [1, 1, L, S]))
    mask.meta["val"] = val(tril).view(1, 1, L, S)
    return mask


def _bool_mask(mask):
    """where(bool_mask, 0, -inf) is the bool mask itself; any other mask is additive."""
    if is_call(mask, aten.where.self):
        cond, keep, drop = mask.args
        if _scalar_const(keep) == 0.0 and _scalar_const(drop) == float("-inf") and val(cond).dtype == torch.bool:
            return cond
    return mask


def _scalar_const(node):
    if is_call(node, aten.scalar_tensor.default):
        return node.args[0]
    return None
