"""kwker's ops as PyTorch custom ops (namespace ``kwker``).

The FX rewrites put these into a graph in place of the patterns they recognise.
Each has one meaning, stated by its eager implementation here; the replay
lowering maps each to one native op, and Inductor calls them as extern kernels.
"""

import torch
import torch.nn.functional as F

_lib = torch.library.Library("kwker", "DEF")

_SCHEMAS = {
    # HF RMSNorm. gemma=False (Llama): weight * (x.float() * rsqrt(mean(x²) + eps)).to(x.dtype)
    # gemma=True: ((x.float() * rsqrt(mean(x²) + eps)) * (1 + weight.float())).to(x.dtype)
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps, bool gemma) -> Tensor",
    # residual = x + y; returns (residual, rms_norm(residual))
    "add_rms_norm": "add_rms_norm(Tensor x, Tensor y, Tensor weight, float eps, bool gemma) -> (Tensor, Tensor)",
    # x * cos + rotate_half(x) * sin, rotate_half over the last dim (HF's convention)
    "rotary": "rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor",
    "silu_mul": "silu_mul(Tensor gate, Tensor up) -> Tensor",
    # F.gelu(gate, approximate=approximate) * up: Gemma's MLP ("gelu_pytorch_tanh")
    "gelu_mul": "gelu_mul(Tensor gate, Tensor up, str approximate) -> Tensor",
    # x @ weight.T (+ bias); weight may be bfloat16 under float32 x (widened exactly)
    "linear": "linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    # one pass over x for weights stored back to back; outputs split by `sizes`
    "linear_multi": "linear_multi(Tensor x, Tensor weight, Tensor? bias, int[] sizes) -> Tensor[]",
    # A mixture of experts' projection (transformers' grouped_mm): x's rows sorted by
    # expert, rows [offs[e-1], offs[e]) times weight[e].T ([E, N, K]), rows past offs[-1] zero
    "grouped_linear": "grouped_linear(Tensor x, Tensor weight, Tensor offs) -> Tensor",
    # q [B,Hq,1,D] over caches [B,Hkv,S,D] with Hq % Hkv == 0, without repeating K/V
    "attention": "attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? mask, float scale) -> Tensor",
}
for _schema in _SCHEMAS.values():
    _lib.define(_schema)


def _rms_norm(x, weight, eps, gemma):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def _add_rms_norm(x, y, weight, eps, gemma):
    residual = x + y
    return residual, _rms_norm(residual, weight, eps, gemma)


def _rotary(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _silu_mul(gate, up):
    return F.silu(gate) * up


def _gelu_mul(gate, up, approximate):
    return F.gelu(gate, approximate=approximate) * up


def _linear(x, weight, bias):
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def _linear_multi(x, weight, bias, sizes):
    return list(_linear(x, weight, bias).split(sizes, dim=-1))


def _grouped_linear(x, weight, offs):
    y = torch.zeros(x.shape[0], weight.shape[1], dtype=x.dtype)
    start = 0
    for e, end in enumerate(offs.tolist()):
        y[start:end] = _linear(x[start:end], weight[e], None)
        start = end
    return y


def _attention(q, k_cache, v_cache, mask, scale):
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=scale, enable_gqa=True)


_EAGER = {
    "rms_norm": _rms_norm,
    "add_rms_norm": _add_rms_norm,
    "rotary": _rotary,
    "silu_mul": _silu_mul,
    "gelu_mul": _gelu_mul,
    "linear": _linear,
    "linear_multi": _linear_multi,
    "grouped_linear": _grouped_linear,
    "attention": _attention,
}
for _name, _fn in _EAGER.items():
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")


# The fake (meta) implementations are the eager code run on fake tensors: shapes
# and dtypes follow from the one definition, so the two cannot drift apart.
# grouped_linear's eager code reads its offsets, which a fake tensor has not.
for _name, _fn in _EAGER.items():
    if _name != "grouped_linear":
        torch.library.register_fake(f"kwker::{_name}", _fn, lib=_lib)
torch.library.register_fake("kwker::grouped_linear", lambda x, weight, offs: x.new_empty(x.shape[0], weight.shape[1]),
                            lib=_lib)

ops = torch.ops.kwker
