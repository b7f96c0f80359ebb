"""Which path a graph takes, decided from Dynamo's own graph and example inputs
before kwker traces, rewrites or copies anything: a graph handed to Inductor
costs kwker nothing."""

import re
from dataclasses import dataclass

import torch


# The floating dtypes kwker's kernels read and write.
KERNEL_FLOAT_DTYPES = frozenset({torch.float32, torch.bfloat16})


@dataclass(frozen=True)
class Route:
    # "inductor-unchanged", "inductor", "eager", "decode", "cpu-inference", "inference-dynamic", "training"
    # or "training-dynamic"
    path: str
    reason: str


def held_tensors(gm: torch.fx.GraphModule, example_inputs) -> list[torch.Tensor]:
    """The graph's tensor inputs and its constants."""
    return [*(x for x in example_inputs if isinstance(x, torch.Tensor)), *gm.state_dict().values()]


def graph_devices(gm: torch.fx.GraphModule, example_inputs) -> set[str]:
    """Device types of the graph's inputs, its constants and the values its nodes produce."""
    devices = {t.device.type for t in held_tensors(gm, example_inputs)}
    for node in gm.graph.nodes:
        val = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(val, torch.Tensor):
            devices.add(val.device.type)
    return devices


def _unbound(method):
    return getattr(method, "__func__", method)


# What a tensor's class may have as __torch_function__ for Dynamo's graph, run
# again on it, to compute what eager did: Tensor's (a plain subclass's outputs
# only keep their class) or none (Parameter's).
_PLAIN_TORCH_FUNCTIONS = (_unbound(torch.Tensor.__torch_function__), torch._C._disabled_torch_function_impl)


def subclass_kwker_cannot_run(gm: torch.fx.GraphModule, example_inputs) -> str | None:
    """Why an input or constant of the graph is of a tensor subclass kwker must
    leave to Inductor, or None. One whose class has a __torch_function__ of its
    own: Dynamo traced what it did into the graph, which run again on such a
    tensor (eager as a candidate, and as the truth the tuning checks against)
    applies it a second time. One with a __torch_dispatch__ (a wrapper subclass:
    TwoTensor, a quantized weight, whose values live in the tensors it wraps; a
    fake tensor): no memory of its own for kwker's kernels to read."""
    for t in held_tensors(gm, example_inputs):
        cls = type(t)
        if _unbound(cls.__torch_function__) not in _PLAIN_TORCH_FUNCTIONS:
            return (f"a tensor of class {cls.__name__} overrides __torch_function__, which Dynamo traced into the "
                    "graph: run again on it (eager, the tuning's check) it applies twice")
        if _unbound(cls.__torch_dispatch__) is not _unbound(torch.Tensor.__torch_dispatch__):
            return f"a tensor of class {cls.__name__} has its own __torch_dispatch__: no memory for kwker's kernels"
    return None


def forward_ad_dual(example_inputs) -> bool:
    """An input is a dual tensor of forward-mode AD at the caller's dual level."""
    return any(isinstance(x, torch.Tensor) and torch.autograd.forward_ad.unpack_dual(x).tangent is not None
               for x in example_inputs)


def symbolic_tensor(example_inputs) -> bool:
    """A tensor input with a symbolic size or stride (Dynamo passes real tensors,
    and the sizes it made dynamic as separate SymInt inputs)."""
    return any(isinstance(x, torch.Tensor) and not all(isinstance(d, int) for d in (*x.shape, *x.stride()))
               for x in example_inputs)


def size_inputs(example_inputs) -> bool:
    """Sizes Dynamo made dynamic (automatic dynamic shapes: a second generate()
    with another cache length), which reach the graph as SymInt inputs."""
    return any(isinstance(x, torch.SymInt) for x in example_inputs)


