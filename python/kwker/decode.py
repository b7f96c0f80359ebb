"""Decode steps: what makes a graph one, and what replays it.

A decode step is a CPU inference graph that writes non-parameter inputs in
place (the cache's index_copy_ and the counter's add_ of transformers'
StaticCache, or a full sliding-window layer's copy of its own roll): at one
query position for a token, at several for a chunk of a chunked prefill or a
verify step of prompt lookup and assisted decoding. It may write its own
intermediates in place too (MoE routing's inverse permutation), never a
parameter. routing.py recognises the candidates on Dynamo's graph, before
anything is traced; classify_decode_step checks the ATen trace. The step is
lowered to a plan (kwker.plan, which keeps its weight copies fresh) and never
given to Inductor.
"""

import logging
import operator
import torch
from torch.fx.experimental.symbolic_shapes import free_symbols, optimization_hint

from kwker import _C
from kwker.lower import NotLowerable
from kwker.plan import compile_plan, inputs_written
from kwker.threads import ForkSafeLock

aten = torch.ops.aten
log = logging.getLogger(__name__)


def classify_decode_step(gm: torch.fx.GraphModule, example_inputs) -> str | None:
    """None if the ATen graph gm is a decode step, else why it is not."""
    rolled = {n.args[0] for n in gm.graph.nodes if n.target is aten.roll.default}
    cache_writes = [n for n in gm.graph.nodes if n.target is aten.index_copy_.default
                    or n.target is aten.copy_.default and n.args[0] in rolled and n.args[0].op == "placeholder"]
    if not cache_writes:
        return "it writes no static cache"
    for write, written, x in inputs_written(gm, example_inputs):
        if isinstance(x, torch.nn.Parameter):
            return f"{write.name} writes the parameter {written.name}"
    return None


def compile_decode_step(gm: torch.fx.GraphModule, example_inputs, glue: bool = True):
    """What replays Dynamo's graph gm of a decode step (a Plan, or a
    StepPerSizes when Dynamo made sizes inputs, either inside an IntOutputs
    when gm also returns ints), and what compiling it did (rewrite counts,
    fallback ops). Raises NotLowerable when gm is not one it can replay."""
    ints = IntOutputs.split(gm, example_inputs)
    step_gm = ints.tensor_graph if ints else gm
    sizes = _sizes(step_gm, example_inputs)
    if sizes:
        step = StepPerSizes(step_gm, example_inputs, glue, sizes)
        detail = step.detail
    else:  # any int input left is read by no tensor op: one plan serves every value
        step, detail = compile_decode_plan(step_gm, _hints(example_inputs), glue)
    return (ints.around(step) if ints else step), detail


def compile_decode_plan(gm: torch.fx.GraphModule, example_inputs, glue: bool = True):
    """The plan of a decode step whose sizes are all Python ints."""
    return compile_plan(gm, example_inputs, glue, classify=_not_a_decode_step)


def _not_a_decode_step(aten_gm, example_inputs) -> str | None:
    why = classify_decode_step(aten_gm, example_inputs)
    return f"not a decode step: {why}" if why else None


class StepPerSizes:
    """A decode step whose sizes Dynamo made inputs, under its automatic dynamic
    shapes: a second generate() with another cache length, the chunks of a
    chunked prefill (their count of positions, the mask's length), the verify
    steps of prompt lookup (their count of candidates). Each call's sizes get a
    plan of their own, compiled on the first call with them; the MAX_PLANS
    most recently used are kept, and they read one copy of each weight
    (kwker.weights._shared). A plan's own checks
    still see every input's layout. When a plan cannot be compiled for some
    sizes, those calls run Dynamo's graph eagerly, logged: slow, never wrong."""

    MAX_PLANS = 8

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, glue: bool, sizes: list[int]):
        self.gm, self.glue = gm, glue
        self.sizes = sizes  # the positions of the SymInt inputs that tensor ops read
        args = _hints(example_inputs)
        plan, self.detail = compile_decode_plan(gm, args, glue)
        self.plans = {tuple(args[i] for i in self.sizes): plan}  # in order of use, the latest last
        self.last = plan
        # One call at a time: a call compiling a plan must not drop the one another thread replays.
        self.lock = ForkSafeLock()

    def __call__(self, *args):
        key = tuple(args[i] for i in self.sizes)
        with self.lock:
            plan = self.plans.pop(key, None)
            if plan is None:
                plan = self._compile(key, args)
            self.plans[key] = plan
            if len(self.plans) > self.MAX_PLANS:
                del self.plans[next(iter(self.plans))]
            self.last = plan
            return plan(*args)

    def _compile(self, key, args):
        try:
            plan, _ = compile_decode_plan(self.gm, list(args), self.glue)
            log.info("decode step: a plan for sizes %s", key)
            return plan
        except (NotLowerable, _C.PlanError) as e:
            log.warning("decode step: no plan for sizes %s (%s); those calls run Dynamo's graph eagerly", key, e)
            return self.gm

    @property
    def last_call(self) -> dict | None:
        return getattr(self.last, "last_call", None)


