"""A plan for one of Dynamo's graphs: traced to ATen, rewritten (kwker's weight
copies made there), lowered to native steps, and watched.

The plan reads kwker's weight copies, and checks their sources before every
call (kwker.weights): when one changed, the copies are packed again, or, when
they cannot be made the same way, the whole graph is compiled again from
Dynamo's graph with the call's arguments and the plan takes the new one over.
A source of another Python type, dtype or shape raises PlanError instead:
Dynamo's graph was traced for the old one.
A second model of the same class, for which Dynamo reuses the graph, has its
weights packed into the same copies.
"""

import logging
import struct
from collections.abc import Callable

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from kwker import _C
from kwker.aten_graph import trace_to_aten
from kwker.lower import NotLowerable, lower_to_plan, storage_key
from kwker.rewrite import planned_copies, rewrite_language_model
from kwker.rewrite.match import op_arguments, written_arguments
from kwker.routing import dynamo_input_names
from kwker.weights import CopiedWeights, WeightArena

aten = torch.ops.aten
log = logging.getLogger(__name__)

# Why an ATen graph must not become a plan, or None (decode.classify_decode_step's use).
Classify = Callable[[torch.fx.GraphModule, list], str | None]


def reserve_weights(gm: torch.fx.GraphModule, example_inputs, family=None, shares: bool = True) -> WeightArena:
    """The memory a plan of gm copies weights into, reserved now so that it
    faults in while the caller goes on (traces gm, compiles other candidates).
    family, shares: whose copies the plan may read, and who may read its
    (WeightArena). The reservation leaves out copies the plan will share."""
    return WeightArena(planned_copies(gm, example_inputs), family, shares)


def compile_plan(gm: torch.fx.GraphModule, example_inputs, glue: bool = True, classify: Classify | None = None,
                 aten_gm: torch.fx.GraphModule | None = None, arena: WeightArena | None = None):
    """The plan for gm with these inputs, every size a Python int, and what
    compiling it did (rewrite counts, fallback ops, copies). Raises NotLowerable
    with classify's reason, or when the lowering cannot express gm. aten_gm:
    gm's ATen trace, when the caller has made it already (it is rewritten),
    and arena: reserve_weights's, when the caller reserved it before (GPT-2 at
    batch 8 in float32: each weight's watch waited 25 ms on the pages still
    faulting in, 0.65 s of a 1.1 s build), or to say whose copies the plan
    shares; by default one that shares with every plan (WeightArena)."""
    arena = arena if arena is not None else reserve_weights(gm, example_inputs)  # faults in meanwhile
    try:
        aten_gm = aten_gm if aten_gm is not None else trace_to_aten(gm, example_inputs)
        why_not = classify(aten_gm, example_inputs) if classify else None
        if why_not:
            raise NotLowerable(why_not)
        placeholders = [n.name for n in aten_gm.graph.nodes if n.op == "placeholder"]
        written = sorted({placeholders.index(p.name) for _, p, _ in inputs_written(aten_gm, example_inputs)})
        scalars = specialize_scalars(aten_gm, example_inputs)
        data_dependent = next((n for n in aten_gm.graph.nodes if free_unbacked_symbols(n.meta.get("val"))), None)
        if data_dependent is not None:  # capture_dynamic_output_shape_ops, capture_scalar_outputs
            raise NotLowerable(f"{data_dependent.name} ({data_dependent.target}) has a size or value known only when "
                               "the graph runs; a plan's buffers are sized when it is built")
        # A parameter the graph writes is read as it is: a copy would go stale within the call that writes it.
        params = {name: t for i, (name, t) in enumerate(zip(placeholders, example_inputs))
                  if isinstance(t, torch.nn.Parameter) and i not in written}
        counts, copies = rewrite_language_model(aten_gm, glue=glue, copy_into=(params, arena))
    finally:
        arena.close()
    plan, report = lower_to_plan(aten_gm, example_inputs, copies, dynamo_input_names(gm), written)
    if arena.family is not None:  # the lock of the plans it shares copies with (kwker.weights._shared)
        plan.call_lock = arena.family
    if copies or scalars:
        refresh = _Refresh(CopiedWeights(list(copies.values()), {name: i for i, name in enumerate(placeholders)}),
                           scalars, gm, glue, classify, plan.call_lock, arena.shares)
        plan.watch(refresh.sources, refresh)
    detail = {"rewrites": {k: v for k, v in counts.items() if v}, "fallback_ops": report.fallback_ops,
              "copies": len(copies), "copies_refused": arena.refused}
    return plan, detail


