"""A mixture of experts' projections in a graph a plan will replay: each of
transformers' grouped matmuls over the experts' weights becomes one
kwker.grouped_linear, which reads only the experts a call routes to.

transformers (integrations/moe.py, the default experts implementation) sorts
the token-expert pairs by expert, counts them per expert (histc, cumsum) and
calls `_grouped_mm(x, weight.transpose(-2, -1), offs)`: aten._grouped_mm where
PyTorch has it for the dtype (bf16 here), else its own
transformers::grouped_mm_fallback, a loop of torch.mm per expert. The weight is
a parameter [E, N, K], each expert's in a linear's layout; kwker.weights
decides whether the op reads it as stored or as a bf16 copy. Weights read as
stored keep PyTorch's grouped matmul from the rows per expert where a linear
would be oneDNN's: a 128-token prefill chunk of Mixtral-8x2-small in bf16 (32
rows an expert) measured 10-20 % slower on grouped_linear.
"""

import torch

from kwker import weights
from kwker.custom_ops import ops
from kwker.rewrite.linear import copy_node
from kwker.rewrite.match import aten, is_call, val


def _grouped_mm_targets() -> tuple:
    targets = [aten._grouped_mm.default]
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:  # registered when transformers' MoE integration is imported
        targets.append(fallback.default)
    return tuple(targets)


def planned_copies(gm: torch.fx.GraphModule, inputs: dict) -> list[tuple[list[torch.Tensor], weights.Storage]]:
    """The copies rewrite_experts will ask for, read off Dynamo's graph (inputs:
    its placeholders' example values, kwker.rewrite.planned_copies): the
    weights a grouped matmul reads transposed, once each. Mixtral-8x2-small's
    experts are 604 MB of bf16 copies."""
    targets = (torch._grouped_mm, *(t.overloadpacket for t in _grouped_mm_targets()[1:]))
    read = {}
    for n in gm.graph.nodes:
        wt = n.args[1] if n.op == "call_function" and n.target in targets and len(n.args) > 1 else None
        if isinstance(wt, torch.fx.Node) and wt.op == "call_method" and wt.target == "transpose" \
                and isinstance(inputs.get(wt.args[0]), torch.Tensor) and inputs[wt.args[0]].dim() == 3:
            read[wt.args[0]] = inputs[wt.args[0]]
    return [([w], storage) for w in read.values() if (storage := weights.decide_experts(w)) is not None]


def rewrite_experts(gm: torch.fx.GraphModule, params: dict[str, torch.Tensor],
                    arena: weights.WeightArena) -> tuple[int, dict[str, weights.PlanCopy]]:
    """params: placeholder name -> the real parameter tensor. Returns how many
    grouped matmuls were rewritten and the copies read (copy_node's)."""
    targets = _grouped_mm_targets()
    copies: dict[str, weights.PlanCopy] = {}
    copied: dict[str, torch.fx.Node] = {}  # a weight read by several calls is copied once
    count = 0
    for node in list(gm.graph.nodes):
        if not is_call(node, *targets) or node.kwargs or len(node.args) != 3:
            continue
        x, wt, offs = node.args
        if not (is_call(wt, aten.transpose.int) and sorted(a % 3 for a in wt.args[1:]) == [1, 2]):
            continue
        w = wt.args[0]
        if not (w.op == "placeholder" and w.name in params and val(w).dim() == 3 and val(x).dim() == 2
                and val(x).dtype == val(w).dtype):
            continue
        storage = weights.decide_experts(params[w.name])
        if storage is not None and not arena.admit([([w.name], storage)], params):
            storage = None
        rows = -(-weights.rows_per_call(val(x)) // val(w).shape[0])  # an expert's rows, on average
        if storage is None and weights.by_matmul(val(x).dtype, rows):
            continue  # PyTorch's grouped matmul, oneDNN's per expert: faster from these rows (as for a linear)
        with gm.graph.inserting_before(node):
            if storage is not None and w.name not in copied:
                copied[w.name] = copy_node(gm, [w], params, storage, arena, copies)
            new = gm.graph.call_function(ops.grouped_linear.default, (x, copied.get(w.name, w), offs))
        new.meta["val"] = val(node)
        node.replace_all_uses_with(new)
        count += 1
    return count, copies
