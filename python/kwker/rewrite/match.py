"""Small predicates the rewrites and the lowering use to read an ATen graph."""

import torch
from torch._higher_order_ops.effects import has_effects
from torch.fx import Node

aten = torch.ops.aten


def is_call(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def val(node: Node) -> torch.Tensor:
    return node.meta["val"]


def op_arguments(node: torch.fx.Node) -> dict:
    """An op node's arguments by their schema's names, positional and keyword
    alike, with the schema's defaults for those not given; empty for a node
    without a schema."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {}
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    return defaults | dict(zip((a.name for a in schema.arguments), node.args)) | node.kwargs


# What Dynamo's graph calls for torch.nn's convolutions (torch.nn.functional's are
# these); the ATen graph has aten.convolution for all of them.
TORCH_CONVOLUTIONS = frozenset({torch.conv1d, torch.conv2d, torch.conv3d})
TORCH_TRANSPOSED_CONVOLUTIONS = frozenset({torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d})


def convolution_operands(conv: Node) -> tuple:
    """A torch convolution call's input, weight and bias, each given by position
    or by keyword (None where absent)."""
    return tuple(conv.args[i] if len(conv.args) > i else conv.kwargs.get(name)
                 for i, name in enumerate(("input", "weight", "bias")))


def written_arguments(op: torch._ops.OpOverload, args, kwargs) -> list:
    """What a call of op writes by its schema (Tensor(a!)), each tensor of a
    Tensor(a!)[] (the _foreach_ and fused optimizer ops) on its own: a graph's
    nodes or a dispatched call's tensors, as given (None where absent)."""
    names = [a.name for a in op._schema.arguments if a.alias_info and a.alias_info.is_write]
    if not names:  # most ops: no dict of arguments made (every op of a trace is asked)
        return []
    given = dict(zip((a.name for a in op._schema.arguments), args)) | dict(kwargs)
    return list(flat([given.get(name) for name in names]))


# The libraries whose ops kwker sees into: each computes its outputs and writes
# what its schema marks written, is tagged where it draws random numbers and
# registered where it has other effects (aten._print). PyTorch's own
# (quantized_decomposed: PT2E's quantize and dequantize) and kwker's.
OPS_SEEN_INTO = frozenset({"aten", "prims", "quantized", "quantized_decomposed", "kwker"})


def why_run_only_as_called(node: Node) -> str | None:
    """Why node must run exactly as often as eager runs it, at its turn — never
    timed against another candidate (each run a call eager does not make),
    never folded into a constant — or None. An op PyTorch tags as seeded from
    the random generator, other than an attention whose dropout_p is 0 (tagged
    for its dropout, it draws nothing); an op of another library (a user's
    torch.library.custom_op may draw random numbers, print or count its calls);
    one PyTorch registers with effects (aten._print); a higher-order op (cond,
    flex_attention, auto_functionalized) calling any of these."""
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        args = list(flat((node.args, node.kwargs)))
        inner = [a for a in args if isinstance(a, torch._ops.OpOverload)]  # auto_functionalized's op
        subgraphs = [getattr(node.graph.owning_module, a.target) for a in args
                     if isinstance(a, Node) and a.op == "get_attr"]
        whys = [_why_op(op) for op in inner] + [why_run_only_as_called(n) for g in subgraphs
                                                 if isinstance(g, torch.fx.GraphModule) for n in g.graph.nodes]
        return next((f"{target.name()} over {why}" for why in whys if why), None)
    return _why_op(target, node) if isinstance(target, torch._ops.OpOverload) else None


def _why_op(op: torch._ops.OpOverload, node: Node | None = None) -> str | None:
    """node: the call, whose dropout_p is read; None for an op a higher-order op calls."""
    if op.namespace not in OPS_SEEN_INTO:
        return f"an op kwker cannot see into ({op}: it may draw random numbers or act outside the graph)"
    if torch.Tag.nondeterministic_seeded in op.tags and (node is None or op_arguments(node).get("dropout_p") != 0.0):
        return f"random ops ({op})"
    if has_effects(op):
        return f"an op with effects outside the graph ({op})"
    return None


def flat(tree):
    """The leaves of nested lists, tuples and dicts (a node's args and kwargs)."""
    if isinstance(tree, (list, tuple)):
        for x in tree:
            yield from flat(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from flat(x)
    else:
        yield tree


def fuse_each(gm: torch.fx.GraphModule, targets: tuple, fuse_one) -> int:
    """fuse_one(graph, node) for each call of one of targets (over a snapshot of
    the nodes: a fusion inserts some); the sum of what it returns."""
    return sum(fuse_one(gm.graph, node) for node in list(gm.graph.nodes) if is_call(node, *targets))


def last_dim_mean(node) -> bool:
    """node is x.mean(-1, keepdim=True), in x's own dtype."""
    if not (is_call(node, aten.mean.dim) and len(node.args) == 3 and node.args[2] is True and not node.kwargs):
        return False
    dims = node.args[1]
    return len(dims) == 1 and last_dim(dims[0], val(node.args[0]).dim())


def adds_eps(node) -> bool:
    """node is v + eps, eps a float (no alpha): a norm's variance made safe."""
    return (is_call(node, aten.add.Tensor, aten.add.Scalar) and len(node.args) == 2 and not node.kwargs
            and isinstance(node.args[1], float))


def last_dim(dim, ndim: int) -> bool:
    return dim in (-1, ndim - 1)


def only_user(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def other_arg(node: Node, known) -> object:
    """For a binary call with `known` as one argument, the other argument."""
    a, b = node.args[:2]
    if a is known:
        return b
    if b is known:
        return a
    return None


def strip_float_upcast(node):
    """x for x.to(float32) of a bfloat16 or float16 x (exact: an ATen _to_copy),
    else the node itself (a float64 or integer x rounds on the way)."""
    if (is_call(node, aten._to_copy.default) and node.kwargs.get("dtype") == torch.float32 and len(node.kwargs) == 1
            and val(node.args[0]).dtype in (torch.bfloat16, torch.float16)):
        return node.args[0]
    return node


def replace(graph, old: Node, target, args) -> Node:
    """Inserts target(*args) before `old`, moves old's users to it, and keeps
    old's fake value so later passes and the lowering still read shapes."""
    with graph.inserting_before(old):
        new = graph.call_function(target, tuple(args))
    new.meta["val"] = old.meta["val"]
    old.replace_all_uses_with(new)
    return new


def convolution_parameters(node: Node) -> tuple[list, list, list, bool, int]:
    """An aten.convolution's stride, padding, dilation, transposed and groups,
    each spatial list with one value per spatial dim of its weight (ATen reads
    a list of one, F.conv2d(x, w, stride=[2]), as that value for every dim)."""
    _, w, _, stride, padding, dilation, transposed, _, groups = node.args
    dims = val(w).dim() - 2
    return (*(list(v) * dims if len(v) == 1 else list(v) for v in (stride, padding, dilation)), transposed, groups)


def native_convolution(node: Node) -> str | None:
    """How kwker's plan runs an aten.convolution: "depthwise" (a 2-D one with one
    filter a channel over channels-last memory: ConvNeXt's, not MobileNet's
    NCHW), "patch" (a 2-D one whose kernel is its stride, unpadded: a linear
    over its patches), or None (oneDNN's, through ATen)."""
    x, w, y = val(node.args[0]), val(node.args[1]), val(node)
    stride, padding, dilation, transposed, groups = convolution_parameters(node)
    if transposed or w.dim() != 4:
        return None
    if w.shape[1] == 1 and groups == w.shape[0] == x.shape[1]:
        channels_last = all(t.shape[1] == 1 or t.stride(1) == 1 for t in (x, y))
        return "depthwise" if channels_last else None
    if groups == 1 and tuple(w.shape[2:]) == tuple(stride) and not any(padding) and tuple(dilation) == (1, 1):
        return "patch"
    return None
