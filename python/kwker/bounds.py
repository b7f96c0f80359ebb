"""Index inputs checked before a compiled graph that would abort on them.

Inductor's bounds check of an index throws inside an OpenMP parallel region
where the lookup is parallel, and the process aborts (stock Inductor's too,
at 8 x 512 token ids: one id past a served model's vocabulary ended every
request). So where a graph's embedding or indexing reads an input's values as
indices, each call of its Inductor graph (dynamo_backend.compile_with_inductor's,
freeze.FrozenGraph's) checks them first: an aminmax each (1.7 µs at 1 x 16 ids, 3.6 at
8 x 512); out of range, the graph runs eagerly, which raises eager's
IndexError. Indices the graph computes, or writes in place before it reads
them (`ids.clamp_(...)`), are not checked: an index computed out of range
still does what stock Inductor does.
"""

import operator

import torch

from kwker.tune import quiet

# Ops through which an input's values reach an index unchanged, or a subset of
# them (a view, a copy, a slice), in Dynamo's graph (methods, functions) and in ATen's.
_SAME_VALUES = {"view", "reshape", "contiguous", "flatten", "unsqueeze", "squeeze", "expand", "clone",
                operator.getitem, torch.reshape, torch.flatten, torch.unsqueeze, torch.squeeze,
                *(getattr(torch.ops.aten, name).default for name in
                  ("view", "_unsafe_view", "reshape", "unsqueeze", "expand", "clone", "alias")),
                torch.ops.aten.slice.Tensor, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims}


def index_inputs(gm: torch.fx.GraphModule, example_inputs) -> list[tuple[int, int, int]]:
    """(input position, lowest, highest index allowed) for each CPU integer
    input whose values an embedding (0 to rows - 1) or an indexing of a
    tensor's first dimension (-rows to rows - 1) reads as indices, directly or
    through _SAME_VALUES (the narrowest where several read them)."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
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
        if i is None or _written(indices) or not isinstance(value, torch.Tensor) or not value.dim() or \
                not isinstance(value.shape[0], int) or not _integer_cpu_tensor(example_inputs[i]):
            continue
        rows = value.shape[0]
        low, high = bounds.get(i, (-rows if wraps else 0, rows - 1))
        bounds[i] = (max(low, -rows if wraps else 0), min(high, rows - 1))
    return sorted((i, low, high) for i, (low, high) in bounds.items())


def out_of_range(checks: list[tuple[int, int, int]], args) -> bool:
    for i, low, high in checks:
        if args[i].numel():
            least, most = torch.aminmax(args[i])
            if least.item() < low or most.item() > high:
                return True
    return False


class IndicesChecked:
    """A compiled graph whose index inputs are checked before each call (see
    the module's docstring); out of range, Dynamo's graph runs eagerly."""

    def __init__(self, fn, gm: torch.fx.GraphModule, checks: list[tuple[int, int, int]]):
        self.fn, self.eager, self.checks = fn, quiet(gm), checks  # quiet: __call__ would print the failing line

    def __call__(self, *args):
        if out_of_range(self.checks, args):
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
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_method", "call_function") or not node.args \
            or node.target not in _SAME_VALUES:
        return False
    # x.view(dtype) reinterprets the bits; getitem's index must not be a tensor's (another gather)
    return not any(isinstance(a, torch.dtype) for a in node.args[1:]) and \
        (node.target is not operator.getitem or _plain_index(node.args[1]))


def _plain_index(index) -> bool:
    """Slices, integers, None and Ellipsis only."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or isinstance(p, (int, slice)) for p in parts)


def _written(node: torch.fx.Node) -> bool:
    """Whether the graph writes node's value in place, through it or a view of
    it (a user that is a method or function named with a trailing underscore,
    setitem, a mutable ATen op)."""
    for user in node.users:
        target = user.target
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
        if target is operator.setitem or name.endswith("_") and not name.endswith("__") or \
                isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            return True
        if user.op in ("call_method", "call_function") and target in _SAME_VALUES and user.args and \
                user.args[0] is node and _written(user):
            return True
    return False


def _integer_cpu_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cpu" and \
        x.dtype in (torch.int64, torch.int32, torch.int16, torch.int8)
