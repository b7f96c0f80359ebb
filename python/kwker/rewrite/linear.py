"""Linear layers: weights that read fewer bytes, and linears sharing an input as one call.

A float32 weight whose every value is exactly a bfloat16 value (a bf16
checkpoint loaded in float32) gets a bfloat16 copy: exact, half the bytes. Other
weights are used as stored. Linears that read the same input (q/k/v, gate/up)
become one linear_n over their weights stored back to back.
"""

import math
import operator
from collections import Counter
from dataclasses import dataclass

import torch

from kwker import _C
from kwker.custom_ops import ops
from kwker.rewrite.match import aten, is_call, val


@dataclass
class PackedWeight:
    """A weight (or a stacked bias) kwker made from the model's own: which
    placeholders it came from and their version counters when it was made, so a
    parameter changed in place is packed again before the next call."""

    attr: str
    sources: list[str]  # placeholder names, in the order they are stacked
    versions: list[int]


def is_bf16_valued(w: torch.Tensor) -> bool:
    return w.dtype == torch.float32 and w.device.type == "cpu" and _C.bf16_exact(w.detach().contiguous())


def pack_weights_dtype(weights: list[torch.Tensor]) -> torch.dtype:
    """bfloat16 when every weight is bf16 or exactly bf16-valued, else as stored."""
    to_bf16 = all(w.dtype == torch.bfloat16 or is_bf16_valued(w) for w in weights)
    return torch.bfloat16 if to_bf16 else weights[0].dtype


def weight_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """Memory for a weight kwker streams: kw_mem's, on 2 MiB pages where the
    kernel gives them (PyTorch's allocations get 4 KiB pages unless THP is
    "always"), zeroed."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(_C.weight_memory(nbytes), dtype=dtype).view(shape)


class WeightArena:
    """The memory of the weights kwker copies for one graph, reserved before the
    graph is traced to ATen and faulted in meanwhile by a thread of _C's: fresh
    memory faulted in at 0.5-1 GB/s on the VMs measured, about 1.5 s of a first
    compile for SmolLM2-360M's 724 MB of copies, now on the otherwise idle
    core. Copies are cut from it in order; close() returns the unused tail."""

    def __init__(self, nbytes: int):
        self.memory = _C.weight_reserve(nbytes) if nbytes else None
        self.capacity, self.used = nbytes, 0

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        count = math.prod(shape)
        start = -(-self.used // 64) * 64
        end = start + count * dtype.itemsize
        if self.memory is None or count == 0 or end > self.capacity:
            return weight_empty(shape, dtype)
        self.used = end
        return torch.frombuffer(self.memory, dtype=dtype, count=count, offset=start).view(shape)

    def close(self) -> None:
        if self.memory is not None:
            self.memory.trim(self.used)


def copied_weight_bytes(gm: torch.fx.GraphModule, example_inputs) -> int:
    """What rewrite_linears will copy, read off Dynamo's graph: the bf16-valued
    float32 linear weights as bfloat16, and the other weights and the biases of
    linears that share an input (stacked). The exactness scan runs again in the
    rewrite (on the ATen graph); at ~18 GB/s it costs less than reserving memory
    for a float32 model's weights that are never copied."""
    inputs = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs))
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch._C._nn.linear
               and len(n.args) > 1 and isinstance(inputs.get(n.args[1]), torch.Tensor)]
    sharing = Counter(n.args[0] for n in linears)
    copied = {}
    for n in linears:
        w, stacked = inputs[n.args[1]], sharing[n.args[0]] > 1
        bias = inputs.get(n.args[2]) if len(n.args) > 2 else None  # Dynamo passes nn.Linear's bias positionally
        if is_bf16_valued(w):
            copied[id(w)] = w.numel() * 2 + 64
        elif stacked:
            copied[id(w)] = w.nbytes + 64
        if stacked and isinstance(bias, torch.Tensor):
            copied[id(bias)] = bias.nbytes + 64
    return sum(copied.values())


def pack_weights(weights: list[torch.Tensor], dtype: torch.dtype, arena: WeightArena | None = None) -> torch.Tensor:
    """The bytes kwker reads for these weights (dtype: pack_weights_dtype's),
    stacked by rows, converted while copied: one pass, no intermediate copy."""
    shape = (sum(w.shape[0] for w in weights), *weights[0].shape[1:])
    packed = arena.empty(shape, dtype) if arena else weight_empty(shape, dtype)
    row = 0
    for w in weights:
        packed[row:row + w.shape[0]].copy_(w.detach())
        row += w.shape[0]
    return packed


