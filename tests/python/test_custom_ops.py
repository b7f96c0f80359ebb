"""torch.ops.kwker on CPU tensors runs the native ops (kwker._C.run_op): equal
to each op's PyTorch reference eagerly, inside an Inductor-compiled graph and
inside a plan's fallback step; a call the native op rejects runs the reference."""

import pytest
import torch

from kwker import _C, custom_ops
from kwker.custom_ops import NORM_GEMMA, NORM_LLAMA, NORM_OLMO, REFERENCE, ops

F32, BF16 = torch.float32, torch.bfloat16


def _rand(*shape, dtype=F32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + len(shape))).to(dtype)


def _cases(dtype):
    """(op name, args) for every kwker op, in shapes each native op accepts; the
    last two big enough to run on kwker's pool (runtime/kw_call.h), the rest on
    the calling thread."""
    r = lambda *s, seed=0, dt=dtype: _rand(*s, dtype=dt, seed=seed)  # noqa: E731
    rows = 6 if dtype == F32 else 20  # oneDNN's matmul from 4 rows in float32, 16 in bfloat16 (kwker.weights)
    return [
        ("rms_norm", (r(2, 5, 64), r(64, seed=1), 1e-6, NORM_LLAMA)),
        ("rms_norm", (r(3, 64), r(64, seed=1), 1e-5, NORM_GEMMA)),
        ("rms_norm", (r(3, 64), r(64, seed=1), 1e-5, NORM_OLMO)),
        ("add_rms_norm", (r(2, 3, 64), r(2, 3, 64, seed=2), r(64, seed=1), 1e-6, NORM_LLAMA)),
        ("add_rms_norm", (r(2, 3, 64), r(2, 3, 64, seed=2), r(64, seed=1), 1e-6, NORM_OLMO)),
        ("rotary", (r(1, 4, 5, 32), r(1, 1, 5, 32, seed=1), r(1, 1, 5, 32, seed=2))),
        ("silu_mul", (r(3, 7, 48), r(3, 7, 48, seed=1))),
        ("gelu_mul", (r(3, 40), r(3, 40, seed=1), "tanh")),
        ("gelu_mul", (r(3, 40), r(3, 40, seed=1), "none")),
        ("linear", (r(1, 1, 64), r(40, 64, seed=1), r(40, seed=2))),
        ("linear", (r(2, rows, 64), r(40, 64, seed=1), None)),
        ("linear", (r(2, rows, 64), r(40, 64, seed=1), r(40, seed=2))),
        ("linear", (r(1, 3, 64, dt=F32), r(40, 64, seed=1, dt=BF16), None)),  # bf16 weights under f32 x
        ("linear_multi", (r(1, 2, 64), r(48, 64, seed=1), r(48, seed=2), [16, 24, 8])),
        ("grouped_linear", (r(10, 32), r(3, 24, 32, seed=1), torch.tensor([3, 7, 9]))),
        ("attention", (r(1, 4, 1, 32), r(1, 2, 16, 32, seed=1), r(1, 2, 16, 32, seed=2),
                       torch.arange(16).view(1, 1, 1, 16) < 11, 32 ** -0.5)),
        ("attention", (r(1, 4, 3, 32), r(1, 2, 16, 32, seed=1), r(1, 2, 16, 32, seed=2),
                       torch.zeros(1, 1, 3, 16, dtype=dtype).masked_fill(torch.arange(16) > 12, -torch.inf), 0.2)),
        ("attention", (r(2, 4, 3, 32), r(2, 2, 16, 32, seed=1), r(2, 2, 16, 32, seed=2),  # padding rows: SDPA's mean of V
                       torch.full((2, 1, 3, 16), torch.finfo(dtype).min, dtype=dtype).index_fill_(-1, torch.tensor([0, 5]), 0)
                       .index_fill_(0, torch.tensor([1]), torch.finfo(dtype).min), 0.2)),
        ("attention", (r(2, 4, 1, 32), r(2, 2, 16, 32, seed=1), r(2, 2, 16, 32, seed=2),
                       (torch.arange(16) < 11).view(1, 1, 1, 16) & torch.tensor([True, False]).view(2, 1, 1, 1), 0.2)),
        ("attention", (r(1, 4, 3, 32), r(1, 4, 16, 32, seed=1), r(1, 4, 16, 32, seed=2),  # T5's: a bias per head
                       r(1, 4, 3, 16, seed=3), 1.0)),
        ("rms_norm", (r(96, 512), r(512, seed=1), 1e-6, NORM_LLAMA)),
        ("linear", (r(rows, 256), r(256, 256, seed=1), r(256, seed=2))),
    ]