def inputs_written(aten_gm: torch.fx.GraphModule, example_inputs) -> list[tuple]:
    """(the write, the input's placeholder, the input) for each in-place op of
    the ATen graph that writes one of its tensor inputs (any argument its schema
    marks written: a training-mode batch norm's running statistics too). What a
    write reaches is decided by storage: a view of an input is that input, and
    so is every other input over the same storage (a cache's keys and values
    cut from one tensor: each must be put back after a timing run)."""
    placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    inputs_of_storage = {}
    for n, x in zip(placeholders, example_inputs):
        if isinstance(x, torch.Tensor):
            inputs_of_storage.setdefault(storage_key(n.meta["val"]), []).append((n, x))
    found = []
    for n in aten_gm.graph.nodes:
        for arg in _written_args(n) if n.op == "call_function" else ():
            found += [(n, *written) for written in inputs_of_storage.get(storage_key(arg.meta["val"]), ())]
    return found


def _written_args(node) -> list[torch.fx.Node]:
    if getattr(node.target, "_schema", None) is None:
        return []
    written = written_arguments(node.target, node.args, node.kwargs)
    given = op_arguments(node)
    if node.target == aten.native_batch_norm.default and given.get("training"):  # though its schema does not say so
        written += [given["running_mean"], given["running_var"]]
    return [v for v in written if isinstance(v, torch.fx.Node)]


# ATen ops a float input may feed as their second operand: the float takes its place.
_SCALAR_OPERAND = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor}


def specialize_scalars(gm: torch.fx.GraphModule, example_inputs) -> list[tuple[int, float]]:
    """A Python float of the model that Dynamo made an input (after a second
    model gave it another value: an rms_norm_eps) reaches the graph as a 0-dim
    float64 tensor. The plan is specialised on its value, which then fuses like
    a constant, and the value is checked on every call: another value compiles
    the graph again. Returns (argument index, value) for each; raises
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


def _same_bits(a: float, b: float) -> bool:
    """A specialised float is checked by its bits, as the plan's C check does:
    a NaN is its own value, and -0.0 is not +0.0."""
    return struct.pack("<d", a) == struct.pack("<d", b)


class _Refresh:
    """What a plan calls when a source of its copies or a value it was
    specialised on changed: the copies packed again (None), or the graph
    compiled again for these arguments (a new Plan, which the plan takes over).
    `sources` is the list the plan checks, kept up to date in place. The
    plan compiled again holds the plan's own CallLock, `family`, and reads the
    copies of that family that are still fresh: the plan goes on holding its
    lock (a state of another would let a thread in beside one holding the old),
    and makes again only what changed."""

    def __init__(self, copied: CopiedWeights, scalars: list[tuple[int, float]], gm: torch.fx.GraphModule,
                 glue: bool, classify: Classify | None, family, shares: bool):
        self.copied, self.scalars, self.gm, self.glue, self.classify = copied, scalars, gm, glue, classify
        self.family, self.shares = family, shares
        self.sources = copied.watched() + scalars

    def __call__(self, args):
        for i, watch in self.copied.watched():
            self._check_source(i, watch, args[i])
        same_values = all(_same_bits(float(args[i]), value) for i, value in self.scalars)
        if same_values and self.copied.refresh(args):
            self.sources[:] = self.copied.watched() + self.scalars
            log.debug("plan: weight copies packed again")
            return None
        log.info("plan: %s; compiling the graph again",
                 "a weight can no longer be copied the same way" if same_values else "a float input changed")
        arena = reserve_weights(self.gm, list(args), self.family, self.shares)
        plan, _ = compile_plan(self.gm, list(args), self.glue, self.classify, arena=arena)
        return plan

    def _check_source(self, i: int, watch, now) -> None:
        """A copied weight that is no longer of its exact Python type, dtype and
        shape (its guard dropped) raises PlanError, as one the plan binds does:
        Dynamo traced the graph for the old one, and the frame's Python may have
        read its shape (BLOOM's slices by pretraining_tp), so it is not compiled
        again from that graph (it once gave wrong values so, without an error);
        a subclass's __torch_function__ can change what every op does."""
        was = watch.tensor
        if type(now) is not watch.type:
            what, expected, got, code = "type", watch.type, type(now), _C.EINVAL
        elif now.dtype != was.dtype:
            what, expected, got, code = "dtype", was.dtype, now.dtype, _C.EDTYPE
        elif now.shape != was.shape:
            what, expected, got, code = "shape", tuple(was.shape), tuple(now.shape), _C.ESHAPE
        else:
            return
        error = _C.PlanError(f"input '{dynamo_input_names(self.gm)[i]}' (argument {i}): expected {what} {expected}, "
                             f"got {got}. {_C.GUARD_DROPPED}")
        error.code = code
        raise error