def _sizes(gm: torch.fx.GraphModule, example_inputs) -> list[int]:
    """The positions of the SymInt inputs a plan must be compiled for: those a
    node reads, and those a tensor input's shape holds (a cache length Dynamo
    made dynamic: no node need read the symbol, the shapes carry it). Only an
    int neither reads, such as the token count IntOutputs returns, is left out."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    symbolic = [node.meta.get("example_value", node.meta.get("val"))
                for node, x in zip(placeholders, example_inputs) if isinstance(x, torch.Tensor)]
    if any(t is None for t in symbolic):  # shapes unknown: every int may be one
        return [i for i, x in enumerate(example_inputs) if isinstance(x, torch.SymInt)]
    in_shapes = set().union(*(free_symbols(t) for t in symbolic))
    return [i for i, (node, x) in enumerate(zip(placeholders, example_inputs))
            if isinstance(x, torch.SymInt) and (node.users or free_symbols(x) & in_shapes)]


def _hints(example_inputs) -> list:
    """The example inputs with each SymInt as its hint, not int(): that would add
    a guard and specialise Dynamo's graph."""
    return [optimization_hint(x) if isinstance(x, torch.SymInt) else x for x in example_inputs]


# What an int output may be computed with: Python's arithmetic on ints (Dynamo's
# graph writes `cumulative_length_int + 1` so).
_INT_ARITHMETIC = frozenset({operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg})


class IntOutputs:
    """A step whose graph also returns Python ints computed from its int inputs
    alone: transformers' sliding-window cache layer counts tokens in a Python
    int, which Dynamo makes an input after one recompile and whose next value
    the step returns. A plan returns tensors only, so the tensor outputs come
    from the step (compiled from tensor_graph, gm without the int outputs) and
    the ints from the few arithmetic nodes that make them, run on each call's
    own ints. An int input that only these nodes read changes nothing the plan
    computes: the step does not depend on its value (compile_decode_step)."""

    def __init__(self, gm: torch.fx.GraphModule, outputs: list, int_nodes: set[torch.fx.Node]):
        tensor_graph, int_graph = torch.fx.Graph(), torch.fx.Graph()
        env_t, env_i = {}, {}
        for node in gm.graph.nodes:
            if node.op == "output":
                break
            env_t[node] = tensor_graph.node_copy(node, env_t.__getitem__)
            if node.op == "placeholder" or node in int_nodes:
                env_i[node] = int_graph.node_copy(node, env_i.__getitem__)
        self.is_int = [isinstance(o, torch.fx.Node) and o in int_nodes for o in outputs]
        tensor_graph.output(tuple(env_t[o] for o, i in zip(outputs, self.is_int) if not i))
        for node in reversed(gm.graph.nodes):  # what only made the ints, so that their inputs have no users left
            if node in int_nodes and not env_t[node].users:
                tensor_graph.erase_node(env_t[node])
        int_graph.output(tuple(env_i[o] for o, i in zip(outputs, self.is_int) if i))
        self.tensor_graph = torch.fx.GraphModule(gm, tensor_graph)
        self.ints = torch.fx.GraphModule(gm, int_graph).forward  # the generated code, without Module.__call__
        self.step = None

    @classmethod
    def split(cls, gm: torch.fx.GraphModule, example_inputs) -> "IntOutputs | None":
        """None when gm returns tensors only, or an int it computes from anything
        but int inputs and _INT_ARITHMETIC (the lowering then says why not)."""
        (outputs,) = next(n for n in gm.graph.nodes if n.op == "output").args
        outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
        int_nodes = set()
        todo = [o for o in outputs if isinstance(o, torch.fx.Node) and _is_int(o.meta.get("example_value"))]
        if not todo:
            return None
        while todo:
            node = todo.pop()
            if node in int_nodes:
                continue
            if node.op == "placeholder":
                if not isinstance(example_inputs[index[node]], (int, torch.SymInt)):
                    return None
            elif node.op != "call_function" or node.target not in _INT_ARITHMETIC or node.kwargs:
                return None
            else:
                todo.extend(a for a in node.args if isinstance(a, torch.fx.Node))
                if not all(isinstance(a, (torch.fx.Node, int)) for a in node.args):
                    return None
            int_nodes.add(node)
        return cls(gm, outputs, {n for n in int_nodes if n.op != "placeholder"})

    def around(self, step) -> "IntOutputs":
        self.step = step
        return self

    def __call__(self, *args):
        tensors, ints = iter(self.step(*args)), iter(self.ints(*args))
        return tuple(next(ints) if i else next(tensors) for i in self.is_int)

    @property
    def checked_args(self) -> frozenset:
        """The arguments the step's plan checks on every call (guards.note_graph)."""
        return getattr(self.step, "checked_args", frozenset())

    @property
    def last_call(self) -> dict | None:
        return getattr(self.step, "last_call", None)


def _is_int(value) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


__all__ = ["classify_decode_step", "compile_decode_step"]