def _ids(cases):
    return [f"{name}-{i}" for i, (name, _) in enumerate(cases)]


def _assert_equal(got, want, dtype):
    got, want = (list(x) if isinstance(x, (list, tuple)) else [x] for x in (got, want))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.is_contiguous()
        # float32: a few ulps of the result's scale, the most two summation orders part by
        # (a sum of 256 products of the reference's MKL on an Intel host differed from
        # kwker's by 1.2e-5 where the largest output was 88); a term lost would be 1e-1.
        scale = max(1.0, w.abs().max().item())
        tol = dict(rtol=1e-5, atol=1e-5 * scale) if dtype == F32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(g, w, **tol)


@pytest.fixture
def refused(monkeypatch):
    """The native ops that refused a call (its reference ran instead), by name."""
    names = []
    native = custom_ops._native

    def recording(name, *args):
        ran = native(name, *args)
        if not ran:
            names.append(name)
        return ran

    monkeypatch.setattr(custom_ops, "_native", recording)
    return names


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_each_op_runs_its_native_op_and_equals_its_reference_eagerly(dtype, refused):
    for name, args in _cases(dtype):
        _assert_equal(getattr(ops, name)(*args), REFERENCE[name](*args), dtype)
    assert refused == []


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_each_op_runs_its_native_op_inside_an_inductor_graph(dtype, refused):
    for name, args in _cases(dtype):
        torch._dynamo.reset()  # `graph` is one code object: a recompile per case would reach Dynamo's limit
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        rest = [a for a in args if not isinstance(a, torch.Tensor)]

        def graph(*ts, name=name, args=args, rest=rest):
            it, it_rest = iter(ts), iter(rest)
            full = [next(it) if isinstance(a, torch.Tensor) else next(it_rest) for a in args]
            out = getattr(ops, name)(*full)
            return [o * 2 for o in out] if isinstance(out, (list, tuple)) else out * 2  # an Inductor kernel after it

        compiled = torch.compile(graph, backend="inductor", fullgraph=True)
        want = REFERENCE[name](*args)
        want = [w * 2 for w in want] if isinstance(want, (list, tuple)) else want * 2
        _assert_equal(compiled(*tensors), want, dtype)
    assert refused == []


def test_a_call_the_native_op_rejects_runs_the_reference(refused):
    x, w = _rand(3, 64, dtype=torch.float16), _rand(64, dtype=torch.float16, seed=1)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6, NORM_LLAMA), REFERENCE["rms_norm"](x, w, 1e-6, NORM_LLAMA))
    x = _rand(64, 3).t()  # rows that are not contiguous
    w = _rand(40, 64, seed=1)
    y = ops.linear(x, w, None)
    assert y.is_contiguous()
    torch.testing.assert_close(y, x @ w.t())
    assert refused == ["rms_norm", "linear"]
    ys = ops.linear_multi(_rand(2, 64), _rand(50, 64, seed=1), None, [10] * 5)  # more outputs than its slots
    assert all(y.is_contiguous() for y in ys)
    torch.testing.assert_close(torch.cat(ys, -1), REFERENCE["linear"](_rand(2, 64), _rand(50, 64, seed=1), None))
    with pytest.raises(ValueError, match="form must be NORM_LLAMA, NORM_GEMMA or NORM_OLMO \\(got 3\\)"):
        ops.rms_norm(_rand(3, 64), _rand(64, seed=1), 1e-6, 3)


def _odd_calls():
    """Calls whose meaning a kernel would not give: the reference must run them."""
    return [
        ("silu_mul", (_rand(8, dtype=BF16), torch.tensor(2.0))),  # a 0-d float32 does not promote bf16
        ("gelu_mul", (torch.tensor(0.5), _rand(8, dtype=BF16), "tanh")),
        ("rotary", (_rand(1, 2, 3, 64, dtype=BF16), _rand(3, 64), _rand(3, 64, dtype=BF16, seed=1))),  # mixed dtypes
        ("silu_mul", (_rand(4, 8).double(), _rand(4, 8, seed=1).double())),  # a dtype kwker does not take
        ("grouped_linear", (_rand(6, 8), _rand(3, 5, 8, seed=1), torch.tensor([2, 4, 9]))),  # offsets past x
    ]


