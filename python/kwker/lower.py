"""Lowering a rewritten ATen graph into a replay plan (kwker._C.PlanBuilder).

Every node's fake value gives its storage, strides and offset, so:
- each storage becomes one buffer: a graph input (bound on every call, after a
  check of its dtype, shape and strides), a constant (kwker's weight copies,
  values folded at compile time), a fresh output, or an arena region;
- a view op is no step at all, only another view of its input's buffer;
- an in-place op writes into its input's own memory (the cache is never copied);
- every other op is one native step, or a fallback step that calls PyTorch on
  views of the plan's memory (named in the report): where kwker has no native
  op, or where the native op rejects the call (a dtype its kernels lack).
A graph the plan cannot express raises NotLowerable, and the caller takes
another path.
"""

import logging
import math
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from kwker import _C
from kwker.custom_ops import GELU_MODES, LINEAR_MULTI_OUTPUTS, ROTARY_HALF, ops
from kwker.rewrite.match import convolution_parameters, flat, native_convolution, val, why_run_only_as_called
from kwker.weights import HUGE_PAGES_BELOW_ROWS, PlanCopy, by_matmul, rows_per_call

aten = torch.ops.aten
P = _C.op_params()
log = logging.getLogger(__name__)


class NotLowerable(Exception):
    """The graph has something a plan cannot express; the message says what."""


class _Rejected(Exception):
    """A native op's own rules reject this call (kwker._C.PlanBuilder.check_op)."""


@dataclass
class LoweringReport:
    native_steps: int = 0
    fallback_ops: list[str] = field(default_factory=list)


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def first_over_storage(inputs) -> list[int]:
    """For each input, the index of the first input over the same storage
    (its own where no earlier one shares it, and for a non-tensor)."""
    first = {}
    return [first.setdefault(storage_key(x), i) if isinstance(x, torch.Tensor) else i for i, x in enumerate(inputs)]


