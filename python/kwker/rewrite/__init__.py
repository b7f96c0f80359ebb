"""FX rewrites for language models, on the ATen graph.

Each pass recognises one pattern and replaces it with one kwker op (the
written-out tanh GELU with ATen's own; a bf16 convolution oneDNN would run
slowly with a float32 one between conversions). They run
in a fixed order (attention before the linears, norms before the residual adds
that feed them) and report how many places each changed.
"""

import logging

import torch

from kwker.rewrite import convolution, experts, linear
from kwker.rewrite.attention import fuse_attention
from kwker.rewrite.convolution import convolutions_in_float32
from kwker.rewrite.experts import rewrite_experts
from kwker.rewrite.layer_norm import fuse_layer_norm
from kwker.rewrite.linear import rewrite_linears
from kwker.rewrite.rms_norm import fuse_residual_add, fuse_rms_norm
from kwker.rewrite.rotary import fuse_rotary
from kwker.rewrite.gated import fuse_gated_activations
from kwker.rewrite.gelu import fuse_tanh_gelu
from kwker.weights import PlanCopy, Storage, WeightArena

__all__ = ["planned_copies", "rewrite_language_model"]

log = logging.getLogger(__name__)


def planned_copies(gm: torch.fx.GraphModule, example_inputs) -> list[tuple[list[torch.Tensor], Storage]]:
    """The copies rewrite_language_model will ask for (each pass's planned_copies),
    read off Dynamo's graph before the ATen trace exists, so that the memory
    faults in while the trace runs, and a tuned graph's while Inductor compiles
    (GPT-2's transposed Conv1D weights at batch 8 in float32, 340 MB: its
    plan's build from 1.1 to 0.35 s, kwker.plan.reserve_weights)."""
    inputs = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs))
    return [copy for p in (linear, experts, convolution) for copy in p.planned_copies(gm, inputs)]


def rewrite_language_model(gm: torch.fx.GraphModule, glue: bool = True,
                           copy_into: tuple[dict[str, torch.Tensor], WeightArena] | None = None
                           ) -> tuple[dict[str, int], dict[str, PlanCopy]]:
    """glue=False keeps the model's own norms, rotary, tanh GELU and SiLU·mul as plain ops.
    copy_into, (params: placeholder name -> the real parameter, arena), is
    given for a graph a plan will replay, whose linears then read kwker's
    weight copies where those read fewer bytes (kwker.weights), and whose bf16
    convolutions float32 copies where oneDNN has no bf16 convolution, cut from
    the arena; the plan keeps them fresh. Other graphs keep their linears (and experts'
    grouped matmuls) and convolutions: nothing would keep a copy fresh there.
    Returns how many places each pass changed, and the copies read, by the
    graph attribute that holds each."""
    counts = {"attention": fuse_attention(gm)}
    if glue:
        counts["rms_norm"] = fuse_rms_norm(gm)
        counts["layer_norm"] = fuse_layer_norm(gm)
        gm.graph.eliminate_dead_code()  # the replaced norms' nodes would count as users of the residual sums
        counts["add_rms_norm"] = fuse_residual_add(gm)
        counts["rotary"] = fuse_rotary(gm)
        counts["tanh_gelu"] = fuse_tanh_gelu(gm)  # before the gated activations, which may then take it
        counts.update(fuse_gated_activations(gm))
    copies: dict[str, PlanCopy] = {}
    if copy_into is not None:
        params, arena = copy_into
        counts["linear"], copies = rewrite_linears(gm, params, arena)
        counts["grouped_linear"], expert_copies = rewrite_experts(gm, params, arena)
        counts["float32_convolution"], convolution_copies = convolutions_in_float32(gm, params, arena)
        copies |= expert_copies | convolution_copies
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    log.debug("rewrites: %s", counts)
    return counts, copies