def test_calls_the_kernels_would_not_mean_the_same_run_the_reference_eagerly_and_inside_inductor():
    for name, args in _odd_calls():
        want = REFERENCE[name](*args)
        got = getattr(ops, name)(*args)
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=name)
    torch._dynamo.reset()
    x, s = _rand(8, dtype=BF16), torch.tensor(2.0)
    compiled = torch.compile(lambda x, s: ops.silu_mul(x, s) * 3 + 1, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(x, s), REFERENCE["silu_mul"](x, s) * 3 + 1)


def _raises_as(call, reference):
    """call raises the exception type reference raises."""
    with pytest.raises(Exception) as want:
        reference()
    with pytest.raises(want.type):
        call()


def test_calls_the_reference_refuses_are_refused():
    """Found by a hostile pass: each of these ran natively with another meaning.
    A tensor of no elements has no data pointer, which the native ops took for
    an absent bias, mask or weight; the native linear also reads kwker's
    K-blocked weights; the native attention takes caches and masks of other
    dtypes than q's."""
    x, w, b = _rand(3, 8), _rand(4, 8, seed=1), _rand(4, seed=2)
    q, k, v = _rand(1, 4, 1, 8), _rand(1, 2, 5, 8, seed=1), _rand(1, 2, 5, 8, seed=2)
    cases = [
        ("linear", (x, w, torch.empty(0))),
        ("linear", (x, _rand(2, 2, 4), None)),  # [K / B, N, B] with K / B == N
        ("linear", (x, torch.tensor(1.0), None)),
        ("linear_multi", (x, w, torch.empty(0), [2, 2])),
        ("linear_multi", (x, w, b, [2 ** 40, 4 - 2 ** 40])),
        ("linear_multi", (x, w, b, [3, 2])),
        ("attention", (q, k, v, torch.empty(0), 0.3)),
        ("attention", (q, k.bfloat16(), v.bfloat16(), None, 0.3)),
        ("attention", (q.bfloat16(), k.bfloat16(), v, None, 0.3)),
        ("attention", (q, k, v, torch.zeros(1, 1, 1, 5, dtype=BF16), 0.3)),
    ]
    for name, args in cases:
        _raises_as(lambda: getattr(ops, name)(*args), lambda: REFERENCE[name](*args))
    with pytest.raises(ValueError, match="v_cache \\(1, 2, 4, 8\\) must have k_cache's"):
        ops.attention(q, k, v[:, :, :4], None, 0.3)  # SDPA's CPU kernel reads past v's rows


def test_empty_tensors_and_sdpas_mixed_dtypes_mean_what_the_reference_means(refused):
    x = _rand(3, 1)
    for name, args in (("rms_norm", (x, torch.empty(0), 1e-6, NORM_LLAMA)),  # the weight broadcasts: [3, 0]
                       ("linear", (_rand(3, 0), _rand(4, 0, seed=1), _rand(4, seed=2))),  # K = 0: the bias
                       ("linear", (_rand(0, 8), _rand(4, 8, seed=1), None))):
        got, want = getattr(ops, name)(*args), REFERENCE[name](*args)
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want)
    q, k, v = (_rand(1, 4, 1, 8, dtype=BF16, seed=i) for i in range(3))
    mask = torch.zeros(1, 1, 1, 1)  # SDPA takes a float32 mask beside a bf16 q
    _assert_equal(ops.attention(q, k, v, mask, 0.3), REFERENCE["attention"](q, k, v, mask, 0.3), BF16)
    assert "attention" not in refused