def route_graph(gm: torch.fx.GraphModule, example_inputs, grad_enabled: bool = False) -> Route:
    # Any device but the CPU (an accelerator, meta, a backend of another library):
    # kwker's kernels, timings and checks are for the CPU.
    elsewhere = sorted(graph_devices(gm, example_inputs) - {"cpu"})
    if elsewhere:
        return Route("inductor-unchanged", f"tensors on {', '.join(elsewhere)}: kwker's kernels are CPU-only")
    subclass = subclass_kwker_cannot_run(gm, example_inputs)
    if subclass:
        return Route("inductor-unchanged", subclass)
    if forward_ad_dual(example_inputs):
        return Route("eager", "a dual tensor of forward-mode AD: Dynamo's graph run eagerly carries its tangent, "
                              "which compiled kernels drop")
    dynamic = Route("inference-dynamic", "dynamic shapes: kwker's plans need static shapes")
    if grad_enabled and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs):
        if symbolic_tensor(example_inputs) or size_inputs(example_inputs):
            return Route("training-dynamic", "a training graph with dynamic shapes: kwker's plans need static shapes")
        return Route("training", "a training graph (grad enabled, an input requires grad)")
    if symbolic_tensor(example_inputs):
        return dynamic
    positions = cache_positions(gm)
    if positions is None:
        return dynamic if size_inputs(example_inputs) else Route("cpu-inference", "a CPU inference graph with static shapes")
    unfit = unfit_for_kernels(gm, example_inputs)
    if unfit:
        return Route("inductor", f"a decode step kwker cannot replay: {unfit}")
    what = "one position" if positions == 1 else f"{positions} positions"
    if size_inputs(example_inputs):
        return Route("decode", f"a decode step with int inputs: writes a static cache at {what}; "
                               "a plan for each call's sizes that tensor ops read")
    return Route("decode", f"a decode step: writes a static cache at {what}")


def cache_positions(gm: torch.fx.GraphModule) -> int | str | None:
    """On Dynamo's graph: how many positions it writes of a graph input with
    index_copy_ (a static cache), the size's symbol when that is dynamic, or
    None when it writes no cache. One in a token's decode step; more in a chunk
    of a prefill, a verify step of prompt lookup, assisted decoding. A full
    sliding-window cache layer writes its one new position by copying a roll
    of itself back into itself (transformers' StaticSlidingWindowLayer)."""
    found = None
    rolled = {node.args[0] for node in gm.graph.nodes if node.op == "call_method" and node.target == "roll"}
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target == "copy_" and node.args[0] in rolled \
                and node.args[0].op == "placeholder":
            found = found or 1
            continue
        if not (node.op == "call_method" and node.target == "index_copy_"):
            continue
        cache, dim, _, src = (list(node.args) + [None] * 4)[:4]
        if not (isinstance(cache, torch.fx.Node) and cache.op == "placeholder" and isinstance(dim, int)):
            continue
        value = src.meta.get("example_value") if isinstance(src, torch.fx.Node) else None
        size = value.shape[dim] if isinstance(value, torch.Tensor) and value.dim() > dim else 1
        found = size if isinstance(size, int) else str(size)
    return found


def unfit_for_kernels(gm: torch.fx.GraphModule, example_inputs) -> str | None:
    """Why a decode step's inputs are not what kwker's kernels take, or None."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name, x in zip(placeholders, dynamo_input_names(gm), example_inputs):
        if not node.users:
            continue
        if isinstance(x, torch.Tensor):
            scalar = x.dim() == 0 and x.dtype == torch.float64  # a float of the model: plan.specialize_scalars
            if x.is_floating_point() and x.dtype not in KERNEL_FLOAT_DTYPES and not scalar:
                return f"input '{name}' is {x.dtype}; kwker's kernels take float32 and bfloat16"
            if x.is_complex():
                return f"input '{name}' is {x.dtype}"
        elif not isinstance(x, (int, bool, torch.SymInt)):
            return f"input '{name}' is a {type(x).__name__}, not a tensor"
    return None


_MODULE_STEP = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]")


def dynamo_input_names(gm: torch.fx.GraphModule) -> list[str]:
    """What each of Dynamo's graph inputs is to the user: a module's tensor by
    its path in the model ("model.layers.0.mlp.up_proj.weight"), another by its
    Dynamo source ("L['kwargs']['input_ids']"), else the placeholder's name.
    Kept in gm.meta from the first call: Dynamo drops the sources once the
    backend has returned, and a plan compiled again later must name them too."""
    if "kwker_input_names" in gm.meta:
        return gm.meta["kwker_input_names"]
    names = []
    for node in (n for n in gm.graph.nodes if n.op == "placeholder"):
        source = getattr(node.meta.get("grapharg"), "source", None)
        if source is None:
            names.append(node.name)
            continue
        path = _MODULE_STEP.findall(source.name)
        names.append(".".join(path) if path else source.name)
    gm.meta["kwker_input_names"] = names
    return names
