"""FX rewrites for language models, on the ATen graph.

Each pass recognises one pattern and replaces it with one kwker op. They run
in a fixed order (attention before the linears, norms before the residual adds
that feed them) and report how many places each changed.
"""

import logging

import torch

from kwker.rewrite.attention import fuse_decode_attention
from kwker.rewrite.linear import (PackedWeight, WeightArena, copied_weight_bytes, pack_weights, pack_weights_dtype,
                                  rewrite_linears)
from kwker.rewrite.rms_norm import fuse_residual_add, fuse_rms_norm
from kwker.rewrite.rotary import fuse_rotary
from kwker.rewrite.silu_mul import fuse_silu_mul

__all__ = ["PackedWeight", "WeightArena", "copied_weight_bytes", "pack_weights", "pack_weights_dtype",
           "rewrite_language_model"]

log = logging.getLogger(__name__)


def rewrite_language_model(gm: torch.fx.GraphModule, params: dict[str, torch.Tensor], glue: bool = True,
                           arena: WeightArena | None = None) -> dict[str, int]:
    """params: placeholder name -> the real parameter. glue=False keeps the
    model's own norm, rotary and SiLU·mul as plain ops. arena: where the
    weight copies go."""
    counts = {"decode_attention": fuse_decode_attention(gm)}
    if glue:
        counts["rms_norm"] = fuse_rms_norm(gm)
        gm.graph.eliminate_dead_code()  # the replaced norms' nodes would count as users of the residual sums
        counts["add_rms_norm"] = fuse_residual_add(gm)
        counts["rotary"] = fuse_rotary(gm)
        counts["silu_mul"] = fuse_silu_mul(gm)
    counts["linear"] = rewrite_linears(gm, params, arena=arena)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    log.debug("rewrites: %s", counts)
    return counts