def test_gradients_through_each_op_are_its_references():
    """The backward runs the reference again; without it the inputs' .grad
    stayed None (a custom op without an autograd formula), with a warning."""
    def requiring_grad(args):
        return [a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args]

    for name, args in _cases(F32):
        leaves, mine = requiring_grad(args), requiring_grad(args)
        for fn, inputs in ((REFERENCE[name], leaves), (getattr(ops, name), mine)):
            out = fn(*inputs)
            outs = out if isinstance(out, (list, tuple)) else [out]
            sum((o * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs).backward()
        for want, got in zip(leaves, mine):
            if isinstance(want, torch.Tensor) and want.requires_grad:
                assert got.grad is not None, name
                torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4, msg=name)
    x, w = _rand(3, 8).requires_grad_(), _rand(4, 8, seed=1).requires_grad_()
    y = ops.linear(x, w, None)
    with torch.no_grad():
        w.mul_(2)  # after the forward: the backward would recompute with other values
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_an_op_inside_a_plans_fallback_runs_on_that_thread():
    """The plan's pool is busy with the plan: the op runs on the calling thread alone."""
    x, w = _rand(4, 64), _rand(64, seed=1)
    b = _C.PlanBuilder()
    xb = b.input("x", F32, (4, 64))
    out = b.output_buffer("out", F32, (4, 64))
    views = [b.view(buf, F32, (4, 64), None, 0) for buf in (xb, out)]
    b.fallback(lambda reads, writes: writes[0].copy_(ops.rms_norm(reads[0], w, 1e-6, NORM_LLAMA)), views[:1], views[1:])
    b.output(views[1])
    plan = b.finish(2)
    (y,) = plan(x)
    torch.testing.assert_close(y, REFERENCE["rms_norm"](x, w, 1e-6, NORM_LLAMA), rtol=1e-5, atol=1e-5)


def test_run_op_checks_its_arguments():
    x, y = _rand(3, 64), torch.empty(3, 64)
    with pytest.raises(_C.PlanError, match="takes 1 int and 1 float parameters, got 1 and 0"):
        _C.run_op("rms_norm", [y, x, _rand(64)], [0])
    with pytest.raises(_C.PlanError, match="tensor 'x' is required"):
        _C.run_op("rms_norm", [y, None, _rand(64)], [0], [1e-6])
    with pytest.raises(_C.PlanError, match="no kwker op named 'nope'"):
        _C.run_op("nope", [])
    buf, up = torch.randn(2, 64), _rand(2, 64, seed=1)
    for y, gate, what in ((buf[:, 1:], buf[:, :-1], "y \\(written\\) overlaps gate"),
                          (buf, buf, "y \\(written\\) overlaps gate"),  # in place: a linear would read its own rows
                          (torch.zeros(1).expand(2, 64), buf, "y is written and its elements overlap")):
        with pytest.raises(_C.PlanError, match=f"silu_mul: {what}") as e:
            _C.run_op("silu_mul", [y, gate, up[:, :gate.shape[1]]])
        assert e.value.code == _C.EALIAS
    y = torch.empty(64, 2).t()  # written through strides: distinct elements, accepted
    _C.run_op("silu_mul", [y, buf, up])
    torch.testing.assert_close(y, REFERENCE["silu_mul"](buf, up), rtol=1e-5, atol=1e-6)
    with pytest.raises(IndexError, match="grouped_linear: the experts' offsets"):
        _C.run_op("grouped_linear", [torch.empty(10, 24), _rand(10, 32), _rand(3, 24, 32), torch.tensor([3, 12, 9])])


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_causal_attention_without_a_mask_is_rewritten_with_sdpas_top_left_mask(dtype):
    """SDPA's is_causal (HF's first chunk of a prefill, a whole sequence) keeps
    key j for query i where j <= i, also with more keys than queries; the
    rewrite gives kwker.attention that mask, run eagerly and folded by a plan
    (here one of the tuned candidates, checked against eager's outputs)."""
    import torch.nn.functional as F

    from kwker import summary

    def repeat_kv(x, n):  # HF's
        b, h, s, d = x.shape
        return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    def causal(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3), is_causal=True).transpose(1, 2)

    q = _rand(2, 6, 20, 32, dtype=dtype)
    for keys in (20, 48):
        k, v = _rand(2, 2, keys, 32, dtype=dtype, seed=1), _rand(2, 2, keys, 32, dtype=dtype, seed=2)
        want = causal(q, k, v)
        for options in ({"inner": "eager"}, {}):
            torch._dynamo.reset()
            summary.clear()
            with torch.no_grad():
                got = torch.compile(causal, backend="kwker", options=options)(q, k, v)
            graph = summary.graphs()[-1]
            torch.testing.assert_close(got, want, **({} if dtype == F32 else {"atol": 1e-2, "rtol": 1e-2}))
            if options:
                assert graph.rewrites.get("attention") == 1, summary.format_report()
            else:
                assert "plan" in graph.candidates and "plan" not in graph.left_out, summary.format_report()


