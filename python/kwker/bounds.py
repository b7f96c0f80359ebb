"""Index inputs checked before a compiled graph that would abort on them.

Inductor's bounds check of an index throws inside an OpenMP parallel region
where the lookup is parallel, and the process aborts (stock Inductor's too,
at 8 x 512 token ids: one id past a served model's vocabulary ended every
request). So where a graph's embedding or indexing of a tensor's rows reads
all of an input's values as indices, each call of its Inductor graph
(dynamo_backend.compile_with_inductor's, freeze.FrozenGraph's) checks them
first: an aminmax each (1.7 µs at 1 x 16 ids, 3.6 at 8 x 512); out of range,
the graph runs eagerly, which raises eager's IndexError. Not checked, and so
still doing what stock Inductor does: indices the graph computes (a cast, a
sum), a part of an input (`x[:, 0]`, which the whole input's check would
hold to the wrong table's rows), and an input the graph writes in place,
through any view of it (the check would read values from before the write).
A call whose index inputs share memory with an integer input the graph
writes runs eagerly: they may be views of it.
"""

import operator
from dataclasses import dataclass

import torch

from kwker.tune import quiet

# Ops through which all of an input's values reach an index unchanged (a view, a copy), in
# Dynamo's graph (methods, functions) and in ATen's.
_SAME_VALUES = {"view", "reshape", "contiguous", "flatten", "unsqueeze", "squeeze", "expand", "clone",
                torch.reshape, torch.flatten, torch.unsqueeze, torch.squeeze,
                *(getattr(torch.ops.aten, name).default for name in
                  ("view", "_unsafe_view", "reshape", "unsqueeze", "expand", "clone", "alias")),
                torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims}


@dataclass(frozen=True)
class IndexChecks:
    """What a call of a compiled graph is checked for before it runs."""

    bounds: tuple[tuple[int, int, int], ...]  # (input position, lowest, highest index allowed)
    written: tuple[int, ...]  # the positions of integer inputs the graph writes

    def __bool__(self) -> bool:
        return bool(self.bounds)

    def refuse(self, args) -> bool:
        """Whether this call must run eagerly: an index input out of range, or
        one that shares memory with an integer input the graph writes."""
        if self.written:
            memory = {args[i].untyped_storage().data_ptr() for i in self.written}
            if any(args[i].untyped_storage().data_ptr() in memory for i, _, _ in self.bounds):
                return True
        for i, low, high in self.bounds:
            if args[i].numel():
                least, most = torch.aminmax(args[i])
                if least.item() < low or most.item() > high:
                    return True
        return False


def index_inputs(gm: torch.fx.GraphModule, example_inputs) -> IndexChecks:
    """The CPU integer inputs all of whose values an embedding (0 to rows - 1)
    or an indexing of a tensor's first dimension (-rows to rows - 1) reads as
    indices, directly or through _SAME_VALUES, with their bounds (the
    narrowest where several read them); not one the graph writes."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    written = {placeholders[root] for root in _written_inputs(gm) if root in placeholders}
    written = tuple(sorted(i for i in written if _integer_cpu_tensor(example_inputs[i])))
    bounds: dict[int, tuple[int, int]] = {}
    for node in gm.graph.nodes:
        read = _indices_read(node)
        if read is None:
            continue
        indices, table, wraps = read
        while _same_values(indices):
            indices = indices.args[0]
        value = table.meta.get("example_value", table.meta.get("val")) if isinstance(table, torch.fx.Node) else None
        i = placeholders.get(indices) if isinstance(indices, torch.fx.Node) else None
        if i is None or i in written or not isinstance(value, torch.Tensor) or not value.dim() or \
                not isinstance(value.shape[0], int) or not _integer_cpu_tensor(example_inputs[i]):
            continue
        rows = value.shape[0]
        low, high = bounds.get(i, (-rows if wraps else 0, rows - 1))
        bounds[i] = (max(low, -rows if wraps else 0), min(high, rows - 1))
    return IndexChecks(tuple(sorted((i, low, high) for i, (low, high) in bounds.items())), written)


class IndicesChecked:
    """A compiled graph whose index inputs are checked before each call (see
    the module's docstring); refused, Dynamo's graph runs eagerly."""

    def __init__(self, fn, gm: torch.fx.GraphModule, checks: IndexChecks):
        self.fn, self.eager, self.checks = fn, quiet(gm), checks  # quiet: __call__ would print the failing line

    def __call__(self, *args):
        if self.checks.refuse(args):
            return self.eager(*args)
        return self.fn(*args)


def _indices_read(node: torch.fx.Node):
    """(the indices, the tensor they index, whether negative ones wrap) where
    node reads indices from a tensor's first dimension; else None."""
    if node.op != "call_function":
        return None
    args, kwargs = node.args, node.kwargs
    if node.target is torch.nn.functional.embedding:
        return _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"), False
    if node.target in (torch.embedding, torch.ops.aten.embedding.default):
        return _arg(args, kwargs, 1, "indices"), _arg(args, kwargs, 0, "weight"), False
    if node.target is operator.getitem and len(args) == 2:  # Dynamo's t[ids], t[ids, ...]
        first = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
        return first, args[0], True
    if node.target is torch.ops.aten.index.Tensor and len(args) == 2 and args[1]:
        return args[1][0], args[0], True
    return None


def _arg(args, kwargs, position: int, name: str):
    return args[position] if len(args) > position else kwargs.get(name)


def _same_values(node) -> bool:
    """Whether node gives all of its first argument's values unchanged (not
    x.view(dtype), which reinterprets their bits)."""
    return isinstance(node, torch.fx.Node) and node.op in ("call_method", "call_function") and bool(node.args) \
        and node.target in _SAME_VALUES and \
        not any(isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values()))


def _written_inputs(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes whose values the graph writes in place (a method or function
    named with a trailing underscore, setitem, a mutable ATen op, `out=`),
    each followed back through every op's first argument: the input (or
    other node) it may be a view of."""
    roots = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_method", "call_function"):
            continue
        target = node.target
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
        if "out" in node.kwargs:
            written = node.kwargs["out"]
        elif target is operator.setitem or name.endswith("_") and not name.endswith("__") or \
                isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            written = node.args[0] if node.args else None
        else:
            continue
        for root in written if isinstance(written, (tuple, list)) else (written,):
            while isinstance(root, torch.fx.Node) and root.op in ("call_method", "call_function") and root.args:
                root = root.args[0]
            if isinstance(root, torch.fx.Node):
                roots.add(root)
    return roots


def _integer_cpu_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cpu" and \
        x.dtype in (torch.int64, torch.int32, torch.int16, torch.int8)
