"""Decode steps: what makes a graph one, and what replays it.

A decode step is a CPU inference graph that writes non-parameter inputs in
place (the cache's index_copy_ and the counter's add_ of transformers'
StaticCache): at one query position for a token, at several for a chunk of a
chunked prefill or a verify step of prompt lookup and assisted decoding. It may
write its own intermediates in place too (MoE routing's inverse permutation),
never a parameter. routing.py
recognises the candidates on Dynamo's graph, before anything is traced;
classify_decode_step checks the ATen trace. The step is lowered to a plan
(kwker.plan, which keeps its weight copies fresh) and never given to Inductor.
"""

import logging
import threading

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint

from kwker import _C
from kwker.lower import NotLowerable
from kwker.plan import compile_plan, inputs_written

aten = torch.ops.aten
log = logging.getLogger(__name__)


def classify_decode_step(gm: torch.fx.GraphModule, example_inputs) -> str | None:
    """None if the ATen graph gm is a decode step, else why it is not."""
    cache_writes = [n for n in gm.graph.nodes if n.target is aten.index_copy_.default]
    if not cache_writes:
        return "it writes no static cache"
    for write, written, x in inputs_written(gm, example_inputs):
        if isinstance(x, torch.nn.Parameter):
            return f"{write.name} writes the parameter {written.name}"
    return None


def compile_decode_step(gm: torch.fx.GraphModule, example_inputs, glue: bool = True):
    """What replays Dynamo's graph gm of a decode step (a Plan, or a
    StepPerSizes when Dynamo made sizes inputs), and what compiling it did
    (rewrite counts, fallback ops). Raises NotLowerable when gm is not one it
    can replay."""
    if any(isinstance(x, torch.SymInt) for x in example_inputs):
        step = StepPerSizes(gm, example_inputs, glue)
        return step, step.detail
    return compile_decode_plan(gm, example_inputs, glue)


def compile_decode_plan(gm: torch.fx.GraphModule, example_inputs, glue: bool = True, kept: dict | None = None):
    """The plan of a decode step whose sizes are all Python ints."""
    return compile_plan(gm, example_inputs, glue, classify=_not_a_decode_step, kept=kept)


def _not_a_decode_step(aten_gm, example_inputs) -> str | None:
    why = classify_decode_step(aten_gm, example_inputs)
    return f"not a decode step: {why}" if why else None


class StepPerSizes:
    """A decode step whose sizes Dynamo made inputs, under its automatic dynamic
    shapes: a second generate() with another cache length, the chunks of a
    chunked prefill (their count of positions, the mask's length), the verify
    steps of prompt lookup (their count of candidates). Each call's sizes get a
    plan of their own, compiled on the first call with them; the MAX_PLANS
    most recently used are kept, and every plan reads the weight copies the
    others made of the same sources the same way (WeightArena.kept), so that
    memory holds one copy of each weight for all sizes. A plan's own checks
    still see every input's layout. When a plan cannot be compiled for some
    sizes, those calls run Dynamo's graph eagerly, logged: slow, never wrong."""

    MAX_PLANS = 8

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, glue: bool):
        self.gm, self.glue = gm, glue
        self.sizes = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.SymInt)]
        self.kept: dict = {}
        # The hints, not int(): that would add a guard and specialise Dynamo's graph.
        args = [optimization_hint(x) if isinstance(x, torch.SymInt) else x for x in example_inputs]
        plan, self.detail = compile_decode_plan(gm, args, glue, self.kept)
        self.plans = {tuple(args[i] for i in self.sizes): plan}  # in order of use, the latest last
        self.last = plan
        self.lock = threading.Lock()  # a call compiling a plan must not drop the one another thread replays

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
            plan, _ = compile_decode_plan(self.gm, list(args), self.glue, self.kept)
            log.info("decode step: a plan for sizes %s", key)
            return plan
        except (NotLowerable, _C.PlanError) as e:
            log.warning("decode step: no plan for sizes %s (%s); those calls run Dynamo's graph eagerly", key, e)
            return self.gm

    @property
    def last_call(self) -> dict | None:
        return getattr(self.last, "last_call", None)


__all__ = ["classify_decode_step", "compile_decode_step"]