def test_a_nan_in_an_attention_mask_makes_its_row_nan_as_in_sdpa():
    mask = torch.zeros(1, 1, 3, 8)
    mask[0, 0, 1, 3] = float("nan")
    args = (_rand(1, 4, 3, 16), _rand(1, 2, 8, 16, seed=1), _rand(1, 2, 8, 16, seed=2), mask, 0.25)
    got, want = ops.attention(*args), REFERENCE["attention"](*args)
    assert got[:, :, 1].isnan().all() and not got[:, :, [0, 2]].isnan().any()
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_attention_rewritten_for_inner_is_laid_out_as_sdpas_output_and_keeps_an_explicit_scale(inner):
    """Modules merge heads with a transpose and a view of SDPA's output, whose
    layout follows q's; kwker.attention's must be the same. scale=0.0 is a
    scale, not "the default"."""
    import torch.nn.functional as F

    from kwker import summary

    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = _rand(2, 5, 16)
    q, k, v = (_rand(2, 2, 3, 8, seed=s) for s in range(3))
    cases = [(lambda x: mha(x, x, x, need_weights=False)[0], (x,)),
             (lambda q, k, v: F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 3, 16), (q, k, v))]
    # With scale=0.0, Inductor's compile of the op expects another output layout
    # than the op's (its stride check raises at the first call): left, eager only.
    if inner == "eager":
        cases.append((lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.0), (q, k, v)))
    for fn, args in cases:
        torch._dynamo.reset()
        summary.clear()
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(fn, backend="kwker", options={"inner": inner})(*args), fn(*args))
        assert summary.graphs()[-1].rewrites.get("attention") == 1, summary.format_report()


def test_keys_repeated_otherwise_than_repeat_kv_are_attended_as_they_are():
    """repeat_kv's ops (unsqueeze at 2, expand, view) shaped otherwise are not a
    cache under a repeat: copies merged into the positions, heads split into
    more heads of fewer positions, one position broadcast to many."""
    import torch.nn.functional as F

    def expanded(x, n, shape):
        b, h, s, d = x.shape
        return x.unsqueeze(2).expand(b, h, n, s, d).reshape(shape)

    cases = [  # (n, the view's shape, q, the caches' shape, a mask)
        (2, (1, 2, 16, 32), _rand(1, 2, 16, 32), (1, 2, 8, 32), None),  # positions doubled
        (2, (1, 8, 2, 32), _rand(1, 8, 5, 32), (1, 2, 4, 32), None),  # heads of 4 positions split in two
        (8, (1, 2, 8, 32), _rand(1, 2, 8, 32), (1, 2, 1, 32), _rand(8, 8, seed=3)),  # one position, eight times
    ]
    for n, shape, q, cache, mask in cases:
        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, expanded(k, n, shape), expanded(v, n, shape), attn_mask=mask)

        k, v = _rand(*cache, seed=1), _rand(*cache, seed=2)
        torch._dynamo.reset()
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(attend, backend="kwker", options={"inner": "eager"})(q, k, v),
                                       attend(q, k, v))


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_a_whole_sequence_through_llama_keeps_the_querys_layout_under_its_rotary(inner):
    """HF's query is [B, L, H, D] in memory, and its attention's output, which
    the model views as [B, L, H·D], follows it: kwker.rotary's output must be
    laid out as its input, as the ops it replaces were."""
    from kwker import summary
    from kwker.testing import make_config, random_model

    model = random_model(make_config("LlamaConfig", vocab_size=64, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))

    def forward(ids):
        return model.model(input_ids=ids, use_cache=False).last_hidden_state

    torch._dynamo.reset()
    summary.clear()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(forward, backend="kwker", options={"inner": inner})(ids),
                                   forward(ids))
    rewrites = summary.graphs()[-1].rewrites
    assert rewrites.get("rotary") == 2 and rewrites.get("attention") == 1, summary.format_report()