class _Lowering:
    def __init__(self, gm: torch.fx.GraphModule, example_inputs, copies: dict[str, PlanCopy],
                 input_names: list[str] | None, written_args=()):
        self.gm, self.example_inputs, self.copies, self.input_names = gm, example_inputs, copies, input_names
        self.written_args = list(written_args)
        self.b = _C.PlanBuilder()
        self.buffers: dict[int, tuple[int, int]] = {}  # storage -> (buffer id, element offset of its start)
        self.views: dict[tuple, int] = {}
        self.folded: dict[Node, torch.Tensor] = {}  # nodes evaluated at compile time
        self.constant_storages: set[int] = set()
        # storage -> the tensor its constant buffer was made from, where that is the
        # storage in its fake value's layout (not a weight copy's own layout)
        self.constant_tensors: dict[int, torch.Tensor] = {}
        # storages an in-place op writes (its result is the written tensor, the same storage)
        self.written_storages = {storage_key(t) for n in gm.graph.nodes if n.op == "call_function" and _is_inplace_op(n)
                                 for t in _tensor_vals(n)}
        self.done: set[Node] = set()  # nodes another node's lowering has carried out
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.report = LoweringReport()
        self.placeholder_index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        self.outputs = [a for a in flat(out_node.args[0])]
        # storage -> the returned tensor, when it is its whole storage: the fresh
        # output is then that tensor itself, with no view made per call
        self.output_storages = {storage_key(val(n)): val(n) for n in self.outputs if isinstance(n, Node)}

    # ---- buffers and views --------------------------------------------------------

    def declare_input(self, node: Node, index: int):
        t = self.example_inputs[index]
        if not isinstance(t, torch.Tensor):
            raise NotLowerable(f"input {node.name} is a {type(t).__name__}, not a tensor")
        if t.device.type != "cpu":
            raise NotLowerable(f"input {node.name} is on {t.device}")
        key = storage_key(val(node))
        if key in self.buffers:
            raise NotLowerable(f"inputs share storage ({node.name})")
        name = self.input_names[index] if self.input_names else node.name
        buf = self.b.input(name, t.dtype, tuple(t.shape), tuple(t.stride()), arg=index, type=type(t))
        self.buffers[key] = (buf, t.storage_offset())

    def declare_constant(self, node: Node, tensor: torch.Tensor):
        """tensor may have another layout than node's fake value (a K-blocked
        weight copy); only weight_view makes views of those."""
        tensor = tensor.detach()
        if storage_key(val(node)) in self.written_storages:
            return self.declare_written_constant(node, tensor)
        self.buffers[storage_key(val(node))] = (self.b.constant(tensor, node.name), tensor.storage_offset())
        self.constant_storages.add(storage_key(val(node)))
        if not (node.op == "get_attr" and node.target in self.copies):
            self.constant_tensors[storage_key(val(node))] = tensor
        self.folded[node] = tensor

    def declare_written_constant(self, node: Node, tensor: torch.Tensor):
        """A constant the graph then writes in place: the keys and values of a
        new StaticCache, whose layers a model's forward creates on its first call
        (torch.zeros, folded when traced; generate() creates them before), which
        the graph returns. Eager makes a new tensor each call, so every call
        copies the value into a buffer of its own (a fresh output where the graph
        returns it), and nothing is folded over it."""
        t = val(node)
        if storage_key(t) in self.buffers:
            return  # another node of the same storage: it is copied once, at the first
        self.new_storage(t, node.name)
        value = self.b.constant(tensor.contiguous(), f"{node.name}.value")
        source = self.b.view(value, tensor.dtype, tuple(tensor.shape), None, 0)
        try:
            self.op(node, "convert", [self.view(t), source])
        except _Rejected as e:
            raise NotLowerable(f"{node.name}: a constant written in place cannot be copied per call ({e})") from e

    def new_storage(self, t: torch.Tensor, name: str):
        """A buffer for storage an op creates: a fresh output if the graph returns it."""
        key = storage_key(t)
        if key in self.buffers:
            return
        nbytes = t.untyped_storage().nbytes()
        if key in self.output_storages:
            out = self.output_storages[key]
            if out.storage_offset() == 0 and out.is_contiguous() and out.nbytes == nbytes:
                buf = self.b.output_buffer(name, out.dtype, tuple(out.shape), tuple(out.stride()))
            else:
                buf = self.b.output_buffer(name, t.dtype, (nbytes // t.element_size(),), (1,))
        else:
            buf = self.b.arena(nbytes, name)
        self.buffers[key] = (buf, 0)

    def view(self, t: torch.Tensor) -> int:
        if not isinstance(t, torch.Tensor):  # a SymInt an op reads (JetMoE's routing sizes its experts' rows so)
            raise NotLowerable(f"a step reads a {type(t).__name__}, not a tensor")
        key = storage_key(t)
        if key not in self.buffers:
            raise NotLowerable("a tensor whose storage no step produced")
        buf, base = self.buffers[key]
        offset = (t.storage_offset() - base) * t.element_size()
        vkey = (buf, t.dtype, tuple(t.shape), tuple(t.stride()), offset)
        if vkey not in self.views:
            self.views[vkey] = self.b.view(buf, t.dtype, tuple(t.shape), tuple(t.stride()), offset)
        return self.views[vkey]

    def arg_view(self, a) -> int | None:
        return None if a is None else self.view(val(a))

    def weight_view(self, w: Node, x: Node) -> int:
        """A linear's weight: [N, K], or [K/B, N, B] when its copy is K-blocked
        (grouped_linear's: [E, N, K])
        (the copy's own layout, kwker.weights'). A model's own weight, read as
        stored by a linear of input x with few rows, is moved onto huge pages in
        place (weights.HUGE_PAGES_BELOW_ROWS)."""
        if w.op == "get_attr" and w.target in self.copies:
            t = self.folded[w]
            buf, _ = self.buffers[storage_key(val(w))]
            return self.b.view(buf, t.dtype, tuple(t.shape), tuple(t.stride()), 0)
        if w.op == "placeholder" and rows_per_call(val(x)) < HUGE_PAGES_BELOW_ROWS:
            _C.prefer_huge_pages(self.example_inputs[self.placeholder_index[w]])
        return self.view(val(w))

    def contiguous_copy(self, node: Node, t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
        """A view of t's values copied (converted to dtype) by a native step
        into a contiguous arena buffer of their own: for a kernel that reads
        contiguous rows of a value laid out otherwise (Whisper's residual stream
        is the transpose of its convolution's output, as eager lays it out), or
        for an op PyTorch computes in another dtype than t's."""
        copy = self.contiguous_buffer(node, t, dtype)
        self.op(node, "convert", [copy, self.view(t)])
        return copy

    def contiguous_buffer(self, node: Node, t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
        """A contiguous arena buffer of t's shape, in dtype (t's by default)."""
        dtype = dtype or t.dtype
        buf = self.b.arena(t.numel() * dtype.itemsize, f"{node.name}.{'contiguous' if dtype == t.dtype else dtype}")
        return self.b.view(buf, dtype, tuple(t.shape), None, 0)

    def fresh_copy(self, node: Node, t: torch.Tensor, fresh: dict) -> int:
        """A returned value the plan holds as a constant (folded at compile time:
        an arange, a literal), copied into a fresh output by every call, as
        eager makes a new tensor each time: a caller may write the one it gets.
        The values returned from one folded tensor (`c` and `c[1:]`) are views of
        one copy of it, so that a write to one shows in the other, as in eager;
        `fresh` holds those copies by storage. A weight copy (in its own layout)
        is copied for the one value."""
        key = storage_key(t)
        whole = self.constant_tensors.get(key)
        if whole is None:
            buf = self.b.output_buffer(f"{node.name}.fresh", t.dtype, tuple(t.shape))
            copy = self.b.view(buf, t.dtype, tuple(t.shape), None, 0)
            self.op(node, "convert", [copy, self.view(t)])
            return copy
        source, base = self.buffers[key]
        layout = (whole.dtype, tuple(whole.shape), tuple(whole.stride()))
        if key not in fresh:
            fresh[key] = self.b.output_buffer(f"{node.name}.fresh", *layout)
            self.op(node, "convert", [self.b.view(fresh[key], *layout, 0), self.b.view(source, *layout, 0)])
        return self.b.view(fresh[key], t.dtype, tuple(t.shape), tuple(t.stride()),
                           (t.storage_offset() - base) * t.element_size())

    # ---- steps --------------------------------------------------------------------

    def op(self, node: Node, name: str, views, ip=(), fp=()):
        """A native step; raises _Rejected, having added nothing, when the op's
        rules reject it (lower_call then adds a fallback step instead)."""
        why = self.b.check_op(name, list(views), list(ip), list(fp))
        if why is not None:
            raise _Rejected(why)
        self.b.op(name, list(views), list(ip), list(fp), label=node.name)
        self.report.native_steps += 1

    def lower_node(self, node: Node):
        if node.op == "placeholder":
            if node.users:  # a weight only copied from is the copy's watch's concern
                self.declare_input(node, self.placeholder_index[node])
        elif node.op == "get_attr":
            copy = self.copies.get(node.target)
            value = copy.weight.copy if copy else getattr(self.gm, node.target)
            if not isinstance(value, torch.Tensor):  # a higher-order op's subgraph, a quantized linear's packed weight
                users = ", ".join(sorted({str(u.target) for u in node.users}))
                kind = "subgraph" if isinstance(value, torch.fx.GraphModule) else type(value).__name__
                raise NotLowerable(f"{node.target} is a {kind}, not a tensor (read by {users}): "
                                   "plans hold tensors only")
            self.declare_constant(node, value)
        elif node.op == "call_function":
            self.lower_call(node)

    def lower_call(self, node: Node):
        if node.target is operator.getitem or node in self.done:
            return  # the producing op declared every output it writes; or another step did this one
        inputs = [a for a in flat((node.args, node.kwargs)) if isinstance(a, Node)]
        if all(a in self.folded for a in inputs) and not why_run_only_as_called(node):
            return self.fold(node)
        vals = _tensor_vals(node)
        if _is_view_op(node) or _restrides_only(node) or \
                (len(vals) == 1 and storage_key(vals[0]) in self.buffers and not _is_inplace_op(node)):
            return  # an alias (a view, or _unsafe_view): another view of its input's buffer
        if _is_inplace_op(node):
            lowering = INPLACE_LOWERINGS.get(node.target)
            why = "no native op" if lowering is None else "a case the native op does not cover"
            try:
                if lowering is not None and lowering(self, node) is not False:
                    return
            except _Rejected as e:
                why = str(e)
            return self.fallback(node, why)  # writes into the input's own memory, as the op does
        for i, t in enumerate(vals):
            self.new_storage(t, node.name if len(vals) == 1 else f"{node.name}.{i}")
        lowering = LOWERINGS.get(node.target)
        try:
            if lowering is None or lowering(self, node) is False:
                self.fallback(node, "no native op" if lowering is None else "a case the native op does not cover")
        except _Rejected as e:
            self.fallback(node, str(e))

    def fold(self, node: Node):
        result = _evaluate(node, self.folded)
        if not isinstance(result, torch.Tensor):
            raise NotLowerable(f"{node.name} folds to a {type(result).__name__}")
        if _is_view_op(node) and self._views_declared_constant(node, result):
            self.folded[node] = result  # read through the constant's own buffer, as any view
            return
        if _is_view_op(node) and storage_key(val(node)) in self.constant_tensors:
            # A copy of its own would replace that storage's buffer under every other view of it
            # (`a.t().view(torch.int32)` beside `a` returned: a's values came out transposed).
            raise NotLowerable(f"{node.name} views a constant in another dtype or layout than the constant's")
        self.declare_constant(node, result.contiguous() if _is_view_op(node) else result)

    def _views_declared_constant(self, node: Node, result: torch.Tensor) -> bool:
        """result (node's folded value, a view) lies in the tensor its storage's
        constant buffer was made from, where node's fake value says: a copy of
        its own would replace that storage's buffer, under every other view of
        it (a slice then read through a transpose's contiguous copy)."""
        base = self.constant_tensors.get(storage_key(val(node)))
        fake = val(node)
        return (base is not None and base.dtype == result.dtype
                and base.untyped_storage().data_ptr() == result.untyped_storage().data_ptr()
                and (result.storage_offset(), result.stride()) == (fake.storage_offset(), fake.stride()))

    def fallback(self, node: Node, why: str):
        inputs = [a for a in flat((node.args, node.kwargs)) if isinstance(a, Node)]
        reads = [self.view(val(a)) for a in inputs]
        writes = [self.view(t) for t in _tensor_vals(node)]
        self.b.fallback(_FallbackCall(node, inputs), reads, writes, label=node.name)
        self.report.fallback_ops.append(str(node.target))
        log.debug("%s: a fallback step (%s): %s", node.name, node.target, why)

    def run(self):
        for node in self.gm.graph.nodes:
            try:
                self.lower_node(node)
            except TypeError as e:  # a dtype plans do not hold (a float64 constant folded from a Python float)
                raise NotLowerable(f"{node.name}: {e}") from e
        fresh, copies = {}, {}
        for out in self.outputs:
            if not isinstance(out, Node):
                raise NotLowerable("the graph returns a non-tensor")
            if storage_key(val(out)) not in self.constant_storages:
                self.b.output(self.view(val(out)))
                continue
            if out not in copies:
                copies[out] = self.fresh_copy(out, val(out), fresh)
            self.b.output(copies[out])
        return self.b.finish(torch.get_num_threads(), n_args=len(self.example_inputs), written=self.written_args)

    def constant(self, node: Node) -> torch.Tensor | None:
        """node's value when the graph computes it from constants alone (a tensor
        literal), evaluated ahead of its turn where a lowering needs it then."""
        if node in self.folded:
            return self.folded[node]
        if any(storage_key(t) in self.written_storages for t in _tensor_vals(node)):
            return None  # written in place later: its value is not the one it was made with
        if node.op == "get_attr" and node.target not in self.copies:
            return getattr(self.gm, node.target)
        if node.op != "call_function" or node.target is operator.getitem or why_run_only_as_called(node):
            return None
        values = {a: self.constant(a) for a in flat((node.args, node.kwargs)) if isinstance(a, Node)}
        return None if any(v is None for v in values.values()) else _evaluate(node, values)


def _evaluate(node: Node, values: dict) -> object:
    """node's op run on real tensors: values holds each input node's."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        return node.target(*args, **kwargs)


class _FallbackCall:
    """Calls a node's ATen op on the plan's memory and writes the result into it."""

    def __init__(self, node: Node, inputs: list[Node]):
        self.target, self.name = node.target, node.name
        position = {n: i for i, n in enumerate(inputs)}
        self.args = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: _Read(position[a]))

    def __call__(self, reads, writes):
        args, kwargs = _substitute(self.args, reads)
        result = self.target(*args, **kwargs)
        for dst, src in zip(writes, flat(result)):
            dst.copy_(src)

    def __repr__(self):
        return f"fallback({self.name}: {self.target})"


@dataclass(frozen=True)
class _Read:
    index: int


def _substitute(tree, reads):
    if isinstance(tree, _Read):
        return reads[tree.index]
    if isinstance(tree, (list, tuple)):
        return type(tree)(_substitute(x, reads) for x in tree)
    if isinstance(tree, dict):
        return {k: _substitute(v, reads) for k, v in tree.items()}
    return tree


def _tensor_vals(node: Node) -> list[torch.Tensor]:
    return [t for t in flat(node.meta.get("val")) if isinstance(t, torch.Tensor)]


def _returns_alias(node: Node, write: bool) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and alias.is_write == write


def _is_view_op(node: Node) -> bool:
    return _returns_alias(node, write=False)


def _is_inplace_op(node: Node) -> bool:
    return _returns_alias(node, write=True)


# In-place ops that change a tensor's view of its memory, not the memory.
_RESTRIDES = {aten.as_strided_.default, aten.transpose_.default, aten.t_.default, aten.squeeze_.default,
              aten.squeeze_.dim, aten.squeeze_.dims, aten.unsqueeze_.default, aten.swapdims_.default,
              aten.swapaxes_.default}


def _restrides_only(node: Node) -> bool:
    """An in-place op of _RESTRIDES (a channels_last mean's keepdim output
    restrided with as_strided_): another view of its input's buffer, as a
    view op's. Raises NotLowerable where a later op reads the input, whose
    view eager changed under it and the plan would not."""
    if node.target not in _RESTRIDES:
        return False
    source = node.args[0]
    later = node.next
    while later.op != "output" and later not in source.users:
        later = later.next
    if later in source.users:  # the output too: it would return the view from before
        raise NotLowerable(f"{node.name} ({node.target}) changes the view of {source.name}, which {later.name} "
                           "reads after it")
    return True


# ---- native steps, one function per op --------------------------------------------------
# Each takes the lowering and the node, emits steps, and returns False to ask for a
# fallback instead (a case the native op does not cover).


def _lower_linear(lw: _Lowering, node: Node):
    """kwker's GEMV for the few rows of decode; oneDNN's matmul from the row
    count where it measured faster (kw_ops.h), when the weight is [N, K] in x's
    dtype (matmul_dnnl refuses the rest; linear takes them)."""
    x, w, bias = node.args
    _linear_step(lw, node, [lw.view(val(node)), lw.view(val(x)), lw.weight_view(w, x), lw.arg_view(bias)], val(x))


def _linear_step(lw: _Lowering, node: Node, views, x: torch.Tensor):
    """views (y, x, weight, bias) as oneDNN's matmul from its crossover for x's
    rows, else (or where it refuses them) as kwker's linear."""
    if by_matmul(x.dtype, rows_per_call(x)):
        try:
            return lw.op(node, "matmul_dnnl", views)
        except _Rejected:
            pass
    lw.op(node, "linear", views)


def _lower_linear_multi(lw: _Lowering, node: Node):
    x, w, bias, sizes = node.args
    outs = [lw.view(t) for t in val(node)]
    if len(outs) > LINEAR_MULTI_OUTPUTS:
        return False
    outs += [None] * (LINEAR_MULTI_OUTPUTS - len(outs))
    lw.op(node, "linear_multi", [*outs, lw.view(val(x)), lw.weight_view(w, x), lw.arg_view(bias)])


def _lower_grouped_linear(lw: _Lowering, node: Node):
    x, w, offs = node.args
    lw.op(node, "grouped_linear", [lw.view(val(node)), lw.view(val(x)), lw.weight_view(w, x), lw.view(val(offs))])


def _lower_rms_norm(lw: _Lowering, node: Node):
    x, w, eps, form = node.args
    _lower_row_norm(lw, node, "rms_norm", val(node), val(x), [lw.view(val(w))], [form], [eps])


def _lower_row_norm(lw: _Lowering, node: Node, name: str, out: torch.Tensor, x: torch.Tensor, params: list,
                    ip: list, fp: list):
    """A norm over the last dim of x into out, params its other views. Rows the
    kernel does not take as laid out (not evenly strided: Gemma 3's q/k norms over a
    chunk's heads, transposed, and their output laid out as x) are normalised
    between contiguous copies, which cost less than PyTorch's norm as a fallback
    step. Raises _Rejected, having added no step, when no layout is taken."""
    views = [lw.view(out), lw.view(x), *params]
    if lw.b.check_op(name, views, ip, fp) is None:
        return lw.op(node, name, views, ip, fp)
    x_copy = lw.contiguous_buffer(node, x)
    copied = [views[0], x_copy, *params]
    if lw.b.check_op(name, copied, ip, fp) is not None:
        copied[0] = lw.contiguous_buffer(node, out)
    why = lw.b.check_op(name, copied, ip, fp)
    if why is not None:
        raise _Rejected(why)
    lw.op(node, "convert", [x_copy, views[1]])
    lw.op(node, name, copied, ip, fp)
    if copied[0] != views[0]:
        lw.op(node, "convert", [views[0], copied[0]])


def _lower_add_rms_norm(lw: _Lowering, node: Node):
    x, y, w, eps, form = node.args
    residual, normed = val(node)
    views = [lw.view(normed), lw.view(residual), lw.view(val(x)), lw.view(val(y)), lw.view(val(w))]
    lw.op(node, "add_rms_norm", views, [form], [eps])


def _lower_rotary(lw: _Lowering, node: Node):
    """cos and sin of one dtype: of two, eager rounds x·cos to the narrower one
    before the sum, which the kernel does not (the op's reference runs)."""
    x, cos, sin = node.args
    if val(cos).dtype != val(sin).dtype:
        return False
    views = [lw.view(val(node)), lw.view(val(x)), lw.view(val(cos)), lw.view(val(sin))]
    lw.op(node, "rotary", views, ROTARY_HALF)


def _lower_silu_mul(lw: _Lowering, node: Node):
    gate, up = node.args
    lw.op(node, "silu_mul", [lw.view(val(node)), lw.view(val(gate)), lw.view(val(up))])


def _lower_gelu_mul(lw: _Lowering, node: Node):
    gate, up, approximate = node.args
    views = [lw.view(val(node)), lw.view(val(gate)), lw.view(val(up))]
    lw.op(node, "gelu_mul", views, [GELU_MODES[approximate]])


def _lower_attention(lw: _Lowering, node: Node):
    q, k, v, mask, scale = node.args
    views = [lw.view(val(node)), lw.view(val(q)), lw.view(val(k)), lw.view(val(v)), lw.arg_view(mask)]
    lw.op(node, "attention", views, [], [scale])


def _lower_layer_norm(lw: _Lowering, node: Node):
    """native_layer_norm over the last dim whose mean and rstd nothing reads
    (inference), its weight and bias of one dtype, x's or float32, as PyTorch
    takes them (its own raises for the others, as it should here)."""
    x, shape, weight, bias, eps = node.args
    out, mean, rstd = val(node)
    if list(shape) != [val(x).shape[-1]] or any(u.args[1] != 0 for u in node.users):
        return False
    params = {val(p).dtype for p in (weight, bias) if p is not None}
    if len(params) > 1 or not params <= {val(x).dtype, torch.float32}:
        return False
    _lower_row_norm(lw, node, "layer_norm", out, val(x), [lw.arg_view(weight), lw.arg_view(bias)], [], [eps])


def _lower_softmax(lw: _Lowering, node: Node):
    x, dim, half_to_float = node.args
    if half_to_float or dim % val(x).dim() != val(x).dim() - 1:
        return False
    lw.op(node, "softmax", [lw.view(val(node)), lw.view(val(x))], [0])


def _lower_safe_softmax(lw: _Lowering, node: Node):
    """_safe_softmax (SDPA's math path): softmax, but a row of -inf alone is zeros."""
    x, dim = node.args[:2]
    if dim % val(x).dim() != val(x).dim() - 1:
        return False
    lw.op(node, "softmax", [lw.view(val(node)), lw.view(val(x))], [P["SOFTMAX_SAFE"]])


def _lower_embedding(lw: _Lowering, node: Node):
    table, ids = node.args[:2]
    lw.op(node, "embedding", [lw.view(val(node)), lw.view(val(ids)), lw.view(val(table))], [0])


def _lower_index(lw: _Lowering, node: Node):
    """table[ids]: rows of a 1-D or 2-D tensor (a 1-D one as rows of one) picked
    by one integer index tensor, negative ids from the end. A mixture of
    experts' routing gathers its rows and weights so. Also table[:, :, ids]
    where the dims before the indexed one are all of size 1 (Falcon's decode
    step): the same rows of table[0, 0]."""
    table, indices = node.args
    lead = len(indices) - 1
    if not indices or any(i is not None for i in indices[:-1]) or not isinstance(indices[-1], Node):
        return False
    y, rows = val(node), val(table)
    if any(n != 1 for n in rows.shape[:lead]):
        return False
    y, rows = y[(0,) * lead], rows[(0,) * lead]
    if rows.dim() not in (1, 2):
        return False
    _gather_rows(lw, node, y, rows, val(indices[-1]), P["GATHER_WRAP"])


def _lower_index_select(lw: _Lowering, node: Node):
    """index_select(table, 0, ids): rows of a 1-D or 2-D table (XGLM's
    sinusoidal positions); an id out of range raises, as index_select does."""
    table, dim, ids = node.args[:3]
    rows = val(table)
    if rows.dim() not in (1, 2) or dim % rows.dim() != 0 or val(ids).dim() != 1:
        return False
    _gather_rows(lw, node, val(node), rows, val(ids), 0)


def _gather_rows(lw: _Lowering, node: Node, y, rows, ids, mode: int):
    """y = rows[ids] as the embedding step (ip[0] mode), rows 2-D or 1-D (rows of one)."""
    if rows.dim() == 1:
        y, rows = y.unsqueeze(-1), rows.unsqueeze(-1)
    lw.op(node, "embedding", [lw.view(y), lw.view(ids), lw.view(rows)], [mode])


def _lower_index_put(lw: _Lowering, node: Node):
    """y[ids] = src in place (index_put_ with one index tensor, not accumulating):
    rows of a 1-D or 2-D y, negative ids from the end. A mixture of experts'
    routing writes its inverse permutation so. Or ids a constant along another
    dim (_index_put_constant)."""
    y, indices, src = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if accumulate or not isinstance(src, Node) or not indices:
        return False
    if len(indices) > 1 or indices[0] in lw.folded:
        return _index_put_constant(lw, node)
    if not isinstance(indices[0], Node):
        return False
    rows, ids, values = val(y), val(indices[0]), val(src)
    if rows.dim() not in (1, 2) or ids.dim() != 1 or values.dim() > rows.dim():
        return False
    if _writes_over_what_it_reads(rows) or storage_key(rows) in (storage_key(ids), storage_key(values)):
        return False  # eager raises, or reads what it has written
    try:  # values broadcast to the rows written, as PyTorch's do
        values = values.expand(ids.shape[0], *rows.shape[1:])
    except RuntimeError:
        return False
    if rows.dim() == 1:
        rows, values = rows.unsqueeze(-1), values.unsqueeze(-1)
    lw.op(node, "index_put", [lw.view(rows), lw.view(ids), lw.view(values)])


# The most positions a constant index may write as copies, one step each.
MAX_CONSTANT_INDICES = 16


def _index_put_constant(lw: _Lowering, node: Node):
    """y[:, ..., ids] = src where ids is a constant 1-D int tensor of distinct
    positions along one dim and every other index is None (`:`): a copy per
    position. transformers' full sliding-window cache writes its last position
    so (`new_keys[:, :, torch.tensor([-1])] = key_states`)."""
    y, indices, src = val(node.args[0]), node.args[1], val(node.args[2])
    picked = [d for d, i in enumerate(indices) if i is not None]
    if len(picked) != 1 or indices[picked[0]] not in lw.folded:
        return False
    dim, ids = picked[0], lw.folded[indices[picked[0]]]
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32) or not 0 < len(ids) <= MAX_CONSTANT_INDICES:
        return False
    if src.dtype != y.dtype:
        return False  # eager raises
    n = y.shape[dim]
    positions = [int(i) + n if int(i) < 0 else int(i) for i in ids]
    if not all(0 <= p < n for p in positions) or len(set(positions)) != len(positions):
        return False  # out of range: eager raises; repeated: which write wins is not defined
    try:
        values = src.expand(*y.shape[:dim], len(positions), *y.shape[dim + 1:])
    except RuntimeError:
        return False
    if _writes_over_what_it_reads(y, values):
        return False
    for k, p in enumerate(positions):
        lw.op(node, "convert", [lw.view(y.select(dim, p)), lw.view(values.select(dim, k))])


def _lower_copy_into(lw: _Lowering, node: Node):
    """dst.copy_(src): src broadcast to dst and converted to its dtype. Where
    dst is not dense (torch._debug_has_internal_overlap cannot tell whether
    it overlaps itself: a pad's interior or borders), or src lies elsewhere in
    dst's storage (a circular pad copies the padded tensor's edges into its
    borders), the elements are enumerated: distinct in dst and none in src,
    the copy is native, src copied out first where the two views' spans
    overlap, which a step may not have."""
    dst, src = val(node.args[0]), val(node.args[1])
    try:
        src = src.expand(dst.shape)
    except RuntimeError:
        return False
    if not _writes_over_what_it_reads(dst, src):
        return lw.op(node, "convert", [lw.view(dst), lw.view(src)])
    if not _distinct_elements(dst, src):
        return False
    same_storage = storage_key(src) == storage_key(dst)
    lw.op(node, "convert", [lw.view(dst), lw.contiguous_copy(node, src) if same_storage else lw.view(src)])


def _distinct_elements(dst: torch.Tensor, src: torch.Tensor, most: int = 1 << 20) -> bool:
    """No element of dst is another of dst's, nor, over one storage, one of
    src's. False where either has more than `most` elements, whose offsets
    are not enumerated."""
    if dst.numel() > most or src.numel() > most:
        return False
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        def offsets(t):
            off = torch.tensor([t.storage_offset()], dtype=torch.int64)
            for size, stride in zip(t.shape, t.stride()):
                off = (off[:, None] + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
            return off

        written = offsets(dst)
        if written.unique().numel() != written.numel():
            return False
        return storage_key(src) != storage_key(dst) or not torch.isin(written, offsets(src)).any().item()


def _lower_roll(lw: _Lowering, node: Node):
    """roll along one dim: two copies (y[s:] = x[:n-s], y[:s] = x[n-s:], s the
    shift modulo n), or, as a full sliding-window cache takes a position,
    one kv_shift in place (_cache_shift)."""
    x, y = val(node.args[0]), val(node)
    shifts = node.args[1]
    dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", [])
    if len(shifts) != 1 or len(dims) != 1 or x.dim() == 0 or x.numel() == 0:  # empty: no copies to make
        return False
    dim = dims[0] % x.dim()
    n = x.shape[dim]
    s = shifts[0] % n
    if s == n - 1 and _cache_shift(lw, node, dim):
        return
    lw.op(node, "convert", [lw.view(y.narrow(dim, s, n - s)), lw.view(x.narrow(dim, 0, n - s))])
    if s:
        lw.op(node, "convert", [lw.view(y.narrow(dim, 0, s)), lw.view(x.narrow(dim, n - s, s))])


def _cache_shift(lw: _Lowering, roll: Node, dim: int) -> bool:
    """transformers' full sliding-window cache takes a token as
        t = cache.roll(-1, dims=2); t[:, :, tensor([-1])] = src; cache.copy_(t)
    which reads and writes the whole cache twice. When t is read by nothing
    else and nothing in between touches the cache, the three are one kv_shift
    in place, at the roll: its result is the cache the copy_ leaves. The
    index_put_ and copy_ are then done (lw.done)."""
    cache = roll.args[0]
    users = list(roll.users)
    put = next((u for u in users if u.target is aten.index_put_.default and u.args[0] is roll), None)
    copy = next((u for u in [*users, *(put.users if put else ())]
                 if u.target is aten.copy_.default and u.args[0] is cache and u.args[1] in (roll, put)), None)
    if dim != 2 or put is None or copy is None or set(users) - {put, copy} or set(put.users) - {copy}:
        return False
    indices, src = put.args[1], put.args[2]
    if len(put.args) > 3 or put.kwargs or len(indices) != 3 or indices[:2] != [None, None]:
        return False
    n, ids = val(cache).shape[2], lw.constant(indices[2]) if isinstance(indices[2], Node) else None
    if (not isinstance(ids, torch.Tensor) or ids.shape != (1,) or ids.dtype not in (torch.int64, torch.int32)
            or int(ids[0]) % n != n - 1):
        return False
    if not isinstance(src, Node) or storage_key(val(src)) not in lw.buffers:
        return False  # src's values are made after the roll
    x, v = val(cache), val(src)
    try:  # src broadcast to the position written, as index_put_ does
        v = v.expand(x.narrow(2, n - 1, 1).shape)
    except RuntimeError:
        return False
    if v.dtype != x.dtype or storage_key(v) == storage_key(x):
        return False
    for nd in lw.gm.graph.nodes:  # between the roll and the copy_: nothing reads the cache or writes src
        if lw.order[roll] < lw.order[nd] < lw.order[copy] and nd is not put:
            touched = {storage_key(t) for a in flat((nd.args, nd.kwargs)) if isinstance(a, Node)
                       for t in _tensor_vals(a)}
            if storage_key(x) in touched or (_is_inplace_op(nd) and storage_key(v) in touched):
                return False
    try:
        lw.op(roll, "kv_shift", [lw.view(x), lw.view(v)])
    except _Rejected:
        return False
    lw.done.update((put, copy))
    return True


def _lower_histc(lw: _Lowering, node: Node):
    """torch.histc over float32 with min < max (min == max takes them from the data)."""
    x, _, lo, hi = [*node.args, *(100, 0, 0)[len(node.args) - 1:]]  # bins: y's size
    if node.kwargs or val(x).dtype != torch.float32 or not math.isfinite(lo) or not math.isfinite(hi):
        return False  # an infinite range: eager raises
    lw.op(node, "histc", [lw.view(val(node)), lw.view(val(x))], [], [float(lo), float(hi)])


def _along_last_dim(x: torch.Tensor, dim: int) -> bool:
    """dim (negative from the end) is x's last (a 0-dim tensor's only) dim."""
    ndim = max(x.dim(), 1)
    return dim % ndim == ndim - 1


def _lower_cumsum(lw: _Lowering, node: Node):
    """cumsum along the last dim; x.to(dtype) first, into y, when dtype converts it."""
    x, dim = node.args[:2]
    y = val(node)
    if not _along_last_dim(val(x), dim) or y.dtype not in (torch.int32, torch.int64, torch.float32):
        return False
    if val(x).dtype != y.dtype:
        lw.op(node, "convert", [lw.view(y), lw.view(val(x))])
        x = node
    lw.op(node, "cumsum", [lw.view(y), lw.view(val(x))])


def _lower_topk(lw: _Lowering, node: Node):
    """torch.topk along the last dim, in PyTorch's own order among equal values
    (ops/sort.c)."""
    x, k, dim, largest, is_sorted = [*node.args, *(-1, True, True)[len(node.args) - 2:]]
    if node.kwargs or not _along_last_dim(val(x), dim):
        return False
    values, indices = val(node)
    lw.op(node, "topk", [lw.view(values), lw.view(indices), lw.view(val(x))], [int(largest), int(is_sorted)])


# Ops whose output holds exactly the values of their first argument's, none twice.
_SAME_VALUES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
                aten.squeeze.dim, aten.unsqueeze.default, aten.flatten.using_ints}


def _distinct_values(x: Node) -> bool:
    """x holds no value twice, as far as the graph shows: the indices topk
    picked from a single row (a token's experts), seen through reshapes."""
    while x.target in _SAME_VALUES:
        x = x.args[0]
    if not (x.target is operator.getitem and x.args[1] == 1 and isinstance(x.args[0], Node)
            and x.args[0].target is aten.topk.default):
        return False
    topk = x.args[0]
    source = val(topk.args[0])
    dim = topk.kwargs.get("dim", topk.args[2] if len(topk.args) > 2 else -1)
    return source.numel() == source.shape[dim % source.dim()] if source.dim() else True


def _lower_sort(lw: _Lowering, node: Node):
    """torch.sort along the last dim. Native where its order is unique: a stable
    sort, or keys no two of which are equal (ops/sort.c sorts stably; PyTorch's
    default unstable sort orders equal keys its own way)."""
    x = node.args[0]
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else -1)
    descending = node.kwargs.get("descending", node.args[2] if len(node.args) > 2 else False)
    stable = node.target is aten.sort.stable and bool(node.kwargs.get("stable"))
    if not _along_last_dim(val(x), dim) or not (stable or _distinct_values(x)):
        return False
    values, indices = val(node)
    lw.op(node, "sort", [lw.view(values), lw.view(indices), lw.view(val(x))], [int(descending)])


def _lower_empty(lw: _Lowering, node: Node):
    """Memory whose contents are undefined: a step that does nothing but count
    it as written (capture refuses a read of memory no step has written)."""
    lw.op(node, "nop", [lw.view(val(node))])


def _writes_over_what_it_reads(y: torch.Tensor, *reads) -> bool:
    """An in-place write whose destination overlaps itself (a stride of 0) or
    part of what it reads: eager raises for these, so the fallback must run them."""
    if torch._debug_has_internal_overlap(y) != 0:
        return True
    same_view = lambda t: (t.storage_offset(), t.shape, t.stride()) == (y.storage_offset(), y.shape, y.stride())
    return any(storage_key(t) == storage_key(y) and not same_view(t) for t in reads)


def _binary_scalar(name: str, a: torch.Tensor, b) -> float | None:
    """b as the binary op's fp[0], or None where a float64 cannot carry it as
    ATen would use it: an int64 beyond 2^53; for bf16 add and sub ATen rounds
    the scalar to bf16 first (mul and div use it as it is)."""
    if isinstance(b, bool) or not isinstance(b, (int, float)):
        return None
    if isinstance(b, int) and abs(b) > 2**53:
        return None
    if a.dtype == torch.bfloat16 and name in ("BINARY_ADD", "BINARY_SUB"):
        return float(torch.tensor(b, dtype=torch.bfloat16))
    return float(b)


def _binary(name):
    """a (op) b, b a tensor or a Python number; the in-place form (add_, div_, ...)
    writes a's own memory. An integer tensor in an op whose result is floating
    (positions / a length: true division) is converted first, as TensorIterator
    casts it to the result's dtype before the op; not a 0-d one under a bf16
    result, whose exact value ATen multiplies or divides by (a scalar's)."""

    def lower(lw: _Lowering, node: Node):
        a, b = node.args[:2]
        alpha = node.args[2] if len(node.args) > 2 else node.kwargs.get("alpha", 1)  # positional in add.Scalar
        if alpha != 1 or not isinstance(a, Node):
            return False
        inplace = _is_inplace_op(node)
        if inplace and _writes_over_what_it_reads(val(a), *([val(b)] if isinstance(b, Node) else [])):
            return False
        y = val(a) if inplace else val(node)

        def converted(t: torch.Tensor) -> bool:
            return y.is_floating_point() and t.dtype in (torch.int64, torch.int32)

        operands = [val(a)] + ([val(b)] if isinstance(b, Node) else [])
        if y.dtype != torch.float32 and any(converted(t) and t.dim() == 0 for t in operands):
            return False

        def operand(t: torch.Tensor) -> int:
            return lw.contiguous_copy(node, t, y.dtype) if converted(t) else lw.view(t)

        if isinstance(b, Node):
            return lw.op(node, "binary", [lw.view(y), operand(val(a)), operand(val(b))], [P[name]], [0.0])
        scalar = _binary_scalar(name, y, b)  # y has a's dtype, or the one a is converted to
        if scalar is None:
            return False
        lw.op(node, "binary", [lw.view(y), operand(val(a)), None], [P[name]], [scalar])

    return lower


def _compare(name):
    """a (op) b into a bool tensor: a and b of one dtype, or b a Python number,
    which compare casts to a's dtype as ATen does (a float one into an integer
    tensor's comparison is ATen's float comparison: left to it)."""

    def lower(lw: _Lowering, node: Node):
        a, b = node.args[:2]
        if not isinstance(a, Node):
            return False
        y, at = lw.view(val(node)), val(a)
        if isinstance(b, Node):
            if val(b).dtype != at.dtype:
                return False
            return lw.op(node, "compare", [y, lw.view(at), lw.view(val(b))], [P[name]], [0.0])
        if isinstance(b, bool) or not isinstance(b, (int, float)) or (isinstance(b, float) and not at.is_floating_point()):
            return False
        if isinstance(b, int) and abs(b) > 2**53:  # a float64 fp[0] would round it
            return False
        lw.op(node, "compare", [y, lw.view(at), None], [P[name]], [float(b)])

    return lower


def _lower_bmm(lw: _Lowering, node: Node):
    """bmm(a, b), baddbmm(c, a, b, beta=, alpha=): y = alpha · (a @ b) + beta · c,
    c broadcast to y. a and b are read where they lie when bmm's layouts allow
    (BLOOM's kᵀ is a transposed view of its cache's rows, its V the rows
    themselves), else from native contiguous copies. Up to BMM_MAX_M rows of a
    per batch (kw_ops.h): more are ATen's (a fallback step)."""
    if node.target is aten.bmm.default:
        (a, b), c, alpha, beta = node.args[:2], None, 1.0, 0.0
    else:
        c, a, b = node.args[:3]
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    y = val(node)
    if y.shape[1] > P["BMM_MAX_M"] or any(not isinstance(x, (int, float)) or isinstance(x, bool) for x in (alpha, beta)):
        return False
    if c is not None and (not isinstance(c, Node) or val(c).dtype != y.dtype):
        return False
    views = [lw.view(y), lw.view(val(a)), lw.view(val(b)), None if c is None else lw.view(val(c).expand(y.shape))]
    fp = [float(alpha), float(beta)]
    if lw.b.check_op("bmm", views, [], fp) is not None:
        views[1:3] = lw.contiguous_copy(node, val(a)), lw.contiguous_copy(node, val(b))
    lw.op(node, "bmm", views, [], fp)


def _lower_small_sum(lw: _Lowering, node: Node):
    """sum over one dim of 1 or 2 values (a top-1 or top-2 router's weights, a
    mixture of two experts' outputs), or of 3 or 4 float32 ones (a top-3 or
    top-4 router): a chain of adds, then + 0, which is exactly the sum PyTorch forms there
    (0 + a + b + ...: each add rounded in the input's dtype, and -0 + -0 gives +0).
    Checked against torch.sum: for float32 its order is that up to 4 values
    (from 5 it is another); a bf16 sum of 3 or more rounds once, in float, so
    a chain of bf16 adds is not it."""
    x, dims = node.args[:2]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if node.kwargs.get("dtype") is not None or not dims or len(dims) != 1 or val(x).numel() == 0:
        return False
    n = val(x).shape[dims[0]]
    if not (n in (1, 2) or (n in (3, 4) and val(x).dtype == torch.float32)):
        return False
    dim = dims[0] % val(x).dim()
    y = lw.view(val(node) if keepdim else val(node).unsqueeze(dim))
    parts = [lw.view(val(x).narrow(dim, i, 1)) for i in range(n)]
    if n == 1:
        return lw.op(node, "binary", [y, parts[0], None], [P["BINARY_ADD"]], [0.0])
    lw.op(node, "binary", [y, *parts[:2]], [P["BINARY_ADD"]], [0.0])
    for part in parts[2:]:
        lw.op(node, "binary", [y, y, part], [P["BINARY_ADD"]], [0.0])
    lw.op(node, "binary", [y, y, None], [P["BINARY_ADD"]], [0.0])


def _lower_neg(lw: _Lowering, node: Node):
    lw.op(node, "binary", [lw.view(val(node)), lw.view(val(node.args[0])), None], [P["BINARY_MUL"]], [-1.0])


def _lower_relu(lw: _Lowering, node: Node):
    """relu(x) = maximum(x, 0): binary's maximum keeps a NaN, and x where the
    two are equal (a -0.0), as relu does (T5's MLP, ResNet's blocks)."""
    x = val(node.args[0])
    if x.dtype not in (torch.float32, torch.bfloat16, torch.int64):
        return False
    lw.op(node, "binary", [lw.view(val(node)), lw.view(x), None], [P["BINARY_MAX"]], [0.0])


def _lower_where(lw: _Lowering, node: Node):
    """where(cond, x, c) or where(cond, c, x), c a constant floating 0-d tensor
    (make_fx writes a Python number as one: T5's mask, its position bias where
    the padding mask keeps a key, finfo.min elsewhere), x of the result's dtype."""
    cond, a, b = node.args[:3]
    y = val(node)

    def number(arg):
        folded = lw.folded.get(arg) if isinstance(arg, Node) else None
        return float(folded) if folded is not None and folded.dim() == 0 and folded.is_floating_point() else None

    if not isinstance(cond, Node) or val(cond).dtype != torch.bool:
        return False
    for x, scalar, mode in ((a, number(b), "WHERE_X_IF_TRUE"), (b, number(a), "WHERE_X_IF_FALSE")):
        if isinstance(x, Node) and scalar is not None and val(x).dtype == y.dtype:
            return lw.op(node, "where", [lw.view(y), lw.view(val(cond)), lw.view(val(x))], [P[mode]], [scalar])
    return False


def _unary(name):
    def lower(lw: _Lowering, node: Node):
        x = node.args[0]
        if val(x).dtype != val(node).dtype:
            return False
        lw.op(node, "unary", [lw.view(val(node)), lw.view(val(x))], [P[name]])

    return lower


def _lower_gelu(lw: _Lowering, node: Node):
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    lw.op(node, "gelu", [lw.view(val(node)), lw.view(val(node.args[0]))], [GELU_MODES[approximate]])


def _lower_copy(lw: _Lowering, node: Node):
    """_to_copy / clone: a strided copy with dtype conversion."""
    if set(node.kwargs) - {"dtype", "device", "layout", "memory_format", "pin_memory"}:
        return False
    lw.op(node, "convert", [lw.view(val(node)), lw.view(val(node.args[0]))])


def _lower_cat(lw: _Lowering, node: Node):
    """One copy per input into its slice of the output. cat skips a 1-D input
    of shape (0,) beside inputs of more dims (PyTorch's legacy empty tensor:
    transformers' DynamicCache starts each layer as one), which has no such dim
    to take a slice along."""
    out = val(node)
    dim = (node.args[1] if len(node.args) > 1 else 0) % out.dim()
    start = 0
    for t in (t for t in node.args[0] if val(t).shape != (0,) or out.dim() == 1):
        piece = out.narrow(dim, start, val(t).shape[dim])
        lw.op(node, "convert", [lw.view(piece), lw.view(val(t))])
        start += val(t).shape[dim]


def _lower_clamp(lw: _Lowering, node: Node):
    """clamp(x, lo, hi) between Python numbers, in place or not: a maximum with
    lo, then a minimum with hi, each keeping a NaN as clamp does (OLMo clips
    its queries, keys and values so)."""
    x = val(node.args[0])
    bounds = [*node.args[1:], None, None][:2]
    lo, hi = node.kwargs.get("min", bounds[0]), node.kwargs.get("max", bounds[1])
    if x.dtype not in (torch.float32, torch.bfloat16) or val(node).dtype != x.dtype or (lo is None and hi is None):
        return False
    steps = [(P[name], _binary_scalar(name, x, bound))
             for name, bound in (("BINARY_MAX", lo), ("BINARY_MIN", hi)) if bound is not None]
    if any(scalar is None for _, scalar in steps) or (_is_inplace_op(node) and _writes_over_what_it_reads(x)):
        return False
    y, source = lw.view(x if _is_inplace_op(node) else val(node)), lw.view(x)
    for op, scalar in steps:
        lw.op(node, "binary", [y, source, None], [op], [scalar])
        source = y


def _lower_stack(lw: _Lowering, node: Node):
    """One copy per input into its index of the output (GPT-J's and CodeGen's
    interleaved rotary stack their halves)."""
    out = val(node)
    dim = (node.args[1] if len(node.args) > 1 else 0) % out.dim()
    for i, t in enumerate(node.args[0]):
        lw.op(node, "convert", [lw.view(out.select(dim, i)), lw.view(val(t))])


def _lower_square(lw: _Lowering, node: Node):
    """x ** 2 as x * x, which is what ATen computes for that exponent (a squared
    ReLU's square, a norm's mean of squares); other exponents stay PyTorch's."""
    x, exponent = node.args
    if isinstance(exponent, bool) or exponent != 2 or val(x).dtype != val(node).dtype:
        return False
    lw.op(node, "binary", [lw.view(val(node)), lw.view(val(x)), lw.view(val(x))], [P["BINARY_MUL"]], [0.0])


def _lower_convolution(lw: _Lowering, node: Node):
    """A depthwise 2-D convolution (one filter a channel: ConvNeXt's 7 × 7,
    whose input is channels-last after its blocks' permutes) natively, the op
    rejecting other layouts (MobileNet's NCHW); a 2-D convolution whose kernel
    is its stride, as a linear over its patches. Every other convolution stays
    oneDNN's through ATen."""
    x, w, b = node.args[:3]
    xv, wv = val(x), val(w)
    kind = native_convolution(node)
    if kind == "depthwise":
        stride, padding, dilation, _, _ = convolution_parameters(node)
        return lw.op(node, "depthwise_conv2d", [lw.view(val(node)), lw.view(xv), lw.view(wv), lw.arg_view(b)],
                     [*stride, *padding, *dilation])
    if kind == "patch":
        return _lower_patch_convolution(lw, node, xv, wv, b)
    return False


def _lower_patch_convolution(lw: _Lowering, node: Node, x: torch.Tensor, w: torch.Tensor, b):
    """A convolution whose kernel is its stride, without padding (a ViT's or
    ConvNeXt's patch embedding, ConvNeXt's downsampling, a 1 × 1): each output
    pixel is a linear of one patch of x, so the whole is a linear whose rows
    are the patches, K = C · kh · kw in the order the weight's memory has
    (so that the weight is read in place as [O, K]), copied out of x by a
    native step unless they already are (a 1 × 1 over channels-last
    memory); its rows of O are the output's pixels, written in place where the
    output is channels-last, else through a copy. Rows and columns past the
    last whole patch are not read, as the convolution does not read them."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    y = val(node)
    ho, wo = h // kh, wd // kw
    if tuple(y.shape) != (n, o, ho, wo) or x.dtype != w.dtype:
        return False
    patches = x[:, :, :ho * kh, :wo * kw].unflatten(3, (wo, kw)).unflatten(2, (ho, kh))  # n c ho kh wo kw
    if w.is_contiguous():  # [O, C, kh, kw]
        weight, patches = w.view(o, c * kh * kw), patches.permute(0, 2, 4, 1, 3, 5)
    elif w.permute(0, 2, 3, 1).is_contiguous():  # channels-last: [O, kh, kw, C]
        weight, patches = w.permute(0, 2, 3, 1).view(o, kh * kw * c), patches.permute(0, 2, 4, 3, 5, 1)
    else:
        return False
    k = c * kh * kw
    in_place = _rows_in_place(patches, (n, ho, wo, k))
    if in_place:
        rows = lw.view(patches.view(n, ho, wo, k))
    else:  # copied into rows of their own
        buf = lw.b.arena(patches.numel() * patches.element_size(), f"{node.name}.patches")
        rows = lw.b.view(buf, x.dtype, (n, ho, wo, k), None, 0)
    pixels = y.permute(0, 2, 3, 1)  # n ho wo o
    out = lw.view(pixels) if pixels.is_contiguous() else lw.b.view(
        lw.b.arena(y.numel() * y.element_size(), f"{node.name}.pixels"), y.dtype, tuple(pixels.shape), None, 0)
    views = [out, rows, lw.view(weight), lw.arg_view(b)]
    why = lw.b.check_op("linear", views, [], [])  # before any step: a rejected node adds none (a fallback)
    if why is not None:
        raise _Rejected(why)
    if not in_place:
        lw.op(node, "convert", [lw.b.view(buf, x.dtype, tuple(patches.shape), None, 0), lw.view(patches)])
    _linear_step(lw, node, views, pixels)
    if not pixels.is_contiguous():
        lw.op(node, "convert", [lw.view(pixels), out])


def _rows_in_place(t: torch.Tensor, shape) -> bool:
    """t's elements are already contiguous rows of shape (a view, not a copy)."""
    try:
        return t.view(shape).is_contiguous()
    except (RuntimeError, ValueError):  # not expressible as a view (fake tensors raise the latter)
        return False


def _lower_kv_write(lw: _Lowering, node: Node):
    cache, dim, pos, src = node.args
    if dim % val(cache).dim() != 2:
        raise NotLowerable(f"{node.name}: index_copy_ along dim {dim}, not the cache's sequence dim 2")
    if val(src).dtype != val(cache).dtype or val(pos).dtype != torch.int64:
        return False  # index_copy_ raises for a source of another dtype or an index not int64: PyTorch's, as a
        # fallback step, raises too
    lw.op(node, "kv_write", [lw.view(val(cache)), lw.view(val(src)), lw.view(val(pos))])


LOWERINGS = {
    ops.linear.default: _lower_linear,
    ops.linear_multi.default: _lower_linear_multi,
    ops.grouped_linear.default: _lower_grouped_linear,
    ops.rms_norm.default: _lower_rms_norm,
    ops.add_rms_norm.default: _lower_add_rms_norm,
    ops.rotary.default: _lower_rotary,
    ops.silu_mul.default: _lower_silu_mul,
    ops.gelu_mul.default: _lower_gelu_mul,
    ops.attention.default: _lower_attention,
    aten.embedding.default: _lower_embedding,
    aten.index.Tensor: _lower_index,
    aten.index_select.default: _lower_index_select,
    aten.empty_like.default: _lower_empty,
    aten.histc.default: _lower_histc,
    aten.topk.default: _lower_topk,
    aten.sort.default: _lower_sort,
    aten.sort.stable: _lower_sort,
    aten.cumsum.default: _lower_cumsum,
    aten.empty.memory_format: _lower_empty,
    aten.new_empty.default: _lower_empty,
    aten.native_layer_norm.default: _lower_layer_norm,
    aten._softmax.default: _lower_softmax,
    aten._safe_softmax.default: _lower_safe_softmax,
    aten.add.Tensor: _binary("BINARY_ADD"),
    aten.sub.Tensor: _binary("BINARY_SUB"),
    aten.mul.Tensor: _binary("BINARY_MUL"),
    aten.div.Tensor: _binary("BINARY_DIV"),
    aten.floor_divide.default: _binary("BINARY_FLOOR_DIV"),
    aten.maximum.default: _binary("BINARY_MAX"),
    aten.minimum.default: _binary("BINARY_MIN"),
    aten.add.Scalar: _binary("BINARY_ADD"),  # SDPA's math path scales q and k so
    aten.sub.Scalar: _binary("BINARY_SUB"),
    aten.mul.Scalar: _binary("BINARY_MUL"),
    aten.div.Scalar: _binary("BINARY_DIV"),
    aten.eq.Tensor: _compare("COMPARE_EQ"),
    aten.eq.Scalar: _compare("COMPARE_EQ"),
    aten.ne.Tensor: _compare("COMPARE_NE"),
    aten.ne.Scalar: _compare("COMPARE_NE"),
    aten.lt.Tensor: _compare("COMPARE_LT"),
    aten.lt.Scalar: _compare("COMPARE_LT"),
    aten.le.Tensor: _compare("COMPARE_LE"),
    aten.le.Scalar: _compare("COMPARE_LE"),
    aten.gt.Tensor: _compare("COMPARE_GT"),
    aten.gt.Scalar: _compare("COMPARE_GT"),
    aten.ge.Tensor: _compare("COMPARE_GE"),
    aten.ge.Scalar: _compare("COMPARE_GE"),
    aten.bmm.default: _lower_bmm,
    aten.convolution.default: _lower_convolution,
    aten.baddbmm.default: _lower_bmm,
    aten.sum.dim_IntList: _lower_small_sum,
    aten.neg.default: _lower_neg,
    aten.relu.default: _lower_relu,
    aten.where.self: _lower_where,
    aten.gelu.default: _lower_gelu,
    aten.cos.default: _unary("UNARY_COS"),
    aten.sin.default: _unary("UNARY_SIN"),
    aten.exp.default: _unary("UNARY_EXP"),
    aten.tanh.default: _unary("UNARY_TANH"),
    aten.sqrt.default: _unary("UNARY_SQRT"),
    aten.rsqrt.default: _unary("UNARY_RSQRT"),
    aten.silu.default: _unary("UNARY_SILU"),
    aten.abs.default: _unary("UNARY_ABS"),
    aten.sigmoid.default: _unary("UNARY_SIGMOID"),
    aten.log.default: _unary("UNARY_LOG"),
    aten.floor.default: _unary("UNARY_FLOOR"),
    aten._to_copy.default: _lower_copy,
    aten.clone.default: _lower_copy,
    aten.cat.default: _lower_cat,
    aten.stack.default: _lower_stack,
    aten.clamp.default: _lower_clamp,
    aten.pow.Tensor_Scalar: _lower_square,
    aten.roll.default: _lower_roll,
}

INPLACE_LOWERINGS = {
    aten.index_copy_.default: _lower_kv_write,
    aten.index_put_.default: _lower_index_put,
    aten.copy_.default: _lower_copy_into,
    aten.clamp_.default: _lower_clamp,
    aten.add_.Tensor: _binary("BINARY_ADD"),
    aten.sub_.Tensor: _binary("BINARY_SUB"),
    aten.mul_.Tensor: _binary("BINARY_MUL"),
    aten.div_.Tensor: _binary("BINARY_DIV"),
}


def lower_to_plan(gm: torch.fx.GraphModule, example_inputs, copies: dict[str, PlanCopy] | None = None,
                  input_names: list[str] | None = None, written_args=()):
    """A Plan that, called with Dynamo's flat inputs, does what gm does, and the
    lowering's report. copies: kwker's weight copies among gm's attributes, by attribute.
    input_names: what the plan's errors call each input (default: gm's
    placeholder names). written_args: the arguments gm writes in place, whose
    version counters every call bumps (plan.inputs_written)."""
    lowering = _Lowering(gm, example_inputs, copies or {}, input_names, written_args)
    plan = lowering.run()
    return plan, lowering.report
