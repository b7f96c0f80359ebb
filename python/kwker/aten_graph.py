"""Dynamo's graph traced to ATen with fake tensors.

Every node of the result carries ``meta["val"]``: a fake tensor whose shape,
strides, storage offset and storage identity are those the real run will have.
The rewrites match canonical ATen ops (one spelling per operation, whatever
the model's Python looked like), and the replay lowering reads views and
storages from these values.
"""

import contextlib
import copy
import logging
import threading

import torch
from torch._decomp import decompositions
from torch._dynamo.convert_frame import compile_lock
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode

from kwker.lower import NotLowerable
from kwker.rewrite.match import written_arguments

# Composite ops whose C++ code checks their values only on real tensors: traced
# with fakes the check was gone, and a plan returned one-hot rows for a class
# past num_classes where eager raises. Traced through torch's Python
# decompositions, as Inductor's trace is, the checks stay (_assert_async nodes,
# run by the plan as PyTorch's ops).
_DECOMPOSED_WITH_CHECKS = {torch._C._nn.one_hot: decompositions.one_hot}


def trace_to_aten(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """Inside a backend call Dynamo's fake mode is found; outside it (a plan
    compiled again for new arguments) a new one. Either lets .item() of a float
    input trace as a symbol (Dynamo's allows it only under fullgraph=True). Raises
    NotLowerable where make_fx cannot follow gm (a branch on a float Dynamo
    made an input: a module's float attribute changed after the first
    compile), which Inductor may still compile, and where gm writes a tensor
    it holds rather than takes as an input (_RealWritesRefused)."""
    gm = _with_checks_decomposed(gm)
    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(shape_env=ShapeEnv())
    allowed, fake_mode.allow_scalar_outputs = fake_mode.allow_scalar_outputs, True
    with fake_mode:
        fake_inputs = [fake_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        # Without the mode that records which torch function made each node (no
        # pass reads it): the trace of a SmolLM2-360M decode step takes 1.4
        # s instead of 1.8 s, every node the same.
        try:
            # As under Dynamo's own compile (a plan traced again at call time is not): make_fx
            # marks the whole process as FX-tracing, and another thread entering a compiled
            # function then raised "Detected that you are using FX to symbolically trace a
            # dynamo-optimized function" unless a compile session is marked too; the lock keeps
            # two such traces from unmarking each other.
            with compile_lock, torch.compiler._compile_session_context(), _RealWritesRefused(), \
                    _meta_errors_unlogged():
                return make_fx(gm, tracing_mode="real", _disable_torch_fn_metadata_mode=True)(*fake_inputs)
        except _RealWrite as e:
            raise NotLowerable(str(e)) from e
        except Exception as e:  # noqa: BLE001 - any failure of the trace: the graph is not kwker's to replay
            raise NotLowerable(f"kwker's ATen trace failed ({type(e).__name__}: {e})") from e
        finally:
            fake_mode.allow_scalar_outputs = allowed


_tracing = threading.local()


def _not_of_this_trace(record: logging.LogRecord) -> bool:
    """A filter: drops the fake mode's errors logged in a thread inside kwker's trace."""
    return record.levelno < logging.ERROR or not getattr(_tracing, "active", False)


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_not_of_this_trace)


@contextlib.contextmanager
def _meta_errors_unlogged():
    """The fake mode logs, at ERROR with its traceback, each op whose meta
    function raises (a zero-size batch's upsample_nearest2d: 41 lines) before
    it raises. Of this thread's trace, the error is kwker's to report: the
    graph goes elsewhere with it as the reason (NotLowerable), and the graph
    that works printed tracebacks that stock Inductor does not. (A filter
    reads where it is called: the thread that logs.)"""
    _tracing.active = True
    try:
        yield
    finally:
        _tracing.active = False


def _with_checks_decomposed(gm):
    """gm, or a copy of it whose _DECOMPOSED_WITH_CHECKS calls are their
    decompositions' (gm itself is every candidate's: it stays as it is). A
    callable that is no fx graph (a module traced whole) is traced as it is."""
    if not isinstance(gm, torch.fx.GraphModule) or \
            not any(n.op == "call_function" and n.target in _DECOMPOSED_WITH_CHECKS for n in gm.graph.nodes):
        return gm
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _DECOMPOSED_WITH_CHECKS:
            node.target = _DECOMPOSED_WITH_CHECKS[node.target]
    return torch.fx.GraphModule(gm, graph)


class _RealWrite(Exception):
    pass


class _RealWritesRefused(TorchDispatchMode):
    """Refuses, before it runs, an op of the trace that writes a real tensor.

    The inputs are traced as fakes, but a tensor Dynamo holds as an attribute of
    gm (an optimizer's state and parameters: `torch.compile(opt.step)`) is
    real, and the fake mode runs an op whose tensors are all real for real (it
    folds constants): `step += 1` or `buf.mul_(momentum)` then updated the
    optimizer once more at every compile, after which the trace failed on the
    next op that mixed real and fake tensors. Such a graph is not kwker's to
    replay: its writes reach no input, so neither a plan nor the tuner's put-back
    of written inputs would see them (it goes to Inductor)."""

    # A higher-order op (cond, flex_attention) passes through: make_fx traces its
    # subgraphs' ops with this mode on the stack, so each of them is checked.
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverload) and any(
                isinstance(t, torch.Tensor) and not is_fake(t) for t in written_arguments(func, args, kwargs)):
            raise _RealWrite(f"the graph writes a tensor it holds rather than takes as an input ({func}: "
                             "an optimizer's state, a module's attribute), which kwker does not replay")
        return func(*args, **kwargs)
