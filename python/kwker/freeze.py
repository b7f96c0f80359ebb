"""Inductor's freezing, made safe to keep: a tuned graph's candidate.

With `torch._inductor.config.freezing`, Inductor treats a model's parameters and
buffers as constants: it folds batch norms into the convolutions before them,
packs convolution weights for oneDNN once and picks channels-last layouts
(ResNet-50, fp32, batch 1 on the 2-vCPU Zen 5: 32.5 -> 21.3 ms). Turned on
globally it has a cost PyTorch documents: the compiled graph keeps computing
with the values the weights had when it was compiled, so `load_state_dict`, an
edit in place or another model of the same class (for which Dynamo reuses the
graph) gives wrong outputs without an error.

Here the graph's model tensors are made constants of a copy of Dynamo's graph,
the batch norms after convolutions are folded into them (what freezing would
fold, done once instead of in Inductor's rounds), and the copy is compiled with
freezing on, after each of the model's tensors is watched (kwker._C.Watch,
as for the weights a plan copies). Every call checks that each argument is
still the tensor that was frozen, at the same address and not written since;
if one is not, the frozen graph is released for good and the call, and every
later one, goes to the next fastest candidate the tuner timed.
"""

import inspect
import logging
import operator

import torch
from torch.nn.utils.fusion import fuse_conv_bn_weights

from kwker import _C, weights
from kwker.bounds import index_inputs
from kwker.guards import in_module
from kwker.tune import quiet
from kwker.rewrite.match import TORCH_CONVOLUTIONS, convolution_operands

log = logging.getLogger(__name__)


