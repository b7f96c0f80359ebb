"""Decode steps: what makes a graph one, and what replays it.

A decode step is a CPU inference graph that writes non-parameter inputs in
place (the cache's index_copy_ and the counter's add_ of transformers'
StaticCache) at one query position; it may write its own intermediates in
place too (MoE routing's inverse permutation), never a parameter. routing.py
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
    for n in cache_writes:
        dim, src = n.args[1], n.args[3]
        if src.meta["val"].shape[dim] != 1:
            return f"{n.name} writes {src.meta['val'].shape[dim]} positions (prefill, not decode)"
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


def compile_decode_plan(gm: torch.fx.GraphModule, example_inputs, glue: bool = True):
    """The plan of a decode step whose sizes are all Python ints."""
    return compile_plan(gm, example_inputs, glue, classify=_not_a_decode_step)


def _not_a_decode_step(aten_gm, example_inputs) -> str | None:
    why = classify_decode_step(aten_gm, example_inputs)
    return f"not a decode step: {why}" if why else None


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
        self.plan, self.detail = compile_decode_plan(gm, args, glue)
        self.key = tuple(args[i] for i in self.sizes)
        self.lock = threading.Lock()  # a call compiling a plan must not drop the one another thread replays

    def __call__(self, *args):
        key = tuple(args[i] for i in self.sizes)
        with self.lock:
            if key != self.key:
                self.plan = self.key = None
                try:
                    self.plan, _ = compile_decode_plan(self.gm, list(args), self.glue)
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
