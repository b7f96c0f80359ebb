"""Linear layers in a graph a plan will replay: each becomes kwker.linear, and
linears that read the same input (q/k/v, gate/up) one kwker.linear_multi over their
weights stacked.

How each weight is stored (as stored, or a copy: bf16, stacked, K-blocked) is
kwker.weights' decision; this pass finds the linears, groups them and puts the
copies into the graph as attributes.
"""

import itertools
import operator
from dataclasses import dataclass, replace

import torch

from kwker import weights
from kwker.custom_ops import LINEAR_MULTI_OUTPUTS, ops
from kwker.rewrite.match import aten, is_call, val


def planned_copies(gm: torch.fx.GraphModule, inputs: dict) -> list[tuple[list[torch.Tensor], weights.Storage]]:
    """The copies rewrite_linears will ask for, read off Dynamo's graph (the
    same groups, decided alike; inputs: its placeholders' example values,
    kwker.rewrite.planned_copies)."""
    groups: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is torch._C._nn.linear and len(n.args) > 1:  # nn.Linear's, its bias positional
            x, w, bias, kn = n.args[0], n.args[1], n.args[2] if len(n.args) > 2 else None, False
        elif n.target is torch.addmm and len(n.args) == 3 and not n.kwargs:  # Conv1D's: addmm(bias, x, W[K, N])
            bias, x, w, kn = *n.args, True
        else:
            continue
        if isinstance(inputs.get(w), torch.Tensor):
            groups.setdefault((x, inputs[w].dtype, bias is None, kn), []).append((inputs[w], inputs.get(bias)))
    planned = []
    for (x, _, _, kn), group in groups.items():
        rows = weights.rows_per_call(x.meta["example_value"]) if "example_value" in x.meta else 1
        for members in _calls(group):
            ws = [w for w, _ in members]
            storage = weights.decide(ws, rows, kn)
            if storage is not None:
                planned += weights.group_copies(ws, [b for _, b in members if isinstance(b, torch.Tensor)], storage)
    return planned


def rewrite_linears(gm: torch.fx.GraphModule, params: dict[str, torch.Tensor],
                    arena: weights.WeightArena) -> tuple[int, dict[str, weights.PlanCopy]]:
    """params: placeholder name -> the real parameter tensor; arena: where the
    copies go. Returns how many linears were rewritten and the copies read, by
    the graph attribute that holds each."""
    linears = [m for m in (_match_linear(n, params) for n in gm.graph.nodes) if m]
    copies: dict[str, weights.PlanCopy] = {}
    for group in _group_by_input(linears):
        storage = weights.decide([params[m.weight.name] for m in group], weights.rows_per_call(val(group[0].x)),
                                 kn=group[0].kn)
        biases = [m.bias for m in group] if group[0].bias is not None else []
        read = weights.group_copies([m.weight for m in group], biases, storage, lambda b: val(b).dtype) \
            if storage is not None else []
        if read and arena.admit([([s.name for s in sources], st) for sources, st in read], params):
            _rewrite_group(gm, group, read, params, arena, copies)
        else:
            for m in group:
                _rewrite_single_as_stored(gm.graph, m)
    return len(linears), copies


def _rewrite_single_as_stored(graph, m: "_Linear") -> None:
    """A weight read as stored: the parameter itself, no copy to keep fresh (a
    [K, N] one through its transposed view)."""
    with graph.inserting_before(m.node):
        weight = m.weight
        if m.kn:
            weight = graph.call_function(aten.t.default, (m.weight,))
            weight.meta["val"] = val(m.weight).t()
        new = graph.call_function(ops.linear.default, (m.x, weight, m.bias))
    new.meta["val"] = val(m.node)
    m.node.replace_all_uses_with(new)


@dataclass
class _Linear:
    node: torch.fx.Node  # the mm / addmm
    x: torch.fx.Node
    weight: torch.fx.Node  # placeholder
    bias: torch.fx.Node | None
    kn: bool = False  # the weight is [K, N], multiplied as stored (x @ W): GPT-2's Conv1D