def rewrite_linears(gm: torch.fx.GraphModule, params: dict[str, torch.Tensor], fuse: bool = True,
                    arena: WeightArena | None = None) -> int:
    """params: placeholder name -> the real parameter tensor; arena: where the
    copies go (else memory of their own). Every copy made is listed in
    gm.meta["kwker_packed"]."""
    linears = [_match_linear(n, params) for n in gm.graph.nodes]
    linears = [m for m in linears if m]
    groups = _group_by_input(linears) if fuse else [[m] for m in linears]
    gm.meta.setdefault("kwker_packed", [])
    for group in groups:
        dtype = pack_weights_dtype([params[m.weight.name] for m in group])
        if len(group) == 1 and dtype == val(group[0].weight).dtype:
            _rewrite_single_as_stored(gm.graph, group[0])
        else:
            _rewrite_group(gm, group, params, dtype, arena)
    return len(linears)


def _rewrite_single_as_stored(graph, m: "_Linear") -> None:
    """A weight read as stored: the parameter itself, no copy to keep fresh."""
    with graph.inserting_before(m.node):
        new = graph.call_function(ops.linear.default, (m.x, m.weight, m.bias))
    new.meta["val"] = val(m.node)
    m.node.replace_all_uses_with(new)


@dataclass
class _Linear:
    node: torch.fx.Node  # the mm / addmm
    x: torch.fx.Node
    weight: torch.fx.Node  # placeholder
    bias: torch.fx.Node | None


def _match_linear(node, params):
    if is_call(node, aten.mm.default):
        (x, wt), bias = node.args, None
    elif is_call(node, aten.addmm.default) and not node.kwargs:
        bias, x, wt = node.args[:3]
        if not (isinstance(bias, torch.fx.Node) and val(bias).dim() == 1):
            return None
    else:
        return None
    if not (is_call(wt, aten.t.default) or (is_call(wt, aten.permute.default) and list(wt.args[1]) == [1, 0])):
        return None
    w = wt.args[0]
    if not (w.op == "placeholder" and w.name in params and val(w).dim() == 2):
        return None
    if bias is not None and not (bias.op == "placeholder" and bias.name in params):
        return None
    return _Linear(node, x, w, bias)


def _input_key(x: torch.fx.Node):
    """Views of one tensor with one shape count as one input."""
    if is_call(x, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return (x.args[0], tuple(x.args[1]))
    return (x,)


def _group_by_input(linears):
    groups: dict[tuple, list[_Linear]] = {}
    for m in linears:
        key = (_input_key(m.x), val(m.weight).dtype, m.bias is None)
        groups.setdefault(key, []).append(m)
    return list(groups.values())


def _rewrite_group(gm, group: list[_Linear], params, dtype: torch.dtype, arena) -> None:
    graph = gm.graph
    first = group[0].node
    with graph.inserting_before(first):
        w_node = _packed_node(gm, [m.weight for m in group], params, dtype, arena)
        bias = group[0].bias
        if bias is not None and len(group) > 1:
            bias = _packed_node(gm, [m.bias for m in group], params, val(bias).dtype, arena)
        if len(group) == 1:
            new = graph.call_function(ops.linear.default, (group[0].x, w_node, bias))
            new.meta["val"] = val(first)
            first.replace_all_uses_with(new)
        else:
            sizes = [val(m.weight).shape[0] for m in group]
            new = graph.call_function(ops.linear_n.default, (group[0].x, w_node, bias, sizes))
            new.meta["val"] = [val(m.node) for m in group]
            for i, m in enumerate(group):
                with graph.inserting_before(first):
                    item = graph.call_function(operator.getitem, (new, i))
                item.meta["val"] = val(m.node)
                m.node.replace_all_uses_with(item)


def _packed_node(gm, sources: list[torch.fx.Node], params, dtype: torch.dtype, arena) -> torch.fx.Node:
    """A get_attr of the sources' parameters packed (pack_weights), recorded in
    gm.meta["kwker_packed"] to be packed again when one changes in place."""
    packed = gm.meta["kwker_packed"]
    attr = f"kwker_weight_{len(packed)}"
    gm.register_buffer(attr, pack_weights([params[s.name] for s in sources], dtype, arena))
    node = gm.graph.get_attr(attr)
    node.meta["val"] = _fake_like(val(sources[0]), getattr(gm, attr))
    packed.append(PackedWeight(attr, [s.name for s in sources], [params[s.name]._version for s in sources]))
    return node


def _fake_like(template_fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """A fake tensor in the graph's fake mode with the real tensor's metadata (made
    fresh: converting the real tensor took 1-4 ms each inside a compile)."""
    with template_fake.fake_mode:
        return torch.empty_strided(real.shape, real.stride(), dtype=real.dtype)
