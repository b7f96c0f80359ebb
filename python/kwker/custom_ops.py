"""kwker's ops as PyTorch custom ops (namespace ``kwker``).

The FX rewrites put these into a graph in place of the patterns they recognise.
Each has one meaning, stated by its reference implementation here (REFERENCE:
PyTorch code, the tests' reference). On CPU tensors each runs its native op
(kwker._C.run_op on kwker's pool) wherever that op's rules accept the call:
eagerly, as Inductor's extern kernel, or as a plan's fallback step. The replay
lowering maps each to the same native op as a step of a plan.
"""

import logging

import torch
import torch.nn.functional as F

from kwker import _C
from kwker.weights import by_matmul, rows_per_call

log = logging.getLogger(__name__)
_P = _C.op_params()

_lib = torch.library.Library("kwker", "DEF")

_SCHEMAS = {
    # HF's RMSNorms, x̂ = x.float() * rsqrt(mean(x²) + eps), by form (NORM_LLAMA, _GEMMA, _OLMO):
    # Llama's weight * x̂.to(x.dtype); Gemma's (x̂ * (1 + weight.float())).to(x.dtype);
    # OLMo 2's (weight.float() * x̂).to(x.dtype)
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps, int form) -> Tensor",
    # residual = x + y; returns (residual, rms_norm(residual))
    "add_rms_norm": "add_rms_norm(Tensor x, Tensor y, Tensor weight, float eps, int form) -> (Tensor, Tensor)",
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

NORM_LLAMA, NORM_GEMMA, NORM_OLMO = _P["NORM_LLAMA"], _P["NORM_GEMMA"], _P["NORM_OLMO"]


def _rms_norm(x, weight, eps, form):
    if form not in (NORM_LLAMA, NORM_GEMMA, NORM_OLMO):
        raise ValueError(f"kwker.rms_norm: form must be NORM_LLAMA, NORM_GEMMA or NORM_OLMO (got {form})")
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if form == NORM_GEMMA:
        return (h * (1.0 + weight.float())).to(x.dtype)
    if form == NORM_OLMO:
        return (weight.float() * h).to(x.dtype)
    return weight * h.to(x.dtype)


def _add_rms_norm(x, y, weight, eps, form):
    residual = x + y
    return residual, _rms_norm(residual, weight, eps, form)


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


