"""bfloat16 convolutions in float32 where oneDNN has none in bfloat16.

Below AVX-512 PyTorch's oneDNN computes no bfloat16 convolution natively, and
its bf16 path took 8-70x the float32 one (kwker.weights.convolution_storage).
A bf16 convolution kwker's plan leaves to ATen (not one it runs natively:
match.native_convolution) then reads a float32 copy of its weight and bias
(kwker.weights, kept fresh by the plan) and its input widened by a native
step, and its output is rounded to bfloat16 by another: oneDNN's own bf16
arithmetic (products of bf16 values summed in float32, one rounding at the
end), in another order of summation.
"""

import torch

from kwker import weights
from kwker.rewrite.linear import copy_node
from kwker.rewrite.match import (TORCH_CONVOLUTIONS, TORCH_TRANSPOSED_CONVOLUTIONS, aten, convolution_operands, is_call,
                                 native_convolution, val)


def planned_copies(gm: torch.fx.GraphModule, inputs: dict) -> list[tuple[list[torch.Tensor], weights.Storage]]:
    """The copies convolutions_in_float32 will ask for, read off Dynamo's graph
    (inputs: its placeholders' example values, kwker.rewrite.planned_copies): the
    float32 copies of a bf16 convolution's weight and bias, once each. The
    convolutions kwker runs itself are told apart only on the ATen graph: theirs
    stays unused, at the arena's end, which its close() hands back."""
    read = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in TORCH_CONVOLUTIONS | TORCH_TRANSPOSED_CONVOLUTIONS:
            continue
        x, w, b = convolution_operands(n)
        if getattr(getattr(x, "meta", {}).get("example_value"), "dtype", None) != torch.bfloat16:
            continue
        if isinstance(inputs.get(w), torch.nn.Parameter) and weights.convolution_storage(inputs[w]) is not None:
            read.update({t: inputs[t] for t in (w, b) if isinstance(inputs.get(t), torch.nn.Parameter)})
    return [([t], storage) for t in read.values() if (storage := weights.convolution_storage(t)) is not None]


def convolutions_in_float32(gm: torch.fx.GraphModule, params: dict[str, torch.Tensor],
                            arena: weights.WeightArena) -> tuple[int, dict[str, weights.PlanCopy]]:
    """params: placeholder name -> the real parameter tensor. Returns how many
    convolutions were rewritten and the copies read (copy_node's)."""
    copies: dict[str, weights.PlanCopy] = {}
    copied: dict[torch.fx.Node, torch.fx.Node] = {}  # a parameter -> its copy's node, one copy however many read it
    count = 0
    for node in list(gm.graph.nodes):
        if not is_call(node, aten.convolution.default):
            continue
        x, w, b = node.args[:3]
        sources = [t for t in (w, b) if t is not None]
        if val(x).dtype != torch.bfloat16 or native_convolution(node) is not None \
                or any(t.op != "placeholder" or t.name not in params for t in sources):
            continue
        storage = weights.convolution_storage(params[w.name])
        if storage is None or (b is not None and params[b.name].dtype != torch.bfloat16) \
                or not arena.admit([([t.name], storage) for t in sources], params):
            continue
        graph = gm.graph
        with graph.inserting_before(node):
            for t in sources:
                if t not in copied:
                    copied[t] = copy_node(gm, [t], params, storage, arena, copies)
            read = [copied.get(t) for t in (w, b)]
            widened = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.float32})
            conv = graph.call_function(aten.convolution.default, (widened, *read, *node.args[3:]))
        with graph.inserting_after(conv):
            rounded = graph.call_function(aten._to_copy.default, (conv,), {"dtype": torch.bfloat16})
        with val(x).fake_mode:
            widened.meta["val"] = val(x).float()
            conv.meta["val"] = aten.convolution.default(widened.meta["val"], *(val(c) if c else None for c in read),
                                                        *node.args[3:])
            rounded.meta["val"] = conv.meta["val"].to(torch.bfloat16)
        node.replace_all_uses_with(rounded)
        graph.erase_node(node)
        count += 1
    return count, copies
