"""Decode steps: what makes a graph one, and the plan that replays it.

A decode step is a CPU inference graph that writes non-parameter inputs in
place (the cache's index_copy_ and the counter's add_ of transformers'
StaticCache) at one query position; it may write its own intermediates in
place too (MoE routing's inverse permutation), never a parameter. routing.py recognises the candidates on
Dynamo's graph, before anything is traced; classify_decode_step checks the
ATen trace. The step is lowered to a plan and never given to Inductor.

The plan is what Dynamo calls. It reads kwker's weight copies, and checks
their sources before every call (kwker.weights): when one changed, the copies
are packed again, or, when they cannot be made the same way, the whole step is
compiled again from Dynamo's graph with the call's arguments and the plan takes
the new one over. A second model of the same class, for which Dynamo reuses
the step, has its weights packed into the same copies.
"""

import logging
import threading

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint

from kwker import _C
from kwker.aten_graph import trace_to_aten
from kwker.lower import NotLowerable, lower_to_plan, storage_key
from kwker.rewrite import reserved_copy_bytes, rewrite_language_model
from kwker.weights import CopiedWeights, WeightArena

aten = torch.ops.aten
log = logging.getLogger(__name__)


def classify_decode_step(gm: torch.fx.GraphModule, example_inputs) -> str | None:
    """None if the ATen graph gm is a decode step, else why it is not."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    writes = [n for n in gm.graph.nodes if n.op == "call_function" and _mutates_first_arg(n)]
    cache_writes = [n for n in writes if n.target is aten.index_copy_.default]
    if not cache_writes:
        return "it writes no static cache"
    # What each write reaches is decided by storage: a view of an input is that input.
    input_of_storage = {storage_key(n.meta["val"]): (n, x) for n, x in zip(placeholders, example_inputs)
                        if isinstance(x, torch.Tensor)}
    for n in writes:
        written, x = input_of_storage.get(storage_key(n.args[0].meta["val"]), (None, None))
        if isinstance(x, torch.nn.Parameter):
            return f"{n.name} writes the parameter {written.name}"
    for n in cache_writes:
        dim, src = n.args[1], n.args[3]
        if src.meta["val"].shape[dim] != 1:
            return f"{n.name} writes {src.meta['val'].shape[dim]} positions (prefill, not decode)"
    return None


def _mutates_first_arg(node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.arguments and schema.arguments[0].alias_info and schema.arguments[0].alias_info.is_write)


def compile_decode_step(gm: torch.fx.GraphModule, example_inputs, glue: bool = True):
    """What replays Dynamo's graph gm of a decode step (a Plan, or a
    StepPerSizes when Dynamo made sizes inputs), and what compiling it did
    (rewrite counts, fallback ops). Raises NotLowerable when gm is not one it
    can replay."""
    if any(isinstance(x, torch.SymInt) for x in example_inputs):
        step = StepPerSizes(gm, example_inputs, glue)
        return step, step.detail
    return compile_plan(gm, example_inputs, glue)


def compile_plan(gm: torch.fx.GraphModule, example_inputs, glue: bool = True):
    """The plan for gm with these inputs, every size a Python int."""
    arena = WeightArena(reserved_copy_bytes(gm, example_inputs))  # faults in while the graph is traced
    try:
        aten_gm = trace_to_aten(gm, example_inputs)
        not_decode = classify_decode_step(aten_gm, example_inputs)
        if not_decode:
            raise NotLowerable(f"not a decode step: {not_decode}")
        placeholders = [n.name for n in aten_gm.graph.nodes if n.op == "placeholder"]
        scalars = specialize_scalars(aten_gm, example_inputs)
        params = {name: t for name, t in zip(placeholders, example_inputs) if isinstance(t, torch.nn.Parameter)}
        counts, copies = rewrite_language_model(aten_gm, params, glue=glue, arena=arena)
    finally:
        arena.close()
    plan, report = lower_to_plan(aten_gm, example_inputs, copies)
    if copies or scalars:
        refresh = _Refresh(CopiedWeights(copies, {name: i for i, name in enumerate(placeholders)}), scalars, gm, glue)
        plan.watch(refresh.sources, refresh)
    detail = {"rewrites": {k: v for k, v in counts.items() if v}, "fallback_ops": report.fallback_ops,
              "copies": len(copies)}
    return plan, detail


# ATen ops a float input may feed as their second operand: the float takes its place.
_SCALAR_OPERAND = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor}


def specialize_scalars(gm: torch.fx.GraphModule, example_inputs) -> list[tuple[int, float]]:
    """A Python float of the model that Dynamo made an input (after a second
    model gave it another value: an rms_norm_eps) reaches the graph as a 0-dim
    float64 tensor. The plan is specialised on its value, which then fuses like
    a constant, and the value is checked on every call: another value compiles
    the step again. Returns (argument index, value) for each; raises
    NotLowerable for a float input used otherwise."""
    specialized = []
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        x = example_inputs[i]
        if not (isinstance(x, torch.Tensor) and x.dim() == 0 and x.dtype == torch.float64) or not node.users:
            continue
        value = float(x)
        for user in list(node.users):
            if user.target is aten._local_scalar_dense.default:  # .item(): a Python number from here on
                user.replace_all_uses_with(value)
                gm.graph.erase_node(user)
            elif user.target in _SCALAR_OPERAND and user.args[1] is node and not user.kwargs:
                user.args = (user.args[0], value, *user.args[2:])
            else:
                raise NotLowerable(f"the float input {node.name} feeds {user.target}")
        specialized.append((i, value))
    return specialized


class _Refresh:
    """What a plan calls when a source of its copies or a value it was
    specialised on changed: the copies packed again (None), or the step
    compiled again for these arguments (a new Plan, which the plan takes over).
    `sources` is the list the plan checks, kept up to date in place."""

    def __init__(self, copied: CopiedWeights, scalars: list[tuple[int, float]], gm: torch.fx.GraphModule,
                 glue: bool):
        self.copied, self.scalars, self.gm, self.glue = copied, scalars, gm, glue
        self.sources = copied.watched() + scalars

    def __call__(self, args):
        same_values = all(float(args[i]) == value for i, value in self.scalars)
        if same_values and self.copied.refresh(args):
            self.sources[:] = self.copied.watched() + self.scalars
            log.debug("decode step: weight copies packed again")
            return None
        log.info("decode step: %s; compiling the step again",
                 "a weight can no longer be copied the same way" if same_values else "a float input changed")
        plan, _ = compile_plan(self.gm, list(args), self.glue)
        return plan


class StepPerSizes:
    """A decode step whose sizes Dynamo made inputs: under its automatic dynamic
    shapes, a second generate() with another cache length compiles the step
    again with that length as a SymInt input. Each call's sizes get a plan of
    their own, compiled on the first call with them; the step keeps only the
    latest plan, dropped before the next is compiled, so that memory holds one
    set of weight copies. A plan's own checks still see every input's layout.
    When a plan cannot be compiled for some sizes, those calls run Dynamo's
    graph eagerly, logged: slow, never wrong."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, glue: bool):
        self.gm, self.glue = gm, glue
        self.sizes = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.SymInt)]
        # The hints, not int(): that would add a guard and specialise Dynamo's graph.
        args = [optimization_hint(x) if isinstance(x, torch.SymInt) else x for x in example_inputs]
        self.plan, self.detail = compile_plan(gm, args, glue)
        self.key = tuple(args[i] for i in self.sizes)
        self.lock = threading.Lock()  # a call compiling a plan must not drop the one another thread replays

    def __call__(self, *args):
        key = tuple(args[i] for i in self.sizes)
        with self.lock:
            if key != self.key:
                self.plan = self.key = None
                try:
                    self.plan, _ = compile_plan(self.gm, list(args), self.glue)
                    log.info("decode step: a plan for sizes %s", key)
                except (NotLowerable, _C.PlanError) as e:
                    self.plan = self.gm
                    log.warning("decode step: no plan for sizes %s (%s); those calls run Dynamo's graph eagerly", key, e)
                self.key = key
            return self.plan(*args)

    @property
    def last_call(self) -> dict | None:
        return getattr(self.plan, "last_call", None)


__all__ = ["classify_decode_step", "compile_decode_step"]