def _match_linear(node, params):
    if is_call(node, aten.mm.default):
        (x, wt), bias = node.args, None
    elif is_call(node, aten.addmm.default) and not node.kwargs:
        bias, x, wt = node.args[:3]
        if not (isinstance(bias, torch.fx.Node) and val(bias).dim() == 1):
            return None
    else:
        return None
    kn = not (is_call(wt, aten.t.default) or (is_call(wt, aten.permute.default) and list(wt.args[1]) == [1, 0]))
    w = wt if kn else wt.args[0]
    if not (w.op == "placeholder" and w.name in params and val(w).dim() == 2):
        return None
    if bias is not None and not (bias.op == "placeholder" and bias.name in params):
        return None
    if len({val(t).dtype for t in (x, w, bias) if t is not None}) > 1:  # PyTorch's mm raises, as it should here
        return None
    return _Linear(node, x, w, bias, kn)


def _input_key(x: torch.fx.Node):
    """Views of one tensor with one shape count as one input."""
    if is_call(x, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return (x.args[0], tuple(x.args[1]))
    return (x,)


def _group_by_input(linears):
    groups: dict[tuple, list[_Linear]] = {}
    for m in linears:
        key = (_input_key(m.x), val(m.weight).dtype, m.bias is None, m.kn)
        groups.setdefault(key, []).append(m)
    return [call for group in groups.values() for call in _calls(group)]


def _calls(group: list) -> list[list]:
    """A group of linears over one input as calls of at most LINEAR_MULTI_OUTPUTS
    outputs each, as even as can be (Cohere's parallel block reads its norm's
    output with q, k, v, gate and up: 3 + 2)."""
    n = -(-len(group) // LINEAR_MULTI_OUTPUTS)
    size, extra = divmod(len(group), n)
    starts = [i * size + min(i, extra) for i in range(n + 1)]
    return [group[a:b] for a, b in zip(starts, starts[1:])]


def _rewrite_group(gm, group: list[_Linear], read, params, arena, copies) -> None:
    """read: the group's copies (weights.group_copies)."""
    graph = gm.graph
    first = group[0].node
    with graph.inserting_before(first):
        w_node, *stacked_bias = [copy_node(gm, sources, params, storage, arena, copies) for sources, storage in read]
        bias = stacked_bias[0] if stacked_bias else group[0].bias
        if len(group) == 1:
            new = graph.call_function(ops.linear.default, (group[0].x, w_node, bias))
            new.meta["val"] = val(first)
            first.replace_all_uses_with(new)
        else:
            sizes = [val(m.weight).shape[0] for m in group]
            new = graph.call_function(ops.linear_multi.default, (group[0].x, w_node, bias, sizes))
            new.meta["val"] = [val(m.node) for m in group]
            for i, m in enumerate(group):
                with graph.inserting_before(first):
                    item = graph.call_function(operator.getitem, (new, i))
                item.meta["val"] = val(m.node)
                m.node.replace_all_uses_with(item)


def copy_node(gm, sources: list[torch.fx.Node], params, storage: weights.Storage, arena,
              copies: dict[str, weights.PlanCopy]) -> torch.fx.Node:
    """A get_attr of the sources' copy (also kwker.rewrite.experts' and
    .convolution's), made once however many calls read it (one linear applied
    to two inputs), or shared with other plans (weights.make_copy). Its fake
    value is the copy as the op reads it, the sources stacked along their first
    dim ([N, K] for linears); a K-blocked copy's real layout is in its
    CopiedWeight."""
    names = [s.name for s in sources]
    attr = next((a for a, c in copies.items() if c.sources == names and c.weight.storage == storage), None)
    if attr is None:
        # named by all its sources, apart from one that starts with the same source (q's alone
        # and stacked with k, v) or holds the same sources another way (a weight read as [K, N]
        # and as [N, K])
        base = "kwker_copy_of_" + "_".join(names)
        attr = next(a for a in itertools.chain([base], (f"{base}_{i}" for i in itertools.count(1)))
                    if not hasattr(gm, a))
        copies[attr] = weights.PlanCopy(names, weights.make_copy([params[n] for n in names], storage, arena))
        gm.register_buffer(attr, copies[attr].weight.copy)
    node = gm.graph.get_attr(attr)
    with val(sources[0]).fake_mode:  # made fresh: converting the real tensor took 1-4 ms each
        as_read = weights.copy_shape([val(s) for s in sources], replace(storage, block=0))
        node.meta["val"] = torch.empty(as_read, dtype=storage.dtype)
    return node