REFERENCE = {
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


# ---- the CPU implementations: the native op where its rules accept the call ----------
# Each allocates its outputs contiguous, attention's as SDPA's (the fake
# implementation promises that layout, which Inductor asserts on its extern
# kernels' outputs), runs the native op through _C.run_op, and runs the
# reference where the native op rejects the call (a float16 input, rows that are
# not contiguous). lower.py gives a plan's steps the same native ops and slots.

def _native(name: str, tensors: list, ip=(), fp=()) -> bool:
    try:
        _C.run_op(name, tensors, ip, fp)
        return True
    # The op's rules reject the call (PlanError), a tensor is of a dtype or rank
    # kwker does not take (TypeError, ValueError), or grouped_linear's offsets run
    # past x (IndexError, which a plan raises): the reference, the op's meaning, runs.
    except (_C.PlanError, TypeError, ValueError, IndexError) as e:
        log.debug("kwker.%s runs its reference: %s", name, e)
        return False


def _contiguous(out):
    if isinstance(out, (list, tuple)):
        return type(out)(t.contiguous() for t in out)
    return out.contiguous()


def _norm_dtype(x, weight, form):
    return torch.result_type(weight, x) if form == NORM_LLAMA else x.dtype


def _cpu_rms_norm(x, weight, eps, form):
    y = x.new_empty(x.shape, dtype=_norm_dtype(x, weight, form))
    if _native("rms_norm", [y, x, weight], [form], [eps]):
        return y
    return _contiguous(_rms_norm(x, weight, eps, form))


def _cpu_add_rms_norm(x, y, weight, eps, form):
    residual = _elementwise_out(x, y)
    if residual is not None:
        normed = residual.new_empty(residual.shape, dtype=_norm_dtype(residual, weight, form))
        if _native("add_rms_norm", [normed, residual, x, y, weight], [form], [eps]):
            return residual, normed
    return _contiguous(_add_rms_norm(x, y, weight, eps, form))


def _broadcast_shape(*xs) -> torch.Size:
    shape = xs[0].shape  # most calls' inputs have one shape; torch.broadcast_shapes costs 15 µs
    return shape if all(x.shape == shape for x in xs) else torch.broadcast_shapes(*(x.shape for x in xs))


def _elementwise_out(*xs):
    """The output of an op over xs of one dtype (_laid_out_as xs[0]), or None:
    PyTorch's promotion rounds mixed dtypes at each step of the reference
    (rotary's two products in bf16 before their sum), and a 0-d tensor does not
    promote the others, which the kernels would not follow."""
    if any(x.dtype != xs[0].dtype for x in xs):
        return None
    return _laid_out_as(xs[0], _broadcast_shape(*xs), xs[0].dtype)


def _laid_out_as(x, shape, dtype):
    """An empty output whose dims lie in memory in the order of x's strides
    where x has its shape, as ATen's elementwise ops lay out theirs; else
    contiguous. The graph after a rewritten rotary views its output as it viewed
    the ops' it replaced: HF's query is [B, L, H, D] in memory, and so is then
    the attention's output (attention_output), which the graph views as
    [B, L, H·D]."""
    if tuple(x.shape) != tuple(shape):
        return x.new_empty(shape, dtype=dtype)
    return torch.empty_permuted(shape, _dims_by_stride(x), dtype=dtype, device=x.device)


def _elementwise(out, x):
    """A reference's output, laid out as the native op's (_laid_out_as x)."""
    return _laid_out_as(x, out.shape, out.dtype).copy_(out)


def _dims_by_stride(t) -> list[int]:
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


# The ops whose outputs are laid out as their first input, as the elementwise ops they replace.
ELEMENTWISE = ("rotary", "silu_mul", "gelu_mul")


# kwker.rotary's int parameters for the native rotary: HF's rotate_half over all of x's last dim
ROTARY_HALF = (_P["ROPE_HALF"], 0)


def _cpu_rotary(x, cos, sin):
    y = _elementwise_out(x, cos, sin)
    if y is not None and _native("rotary", [y, x, cos, sin], ROTARY_HALF):
        return y
    return _elementwise(_rotary(x, cos, sin), x)


def _cpu_silu_mul(gate, up):
    y = _elementwise_out(gate, up)
    if y is not None and _native("silu_mul", [y, gate, up]):
        return y
    return _elementwise(_silu_mul(gate, up), gate)


# gelu's and gelu_mul's int parameter, by approximate=
GELU_MODES = {"none": _P["GELU_ERF"], "tanh": _P["GELU_TANH"]}


def _cpu_gelu_mul(gate, up, approximate):
    y = _elementwise_out(gate, up)
    if y is not None and approximate in GELU_MODES and _native("gelu_mul", [y, gate, up], [GELU_MODES[approximate]]):
        return y
    return _elementwise(_gelu_mul(gate, up, approximate), gate)


def _linear_shapes(x, weight) -> bool:
    """x [..., K] and weight [N, K] as F.linear takes them: the native ops also
    read the K-blocked layout of kwker's copies ([K / B, N, B]), which F.linear
    refuses, so any other weight runs the reference."""
    return weight.dim() == 2 and x.dim() >= 1


def _cpu_linear(x, weight, bias):
    """oneDNN's matmul from the rows where it measured faster (kwker.weights),
    kwker's linear below them or where matmul_dnnl refuses the weight."""
    if _linear_shapes(x, weight):
        y = x.new_empty((*x.shape[:-1], weight.shape[0]))
        slots = [y, x, weight, bias]
        if by_matmul(x.dtype, rows_per_call(x)) and _native("matmul_dnnl", slots) or _native("linear", slots):
            return y
    return _contiguous(_linear(x, weight, bias))


# linear_multi's output slots (ops/linear.c)
LINEAR_MULTI_OUTPUTS = 4


def _cpu_linear_multi(x, weight, bias, sizes):
    if len(sizes) > LINEAR_MULTI_OUTPUTS:
        log.debug("kwker.linear_multi runs its reference: %d outputs, the native op has %d", len(sizes),
                  LINEAR_MULTI_OUTPUTS)
    elif _linear_shapes(x, weight) and min(sizes, default=-1) >= 0 and sum(sizes) == weight.shape[0]:
        ys = [x.new_empty((*x.shape[:-1], n)) for n in sizes]
        if _native("linear_multi", [*ys, *[None] * (LINEAR_MULTI_OUTPUTS - len(ys)), x, weight, bias]):
            return ys
    return _contiguous(_linear_multi(x, weight, bias, sizes))


def _cpu_grouped_linear(x, weight, offs):
    y = x.new_empty((x.shape[0], weight.shape[1]))
    if _native("grouped_linear", [y, x, weight, offs]):
        return y
    return _contiguous(_grouped_linear(x, weight, offs))


def attention_output(q, v_cache):
    """attention's output, laid out as SDPA's CPU kernel lays out its own: its
    dims in the order of q's strides (HF's q is [B, L, H, D] in memory). The
    graph the op replaces views it so (heads merged by a transpose and a view)."""
    return torch.empty_permuted((*q.shape[:-1], v_cache.shape[-1]), _dims_by_stride(q), dtype=q.dtype,
                                device=q.device)


def _sdpa_dtypes(q, k_cache, v_cache, mask) -> bool:
    """q, k and v of one dtype, a mask bool, float32 or q's: what SDPA takes
    (the native op also takes caches and masks of other float dtypes)."""
    return k_cache.dtype == v_cache.dtype == q.dtype and \
        (mask is None or mask.dtype in (torch.bool, torch.float32, q.dtype))


def _cpu_attention(q, k_cache, v_cache, mask, scale):
    if q.dim() == k_cache.dim() == v_cache.dim() == 4 and k_cache.shape[:-1] != v_cache.shape[:-1]:
        # SDPA's CPU kernel reads past v's rows instead of refusing them
        raise ValueError(f"kwker.attention: v_cache {tuple(v_cache.shape)} must have k_cache's "
                         f"{tuple(k_cache.shape)} batch, heads and positions")
    y = attention_output(q, v_cache)
    if _sdpa_dtypes(q, k_cache, v_cache, mask) and _native("attention", [y, q, k_cache, v_cache, mask], (), [scale]):
        return y
    return y.copy_(_attention(q, k_cache, v_cache, mask, scale))


_CPU = {
    "rms_norm": _cpu_rms_norm,
    "add_rms_norm": _cpu_add_rms_norm,
    "rotary": _cpu_rotary,
    "silu_mul": _cpu_silu_mul,
    "gelu_mul": _cpu_gelu_mul,
    "linear": _cpu_linear,
    "linear_multi": _cpu_linear_multi,
    "grouped_linear": _cpu_grouped_linear,
    "attention": _cpu_attention,
}
for _name, _fn in _CPU.items():
    _lib.impl(_name, _fn, "CPU")


# The fake (meta) implementations are the reference run on fake tensors, its
# outputs laid out as the CPU implementations' are (contiguous, or as the first
# input for ELEMENTWISE ops): shapes and dtypes follow from the one definition,
# so the two cannot drift apart. grouped_linear's reference reads its offsets,
# which a fake tensor has not; attention's output has SDPA's layout.
for _name, _fn in REFERENCE.items():
    if _name in ELEMENTWISE:
        torch.library.register_fake(f"kwker::{_name}", lambda *args, _fn=_fn: _elementwise(_fn(*args), args[0]),
                                    lib=_lib)
    elif _name not in ("grouped_linear", "attention"):
        torch.library.register_fake(f"kwker::{_name}", lambda *args, _fn=_fn: _contiguous(_fn(*args)), lib=_lib)
torch.library.register_fake("kwker::grouped_linear", lambda x, weight, offs: x.new_empty(x.shape[0], weight.shape[1]),
                            lib=_lib)
torch.library.register_fake("kwker::attention", lambda q, k_cache, v_cache, mask, scale: attention_output(q, v_cache),
                            lib=_lib)


# Gradients are the reference's: the backward runs the reference again under
# autograd. kwker's rewrites never put these ops in a training graph; a direct
# call with inputs that require grad gets what the op means, not a silent None.
_SAVED = object()  # where a tensor input stood among the others (None is an absent optional tensor)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*(t for t in inputs if isinstance(t, torch.Tensor)))  # an in-place edit after: an error
    ctx.others = [_SAVED if isinstance(t, torch.Tensor) else t for t in inputs]


def _backward(name):
    reference = REFERENCE[name]

    def backward(ctx, *grads):
        grads = [g for gs in grads for g in (gs if isinstance(gs, (list, tuple)) else [gs])]  # Tensor[]: a list
        saved = iter(ctx.saved_tensors)
        inputs = [next(saved) if t is _SAVED else t for t in ctx.others]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad) if need]
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() if i in wanted else t for i, t in enumerate(inputs)]
            outputs = reference(*inputs)
            outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
            pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wanted], [g for _, g in pairs],
                                      allow_unused=True) if pairs else [None] * len(wanted)
        result = [None] * len(inputs)
        for i, g in zip(wanted, got):
            result[i] = g
        return tuple(result)

    return backward


for _name in REFERENCE:
    torch.library.register_autograd(f"kwker::{_name}", _backward(_name), setup_context=_setup_context, lib=_lib)

ops = torch.ops.kwker
