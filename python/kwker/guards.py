"""The Dynamo guards a kwker plan makes redundant, and the filter that drops
them: ``kwker.guard_filter``, for ``torch.compile(..., options={"guard_filter_fn":
kwker.guard_filter})``, which ``kwker.compile_config()`` installs.

Before every call of a compiled frame Dynamo checks its guards. For a decode
step most of their cost is one tensor guard per parameter (its Python type,
dtype, device, shape, strides, requires_grad), run with cold caches because the
step before has just streamed the weights through them. A kwker plan checks the
same again on every call for each argument it reads: the inputs it binds (exact
Python type, dtype, CPU, shape and strides: a PlanError naming the input
otherwise) and the sources of its weight copies (watched: moved, relaid or
written, they are packed again, or the graph compiled again for them). So the
filter drops one kind of guard, TENSOR_MATCH, on one kind of input: a
parameter or buffer of the model (its source is inside an nn.Module) that the
plan checks (Plan.checked_args), when every graph of the frame reading it is
such a plan compiled with grad mode off (Dynamo's grad-mode guard, kept, holds
it off on every call, so requires_grad cannot matter), and that is not the
first of its kind. Tensors of one kind differ only in the indices of the stacks
they lie in (ModuleList or Sequential items: model.layers.3.mlp.up_proj.weight
and model.layers.5.mlp.up_proj.weight); the first is the one of the lowest
indices, and a tensor outside every stack is its kind's only one. The first of
each kind keeps its guards: a model's config decides the shapes of a kind
alike, so a second model of the same class with another config (a smaller
assistant for assisted decoding, a vocabulary resized, another MLP width, a
mixture of experts after dense first layers, T5's feed-forward inside each
block's list of sublayers) fails them and Dynamo compiles the step again for
it, as without the filter, for about one block's share of the guards' cost.
Everything else stays:
the guards on the module structure (hooks, attributes, types), which decide what
the graph is and which no plan can see; the tensor guards on the call's own
arguments (ids, masks, the cache), whose change of shape must make Dynamo
compile again rather than fail; and every guard of a frame compiled by Inductor,
eager or another backend.

What a kept guard would have done and the plan does instead, for a dropped one:
a parameter given another shape or dtype than the first of its kind (blocks
that differ in size, or one block changed) raises kwker's PlanError naming it
(Dynamo would have compiled the frame again: compile again, or run once without
the filter); one relaid or replaced by another tensor of the same layout is
read as it is now. What neither checks: a tensor's dispatch keys beyond its
type and device (a negative-view bit, made only by torch._neg_view).
"""

import re
from collections import OrderedDict

import torch
from torch._guards import CompileContext

from kwker.threads import ForkSafeLock


_KEPT_FRAMES = 16  # frames whose compile noted graphs but never reached the filter: forgotten past this many

_lock = ForkSafeLock()
# Dynamo's compile id of a frame -> {source name: whether every graph of it reading
# that input rechecks it}, filled as the frame's graphs compile, read once by the filter.
_rechecked: OrderedDict = OrderedDict()


def note_graph(gm: torch.fx.GraphModule, compiled, grad_enabled: bool) -> None:
    """Records, for the frame Dynamo is compiling, which of gm's inputs the
    callable kwker made for it rechecks on every call."""
    compile_id = CompileContext.current_compile_id()
    if compile_id is None:  # called outside torch.compile: no guards follow
        return
    # A Plan, or a step around one (decode.IntOutputs), names the arguments it checks.
    checked = getattr(compiled, "checked_args", frozenset()) if not grad_enabled else frozenset()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with _lock:
        frame = _rechecked.setdefault(compile_id, {})
        _rechecked.move_to_end(compile_id)
        while len(_rechecked) > _KEPT_FRAMES:
            _rechecked.popitem(last=False)
        for i, node in enumerate(placeholders):
            source = getattr(node.meta.get("grapharg"), "source", None)
            if source is not None:
                frame[source.name] = frame.get(source.name, True) and i in checked and in_module(source)


def in_module(source) -> bool:
    """A parameter or buffer reached through an nn.Module (with Dynamo's inlining
    of modules, the default, a module's tensors are graph inputs with such sources)."""
    return source.guard_source.is_unspecialized_nn_module()


_STACK_INDEX = re.compile(r"_modules\['(\d+)'\]")


def first_of_each_kind(names) -> set[str]:
    """Of the source names that differ only in their stacks' indices
    (`..._modules['layers']._modules['3']...`), the one of the lowest indices."""
    first = {}
    for name in names:
        kind, indices = _STACK_INDEX.sub("_modules['*']", name), [int(i) for i in _STACK_INDEX.findall(name)]
        if kind not in first or indices < first[kind][0]:
            first[kind] = (indices, name)
    return {name for _, name in first.values()}


def guard_filter(entries) -> list[bool]:
    """torch.compile's guard_filter_fn: keeps every guard but the tensor guards
    on module tensors that the frame's kwker plans recheck, past the first of
    their kind (module docstring)."""
    with _lock:
        rechecked = _rechecked.pop(CompileContext.current_compile_id(), {})
    kept = first_of_each_kind(rechecked)
    return [not (e.guard_type == "TENSOR_MATCH" and rechecked.get(e.orig_guard.name, False)
                 and e.orig_guard.name not in kept) for e in entries]
