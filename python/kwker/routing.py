"""Which path a graph takes, decided from what the graph is, not from names."""

from dataclasses import dataclass

import torch

# Accelerators kwker leaves to Inductor unchanged: kwker's kernels are for the CPU.
ACCELERATOR_DEVICES = frozenset({"cuda", "xpu", "mps"})


@dataclass(frozen=True)
class Route:
    path: str  # "inductor-unchanged", "inductor" or "cpu-inference"
    reason: str


def graph_devices(gm: torch.fx.GraphModule, example_inputs) -> set[str]:
    """Device types of the graph's inputs, its constants and the values its nodes produce."""
    devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    devices.update(t.device.type for t in gm.state_dict().values())
    for node in gm.graph.nodes:
        val = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(val, torch.Tensor):
            devices.add(val.device.type)
    return devices


def route_graph(devices: set[str], grad_enabled: bool = False, static_shapes: bool = True) -> Route:
    accelerators = sorted(devices & ACCELERATOR_DEVICES)
    if accelerators:
        return Route("inductor-unchanged", f"tensors on {', '.join(accelerators)}: kwker's kernels are CPU-only")
    if grad_enabled:
        return Route("inductor", "a training graph (grad enabled): Inductor compiles it")
    if not static_shapes:
        return Route("inductor", "dynamic shapes: kwker's rewrites and plans need static shapes")
    return Route("cpu-inference", "a CPU inference graph with static shapes")