class FrozenGraph:
    """Dynamo's graph with its model tensors frozen, called with Dynamo's arguments."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list, inductor_patches: dict):
        from torch._inductor.compile_fx import compile_fx

        if torch.is_grad_enabled():
            raise ValueError("grad is enabled: Inductor freezes only graphs compiled under no_grad")
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.frozen = [i for i, (n, x) in enumerate(zip(placeholders, example_inputs))
                       if _model_tensor(n, x)]
        if not self.frozen:
            raise ValueError("the graph reads no parameter or buffer of a module")
        if weights.shared_with_other_processes([example_inputs[i] for i in self.frozen]):
            raise ValueError("a model tensor is in memory shared with other processes, whose writes no watch sees")
        if sum(example_inputs[i].nbytes for i in self.frozen) > weights.memory_for_copies():
            raise ValueError("the frozen constants (packed, folded copies of the model's tensors) would not fit in "
                             "the memory left (kwker.weights.memory_for_copies)")
        self.kept = [i for i in range(len(example_inputs)) if i not in self.frozen]
        # Watched before Inductor reads them: a write during the compile is seen.
        watches = [_C.Watch(example_inputs[i]) for i in self.frozen]
        graph = _with_constants(gm, {placeholders[i]: example_inputs[i] for i in self.frozen})
        _convolutions_in_float32(graph)
        _fold_batch_norms(graph)
        compiled = compile_fx(graph, [example_inputs[i] for i in self.kept],
                              config_patches={**inductor_patches, "freezing": True})
        # (the compiled graph, the watches), or None once released: one attribute,
        # read once per call, so that a release by another thread is seen whole.
        self.live = (compiled, watches)
        # What runs once the frozen values are stale: Dynamo's graph, eagerly, until the
        # tuner sets the next fastest candidate (a write during the timing finds it here).
        self.fallback = gm
        # The index inputs checked before each call (kwker.bounds), in Dynamo's graph, which Inductor
        # was given a copy of; where finding them fails, so does this candidate's build (the others timed).
        self.checks, self.eager = index_inputs(gm, example_inputs), quiet(gm)

    def __call__(self, *args):
        if self.checks.refuse(args):
            return self.eager(*args)
        live = self.live
        if live is not None:
            compiled, watches = live
            _C.Watch.handler_check()
            if all(w.matches(args[i]) for i, w in zip(self.frozen, watches)):
                return compiled(*[args[i] for i in self.kept])
            log.info("a frozen model tensor was written or replaced: the graph's next fastest candidate runs "
                     "from now on")
            self.live = None  # the constants and the watched pages go with it
        return self.fallback(*args)


def _model_tensor(node: torch.fx.Node, x) -> bool:
    source = getattr(node.meta.get("grapharg"), "source", None)
    return isinstance(x, torch.Tensor) and type(x) in (torch.Tensor, torch.nn.Parameter) \
        and source is not None and in_module(source)


def _with_constants(gm: torch.fx.GraphModule, constants: dict) -> torch.fx.GraphModule:
    """A copy of gm in which each placeholder of `constants` reads that tensor
    as an attribute of the module (a parameter or buffer): what Inductor's
    freezing makes a constant."""
    graph = torch.fx.Graph()
    attrs, env = {}, {}
    for node in gm.graph.nodes:
        if node in constants:
            name = f"kwker_frozen_{len(env)}"
            attrs[name] = constants[node]
            env[node] = graph.get_attr(name)
            env[node].meta = dict(node.meta)
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
        if node.op in ("get_attr", "call_module"):
            attrs[node.target] = operator.attrgetter(node.target)(gm)
    return torch.fx.GraphModule(attrs, graph)


_BATCH_NORM_PARAMETERS = list(inspect.signature(torch.nn.functional.batch_norm).parameters)


def _fold_batch_norms(gm: torch.fx.GraphModule) -> None:
    """Each batch norm in inference mode whose input is a convolution of
    constants, used by it alone, becomes that convolution with its weight and
    bias scaled and shifted (torch's fuse_conv_bn_weights in float64, rounded once
    to their dtype).
    Inductor's freezing folds these itself, but in rounds of pattern matching,
    each followed by a fake-tensor pass over the whole graph: ResNet-50's frozen
    compile (fp32, batch 1, Intel Xeon) took 6.2 s, 3.4 with the folds made here;
    MobileNetV2's 9.1 and 6.7."""
    attrs = {n: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for bn in list(gm.graph.nodes):
        if bn.op != "call_function" or bn.target is not torch.nn.functional.batch_norm:
            continue
        args = dict(zip(_BATCH_NORM_PARAMETERS, bn.args), **bn.kwargs)
        conv = rounded = args["input"]
        if _rounds_a_float32_convolution(rounded):  # the fold goes into its float32 constants
            conv = rounded.args[0]
        if args.get("training", False) is not False or not isinstance(conv, torch.fx.Node) \
                or conv.op != "call_function" or conv.target not in TORCH_CONVOLUTIONS or len(conv.users) != 1 \
                or len(rounded.users) != 1:
            continue
        _, weight, bias = convolution_operands(conv)
        tensors = [weight, bias, args["running_mean"], args["running_var"], args.get("weight"), args.get("bias")]
        if any(t is not None and t not in attrs for t in tensors) or weight is None or tensors[2] is None \
                or tensors[3] is None or _dims(conv) != attrs[weight].dim():
            continue  # not constants, or an unbatched convolution, whose channels are not dim 1
        w, b, mean, var, scale, shift = (attrs[t].detach().double() if t is not None else None for t in tensors)
        folded_w, folded_b = fuse_conv_bn_weights(w, b, mean, var, args.get("eps", 1e-5), scale, shift)
        dtypes = attrs[weight].dtype, attrs[bias].dtype if bias is not None else attrs[weight].dtype
        with gm.graph.inserting_before(conv):
            new = []
            for value in (folded_w.detach().to(dtypes[0]), folded_b.detach().to(dtypes[1])):
                name = f"kwker_folded_{len(attrs)}"
                gm.register_buffer(name, value)
                new.append(gm.graph.get_attr(name))
                attrs[new[-1]] = value
        conv.args = (conv.args[0], *new, *conv.args[3:])
        conv.kwargs = {k: v for k, v in conv.kwargs.items() if k not in ("weight", "bias")}
        bn.replace_all_uses_with(rounded)
        gm.graph.erase_node(bn)
        # The constants only the fold read (not dead-code elimination: it drops in-place ops).
        for t in dict.fromkeys(tensors):
            if t is not None and not t.users:
                gm.graph.erase_node(t)
    gm.recompile()


def _convolutions_in_float32(gm: torch.fx.GraphModule) -> None:
    """Each convolution of a bfloat16 input over constants that
    weights.convolution_storage copies to float32 (oneDNN has no bf16
    convolution for this CPU): the input widened, the constants as float32
    copies, the output rounded back to bfloat16 (_ROUNDING). Before the batch
    norms are folded, so that they fold into the float32 constants. A constant
    that several convolutions read (one module called twice) has one copy."""
    attrs = {n: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    copy_of = {}  # a constant's node: its float32 copy's name
    for conv in list(gm.graph.nodes):
        if conv.op != "call_function" or conv.target not in TORCH_CONVOLUTIONS:
            continue
        x, weight, bias = convolution_operands(conv)
        constants = [t for t in (weight, bias) if t is not None]
        x_value = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
        if any(t not in attrs for t in constants) or getattr(x_value, "dtype", None) != torch.bfloat16 \
                or weights.convolution_storage(attrs[weight]) is None:
            continue
        with gm.graph.inserting_before(conv):
            widened = gm.graph.call_method("float", (x,))
            copies = []
            for t in (weight, bias):
                if t is None:
                    copies.append(None)
                    continue
                if t not in copy_of:
                    copy_of[t] = f"kwker_float32_{len(attrs)}"
                    gm.register_buffer(copy_of[t], attrs[t].detach().float())
                copies.append(gm.graph.get_attr(copy_of[t]))
                attrs[copies[-1]] = getattr(gm, copy_of[t])
        conv.args = (widened, *copies, *conv.args[3:])
        conv.kwargs = {k: v for k, v in conv.kwargs.items() if k not in ("input", "weight", "bias")}
        with gm.graph.inserting_after(conv):
            rounded = gm.graph.call_method(_ROUNDING, (conv, torch.bfloat16))
        conv.replace_all_uses_with(rounded, delete_user_cb=lambda user: user is not rounded)
        for t in constants:
            if not t.users:
                gm.graph.erase_node(t)
    gm.recompile()


_ROUNDING = "to"  # the method that rounds a float32 convolution's output to bfloat16


def _rounds_a_float32_convolution(node) -> bool:
    """node is _convolutions_in_float32's rounding of a convolution's output."""
    return isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == _ROUNDING \
        and node.args[1:] == (torch.bfloat16,) and isinstance(node.args[0], torch.fx.Node) \
        and node.args[0].target in TORCH_CONVOLUTIONS


def _dims(node: torch.fx.Node) -> int | None:
    value = node.meta.get("example_value", node.meta.get("val"))
    return value.dim() if isinstance(value, torch.Tensor) else None


def worth_freezing(aten_gm: torch.fx.GraphModule) -> bool:
    """A graph with convolutions and batch norms: what freezing folds and
    packs. Elsewhere it measured no faster than Inductor's own graph
    (BERT-base 1.00x, the 4x1024 MLP 0.98x, ConvNeXt-tiny's depthwise
    convolutions and layer norms 1.02x), and each candidate costs a compile."""
    targets = {n.target for n in aten_gm.graph.nodes if n.op == "call_function"}
    return aten.convolution.default in targets and not targets.isdisjoint(_BATCH_NORMS)


# Freezing has measured at most 3.2x faster than stock Inductor's own graph
# (EfficientNet-B0, bf16, where Inductor's pooling is slow: 412 -> 130 ms; ResNet-50
# and MobileNetV2 1.5-1.9x), so where Inductor's call takes more than this many
# times another candidate's, a frozen graph would not be kept, and its compile (30 s
# of EfficientNet-B0's 65) is not spent.
MAX_GAIN_OVER_INDUCTOR = 4.0


def cannot_win(ms: dict[str, float]) -> str | None:
    """A kwker.tune gate: why a frozen candidate could not be the fastest, read
    off the steady times (ms) of the candidates built before it, Inductor's
    among them; or None."""
    others = {name: t for name, t in ms.items() if name != "inductor"}
    if "inductor" not in ms or not others:
        return None
    best = min(others, key=others.get)
    if ms["inductor"] > MAX_GAIN_OVER_INDUCTOR * others[best]:
        return (f"not compiled: Inductor's call takes {ms['inductor']:.3g} ms against {best}'s {others[best]:.3g}, "
                f"and freezing has measured at most 3.2x faster than Inductor")
    return None


aten = torch.ops.aten
_BATCH_NORMS = {aten.native_batch_norm.default, aten._native_batch_norm_legit_no_training.default}
