"""The backend as torch sees it: discovery, options, mode, routing, logging."""

import copy
import itertools
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kwker
from kwker.options import parse_options
from kwker.routing import graph_devices, route_graph


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter, with TORCH_LOGS only as given here."""
    base = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env={**base, **env})


def test_torch_finds_kwker_through_its_entry_point_without_an_import():
    code = (
        "import sys, torch\n"
        "assert 'kwker' not in sys.modules\n"
        "m = torch.nn.Linear(8, 8)\n"
        "x = torch.randn(2, 8)\n"
        "out = torch.compile(m, backend='kwker')(x)\n"
        "torch.testing.assert_close(out, m(x))\n"
        "assert 'kwker' in sys.modules\n"
        "print('ok')\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_backend_function_itself_works_as_a_backend():
    import kwker.dynamo_backend  # once torch has loaded the entry point, kwker.backend is still the function

    assert kwker.backend is kwker.dynamo_backend.kwker_backend
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    torch.testing.assert_close(torch.compile(m, backend=kwker.backend)(x), m(x))


class InductorConfigSpy:
    """A post-grad pass: Inductor calls it while compiling, under the config it compiles with."""

    def __init__(self, *names):
        self.names, self.seen = names, []

    def __call__(self, graph):
        from torch._inductor import config

        self.seen.append({n: getattr(config, n) for n in self.names})

    def uuid(self):  # lets Inductor's FX graph cache key on the pass
        return None


def test_an_inductor_option_reaches_inductors_config():
    spy = InductorConfigSpy("epilogue_fusion", "max_autotune")
    default = torch._inductor.config.epilogue_fusion
    fn = torch.compile(
        lambda x: (x.sin() + 1).relu(),
        backend="kwker",
        options={"post-grad-custom-post-pass": spy, "epilogue_fusion": not default},
    )
    x = torch.randn(16)
    torch.testing.assert_close(fn(x), (x.sin() + 1).relu())
    assert spy.seen == [{"epilogue_fusion": not default, "max_autotune": False}]


def test_mode_reaches_inductors_config():
    spy = InductorConfigSpy("max_autotune", "coordinate_descent_tuning")
    with torch._inductor.config.patch(post_grad_custom_post_pass=spy):
        fn = torch.compile(lambda x: x.cos() * 2, backend="kwker", mode="max-autotune-no-cudagraphs")
        x = torch.randn(16)
        torch.testing.assert_close(fn(x), x.cos() * 2)
    assert spy.seen == [{"max_autotune": True, "coordinate_descent_tuning": True}]


def test_an_unknown_option_raises_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"unknown option 'max_autotuen'.*did you mean 'max_autotune'.*'inner'.*'glue'"):
        parse_options(None, {"max_autotuen": True})
    fn = torch.compile(lambda x: x + 1, backend="kwker", options={"no_such_option": 1})
    with pytest.raises(Exception, match="unknown option 'no_such_option'"):
        fn(torch.randn(4))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"inner": "jit"}, "'inner' must be 'eager' or 'inductor', got 'jit'"),
        ({"glue": "yes"}, "'glue' must be True or False, got 'yes'"),
        ({"max_autotune": "yes"}, "'max_autotune' must be of type bool, got str"),
        ({3: True}, "option keys must be strings"),
        ("max_autotune", "options must be a dict, got str"),
    ],
)
def test_a_bad_value_raises_a_value_error_naming_the_key(options, message):
    with pytest.raises(ValueError, match=message):
        parse_options(None, options)


def test_an_unknown_mode_raises_a_value_error():
    with pytest.raises(ValueError, match="Unrecognized mode=fastest"):
        parse_options("fastest", None)


def test_options_are_split_between_kwker_and_inductor():
    opts = parse_options(None, {"inner": "eager", "glue": False, "max-autotune": True, "cpp.threads": 2})
    assert (opts.inner, opts.glue) == ("eager", False)
    assert opts.inductor_patches == {"max_autotune": True, "cpp.threads": 2}
    assert parse_options("max-autotune-no-cudagraphs").inductor_patches == {
        "max_autotune": True,
        "coordinate_descent_tuning": True,
    }


def test_the_callers_options_dict_is_not_modified():
    options = {"inner": "inductor", "max-autotune": False}
    parse_options(None, options)
    assert options == {"inner": "inductor", "max-autotune": False}


def test_a_graph_with_tensors_on_any_device_but_the_cpu_goes_to_inductor_unchanged():
    gm = torch.fx.symbolic_trace(lambda x, y: x * y)
    for devices in (("cuda", "cuda"), ("cpu", "mps"), ("xpu", "cpu"), ("meta", "meta"), ("cpu", "meta")):
        with FakeTensorMode(allow_non_fake_inputs=True):
            inputs = [torch.empty(4, 8, device=d) for d in devices]
        assert graph_devices(gm, inputs) == set(devices)
        route = route_graph(gm, inputs)
        assert route.path == "inductor-unchanged", devices
        assert next(d for d in devices if d != "cpu") in route.reason
    assert route_graph(gm, [torch.empty(4, 8), torch.empty(4, 8)]).path == "cpu-inference"


def test_a_model_on_the_meta_device_compiles_as_with_stock_inductor():
    """Meta tensors (a model sized before its weights are loaded) were tuned as
    a CPU graph, whose check against eager failed the compile (aten::equal has
    no meta kernel)."""
    model = torch.nn.Linear(16, 32).to("meta")
    x = torch.empty(4, 16, device="meta")
    for backend, grad in itertools.product(("inductor", "kwker"), (False, True)):
        torch._dynamo.reset()
        with torch.set_grad_enabled(grad):
            out = torch.compile(model, backend=backend)(x)
        assert (out.device.type, out.shape, out.requires_grad) == ("meta", (4, 32), grad), backend


class _AddsOneMore(torch.Tensor):
    """A subclass whose add gives one more than Tensor's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out.as_subclass(torch.Tensor) + 1 if func in (torch.add, torch.Tensor.add) else out


class _DoublesLinear(torch.nn.Parameter):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 2 if func is torch.nn.functional.linear else out


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_token_id_past_the_vocabulary_raises_eagers_index_error_at_every_call_and_the_process_lives(grad):
    """The tuning ran stock Inductor's candidate on the inputs eager had failed
    on: in a training graph its bounds check throws inside an OpenMP parallel
    region, and the process aborted (found by a helper). Run in a child, which
    such an abort kills."""
    code = f"""
import torch
from kwker.testing import small_model
model = small_model("qwen2")  # a vocabulary of 64
compiled = torch.compile(model, backend="kwker")
ids = torch.randint(1, 500, (2, 16), generator=torch.Generator().manual_seed(0))
with torch.set_grad_enabled({grad}):
    try:
        model(input_ids=ids, labels=ids)
    except IndexError as e:
        eager = str(e)
    for _ in range(2):
        try:
            compiled(input_ids=ids, labels=ids).loss.sum().item()
        except IndexError as e:
            print("raised as eager" if str(e) == eager else e)
    good = ids % 64  # then tuned (inference) or still run eagerly (training), eager's loss either way
    torch.testing.assert_close(compiled(input_ids=good, labels=good).loss, model(input_ids=good, labels=good).loss)
print("alive")
"""
    out = run_python(code)
    assert out.returncode == 0 and out.stdout.split() == ["raised", "as", "eager"] * 2 + ["alive"], out
    assert "runs eagerly, untuned" in out.stderr, out.stderr


class _CountsAndEmbeds(torch.nn.Module):
    def __init__(self, counts: bool):
        super().__init__()
        self.embedding, self.linear = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32)
        self.register_buffer("calls", torch.zeros(4))
        self.counts = counts

    def forward(self, ids):
        if self.counts:
            self.calls.add_(1)  # written before the op that raises
        return self.linear(self.embedding(ids)).relu().sum(1)


@pytest.mark.parametrize("counts", [True, False], ids=["writes", "writes-nothing"])
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_an_inference_graph_whose_first_call_raised_is_tuned_at_the_first_later_call_that_does_not(mode, counts):
    """A token id past the vocabulary at the first call: the graph ran eagerly,
    untuned, for every later call of those shapes until torch._dynamo.reset().
    Now each later call that raises raises eager's error and writes nothing
    (as the first, whose write the tuning put back); the first that does not
    is tuned, its input written once, and the candidate kept serves it."""
    from kwker import summary

    torch.manual_seed(0)
    model = _CountsAndEmbeds(counts)
    eager = copy.deepcopy(model)
    bad, good = torch.full((2, 8), 70), torch.randint(0, 64, (2, 8))
    goods = (good, good.flip(1))  # made outside inference mode: an inference tensor is compiled for afresh
    with pytest.raises(IndexError) as expected:
        copy.deepcopy(model)(bad)
    summary.clear()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kwker")
    with mode():
        for _ in range(2):
            with pytest.raises(IndexError) as raised:
                compiled(bad)
            assert str(raised.value) == str(expected.value)
            assert model.calls.eq(0).all(), model.calls
        (graph,) = summary.graphs()
        assert graph.kind == "eager" and "which is tuned" in graph.why, kwker.report()
        for ids in goods:
            out = compiled(ids)
            torch.testing.assert_close(out, eager(ids))
            torch.testing.assert_close(model.calls, eager.calls)
            assert not out.requires_grad  # the tuning at the call kept its grad mode (it serves its outputs)
    assert [g.kind for g in summary.graphs()] == ["eager", "tuned"], kwker.report()
    assert "tuned at the first later call" in summary.graphs()[1].why, kwker.report()
    torch._dynamo.reset()


def test_a_later_tuning_runs_on_inputs_that_alias_as_the_calls_do_and_writes_inference_tensors_in_copies():
    """After a first call that raised: each later call ran eagerly on a clone of
    the input it writes, which the input that aliases it no longer saw (eager's
    call passes, the pre-run raised); the tuning traced the graph's write of an
    inference tensor outside inference mode, which raised at every call."""
    from kwker import summary

    emb = torch.nn.Embedding(10, 4)

    def f(a, b):
        a.add_(5)  # b, a view of the same memory, reads ids in range only after this
        return emb(b).sum(1)

    summary.clear()
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="kwker")
    with torch.inference_mode():
        with pytest.raises(IndexError):
            compiled(torch.zeros(4, dtype=torch.long), torch.full((4,), 20))
        for _ in range(2):
            base, expected = torch.full((8,), -5), torch.full((8,), -5)  # inference tensors
            torch.testing.assert_close(compiled(base[4:], base[4:]), f(expected[4:], expected[4:]))
            assert torch.equal(base, expected), (base, expected)
    assert [g.kind for g in summary.graphs()] == ["eager", "tuned"], kwker.report()
    torch._dynamo.reset()


def test_inputs_on_copied_storages_keep_their_aliasing_and_leave_the_originals_and_storageless_inputs_alone():
    from torch.testing._internal.two_tensor import TwoTensor

    from kwker.dynamo_backend import _on_copied_storages

    base, other = torch.arange(8.0), torch.arange(3.0)
    sparse, wrapped = torch.eye(3).to_sparse(), TwoTensor(torch.zeros(2), torch.zeros(2))
    a, b, c, d, e, f = _on_copied_storages([base[:4], base[2:6:2], other, sparse, wrapped, 5], [base[:4]])
    a.add_(1)
    assert torch.equal(base, torch.arange(8.0)) and torch.equal(b, torch.tensor([3.0, 4.0]))  # b sees a's write
    assert c is other and d is sparse and e is wrapped and f == 5


_READS = {  # the ways a graph reads a table's rows by the ids it is given
    "embedding": "emb(ids.view(8, 512))",
    "keywords": "torch.nn.functional.embedding(input=ids, weight=emb.weight)",
    "torch.embedding": "torch.embedding(emb.weight, ids)",
    "indexing": "emb.weight[ids]",
}


@pytest.mark.parametrize("read", list(_READS))
@pytest.mark.parametrize("how", ["inner-inductor", "dynamic", "tuned", "training"])
def test_an_id_out_of_range_at_a_later_call_raises_eagers_index_error_where_inductor_compiled_the_graph(how, read):
    """Inductor's bounds check of an index throws inside an OpenMP parallel
    region where the lookup is parallel (8 x 512 ids here), and the process
    aborted (stock Inductor's too); Inductor's graphs now check the indices that
    are inputs first (kwker.bounds). Inductor is kept in the tuned graphs here
    (its ATen graph with inner="inductor", Dynamo's with dynamic shapes or
    tuned). Run in a child, which such an abort kills."""
    code = f"""
import torch, kwker.tune
kwker.tune._fastest = lambda ms, reference: "inductor"
emb, lin = torch.nn.Embedding(1000, 256), torch.nn.Linear(256, 256)
def f(ids, type_ids):
    return lin({_READS[read]} + emb(type_ids)).relu().sum()
options = {{"inner": "inductor"}} if "{how}" == "inner-inductor" else None
compiled = torch.compile(f, backend="kwker", options=options, dynamic="{how}" == "dynamic")
ids, type_ids = torch.randint(0, 1000, (8, 512)), torch.zeros(8, 512, dtype=torch.long)
with torch.set_grad_enabled("{how}" == "training"):
    compiled(ids, type_ids)
    for bad, bad_type in ((1000, 0), (-1001, 0), (0, 1000), (0, -1)):
        i, t = ids.clone(), type_ids.clone()
        i[5, 300], t[7, 511] = bad, bad_type
        try:
            f(i, t)
            eager = "no error"
        except IndexError as e:
            eager = str(e)
        try:
            compiled(i, t)
            print("no error" == eager)
        except IndexError as e:
            print(str(e) == eager)
    torch.testing.assert_close(compiled(ids, type_ids), f(ids, type_ids))
from kwker import summary
print(*(g.choice or g.kind for g in summary.graphs()))
"""
    out = run_python(code)
    assert out.returncode == 0 and out.stdout.split()[:4] == ["True"] * 4, out
    assert set(out.stdout.split()[4:]) == {"inductor"}, out.stdout


def test_compile_config_takes_a_mode_as_its_inductor_settings():
    """torch.compile takes mode= or options=, not both, and kwker's config
    always has options (its guard filter): compile_config(mode="max-autotune")
    raised torch's error at generate()'s first compile."""
    config = kwker.compile_config(mode="max-autotune-no-cudagraphs", options={"coordinate_descent_tuning": False})
    assert config.mode is None and config.options["max_autotune"] is True, config.options
    assert config.options["coordinate_descent_tuning"] is False and "guard_filter_fn" in config.options
    with pytest.raises(ValueError, match="mode=bogus"):
        kwker.compile_config(mode="bogus")
    config = kwker.compile_config(mode="reduce-overhead")
    lin, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
    torch._dynamo.reset()
    compiled = torch.compile(lin, backend=config.backend, mode=config.mode, options=config.options)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), lin(x))
    torch._dynamo.reset()


def test_a_failure_to_find_the_index_inputs_leaves_inductors_graph_unchecked_and_logged(monkeypatch, caplog):
    import kwker.dynamo_backend

    def fails(gm, example_inputs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(kwker.dynamo_backend, "index_inputs", fails)
    emb, ids = torch.nn.Embedding(10, 4), torch.randint(0, 10, (2, 6))
    torch._dynamo.reset()
    compiled = torch.compile(emb, backend="kwker", options={"inner": "inductor"})
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), emb(ids))
    assert "finding the graph's index inputs failed" in caplog.text
    torch._dynamo.reset()


def test_index_inputs_are_those_read_whole_and_unchanged_and_not_written():
    """An input's values read as indices through views are checked (a table's
    rows, the narrowest of two; indexing wraps negative ones); not a part of
    one (`x[:, 0]` and `x[:, 1]` index two tables: the whole input held to the
    first's rows ran every valid call eagerly), nor through a view that
    reinterprets their bits, nor where the graph writes them, through any view
    (the check would read them before the write)."""
    from kwker.bounds import index_inputs

    emb, small, table = torch.nn.Embedding(10, 4), torch.nn.Embedding(6, 4), torch.randn(7, 4)

    def checks(fn, *inputs):
        """(which of inputs, lowest, highest) for each check of the graph's."""
        seen = []

        def backend(gm, example_inputs):
            seen.append([(next(n for n, x in enumerate(inputs) if x is example_inputs[i]), low, high)
                         for i, low, high in index_inputs(gm, example_inputs).bounds])
            return gm

        torch._dynamo.reset()
        torch.compile(fn, backend=backend)(*inputs)
        return seen[-1]

    ids = torch.zeros(2, 6, dtype=torch.long)
    assert checks(lambda i, j: emb(i.view(-1)) + small(i.reshape(12)) + table[j], ids, ids.flatten()) == \
        [(0, 0, 5), (1, -7, 6)]
    assert checks(lambda i: emb(i[:, 0]) + small(i[:, 1]), ids) == []
    assert checks(lambda i: emb(i.view(torch.int64)), ids.int()) == []
    assert checks(lambda i: emb(i.view(dtype=torch.int64)), ids.int()) == []
    assert checks(lambda i: emb(i.clamp_(0, 9)), ids) == []
    assert checks(lambda i: (i.t().clamp_(0, 9), emb(i))[1], ids) == []
    assert checks(lambda i: (i.narrow(0, 0, 1).add_(1), emb(i))[1], ids) == []
    assert checks(lambda i: (torch.add(i, 1, out=i), emb(i))[1], ids) == []
    assert checks(lambda i: emb(i.float().long()), ids) == []  # computed ids: not checked


def test_a_call_whose_index_input_shares_memory_with_an_integer_input_the_graph_writes_runs_eagerly():
    from kwker.bounds import IndexChecks

    checks, base = IndexChecks(bounds=((1, 0, 9),), written=(0,)), torch.zeros(8, dtype=torch.long)
    assert checks.refuse([base[:4], base[4:]])  # b may read a's write: checked before it, the check is void
    assert not checks.refuse([torch.zeros(4, dtype=torch.long), base[4:]])
    assert checks.refuse([torch.zeros(4, dtype=torch.long), torch.full((4,), 10)])
    assert not IndexChecks(bounds=(), written=(0,))


def test_a_tensor_subclass_overriding_torch_function_gives_eagers_values():
    """Dynamo traces what __torch_function__ does into the graph; the tuning ran
    that graph again on the subclass inputs as its truth and as the eager
    candidate, which applied it twice (outputs 8 off, kept, Inductor's right
    ones left out as differing)."""
    def fn(x):
        return torch.add(x, 1).mul(2).sum(-1)

    x = torch.arange(8.0).reshape(2, 4).as_subclass(_AddsOneMore)
    linear = torch.nn.Linear(8, 3)
    linear.weight = _DoublesLinear(linear.weight.detach())
    x8 = torch.randn(4, 8)
    with torch.no_grad():
        expected = fn(x), linear(x8)
        for _ in range(2):
            torch._dynamo.reset()
            got = torch.compile(fn, backend="kwker")(x), torch.compile(linear, backend="kwker")(x8)
            for g, e in zip(got, expected):
                torch.testing.assert_close(g.as_subclass(torch.Tensor), e.as_subclass(torch.Tensor))


def test_a_wrapper_subclass_weight_goes_to_inductor_and_kwkers_native_code_refuses_it():
    """A __torch_dispatch__ wrapper subclass (TwoTensor, a quantized weight) has
    no memory of its own: kwker's native code read through its NULL data
    pointer and the process died (SIGSEGV) where eager and Inductor run. Run in
    a fresh interpreter, which such a crash would end."""
    code = """
import torch, kwker._C
from torch.testing._internal.two_tensor import TwoTensor
w = torch.randn(32, 64).bfloat16().float()
two = TwoTensor(w, 2 * w)
try:
    kwker._C.bf16_exact(two)
    raise SystemExit("bf16_exact read a tensor without memory")
except kwker._C.PlanError as e:
    assert "no memory of its own" in str(e), e
linear = torch.nn.Linear(64, 32)
linear.weight = torch.nn.Parameter(two)
x = torch.randn(4, 64)
with torch.no_grad():
    expected = linear(x)
    got = torch.compile(linear, backend="kwker")(x)
torch.testing.assert_close(got.a, expected.a)
torch.testing.assert_close(got.b, expected.b)
print(kwker.summary.graphs()[-1].kind)
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["inductor-unchanged"], result.stdout


def test_forward_mode_ad_through_a_compiled_graph_carries_eagers_tangent():
    """A dual tensor's graph runs eagerly: the tuning compared primals only and
    kept kwker's plan, which dropped the tangent (stock Inductor raises here:
    mm_out has no forward AD)."""
    import torch.autograd.forward_ad as fwAD

    w = torch.randn(8, 8)

    def fn(x):
        return torch.tanh(x @ w) * 2

    x, tangent = torch.randn(4, 8), torch.randn(4, 8)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="kwker")
    with fwAD.dual_level():
        expected = fwAD.unpack_dual(fn(fwAD.make_dual(x, tangent)))
        for _ in range(2):
            got = fwAD.unpack_dual(compiled(fwAD.make_dual(x, tangent)))
            assert got.tangent is not None
            torch.testing.assert_close(got.primal, expected.primal)
            torch.testing.assert_close(got.tangent, expected.tangent)


def test_torch_logs_shows_what_kwker_chose_for_each_graph():
    code = "import torch\ntorch.compile(lambda x: x * 3, backend='kwker')(torch.randn(4))\n"
    result = run_python(code, TORCH_LOGS="kwker")
    assert result.returncode == 0, result.stderr
    assert "graph 0" in result.stderr and "inductor" in result.stderr


def test_a_kwker_setting_in_the_environment_that_is_not_understood_is_warned_about():
    code = "import torch\ntorch.compile(lambda x: x * 3, backend='kwker')(torch.randn(4))\n"
    result = run_python(code, KWKER_ISA="avx-2", KWKER_PREFETCH="-1")
    assert result.returncode == 0, result.stderr
    assert "UserWarning: kwker: KWKER_ISA=avx-2 is not one of scalar, avx2" in result.stderr, result.stderr
    assert "KWKER_PREFETCH=-1 is not a count of bytes" in result.stderr
    result = run_python("import kwker._C, sys; sys.stdout.write(kwker._C.cpu_isa())", KWKER_ISA="AVX2")
    assert result.returncode == 0 and result.stdout in ("scalar", "avx2"), result
    assert "Warning" not in result.stderr, result.stderr


def test_kwker_logs_nothing_by_default():
    code = "import torch\ntorch.compile(lambda x: x * 3, backend='kwker')(torch.randn(4))\n"
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "kwker" not in result.stderr


def test_a_graph_kwker_hands_to_inductor_gets_no_aten_trace_and_no_weight_copies(monkeypatch):
    """Routing reads Dynamo's own graph: a graph that goes to stock Inductor (a
    float16 decode step) is never traced to ATen, rewritten or given weight
    copies by kwker."""
    import kwker.dynamo_backend
    import kwker.plan
    import kwker.weights
    from kwker import summary
    from kwker.testing import small_model

    work = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            work.append(name)
            return fn(*args, **kwargs)
        return wrapped

    for module in (kwker.dynamo_backend, kwker.plan):
        monkeypatch.setattr(module, "trace_to_aten", spy("trace", module.trace_to_aten))
    monkeypatch.setattr(kwker.plan, "WeightArena", spy("reserve", kwker.plan.WeightArena))
    monkeypatch.setattr(kwker.weights, "make_copy", spy("copy", kwker.weights.make_copy))
    summary.clear()
    model = small_model("llama", dtype=torch.float16)
    ids = torch.tensor([[3, 17, 42, 9]])
    out = model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static",
                         compile_config=kwker.compile_config())
    assert out.tolist() == model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static").tolist()
    kinds = [g.kind for g in summary.graphs()]
    assert kinds and set(kinds) == {"inductor"}, kwker.report()
    assert work == []


def test_the_version_is_the_installed_distributions():
    from importlib.metadata import version

    assert kwker.__version__ == version("kwker") and kwker.__version__.count(".") >= 2


def test_graphs_recorded_from_threads_at_once_each_get_their_own_index(monkeypatch):
    import threading

    from kwker import summary

    monkeypatch.setattr(summary, "_graphs", [])
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # a switch between reading the count and appending, as often as can be
    try:
        workers = [threading.Thread(target=lambda: [summary.record(kind="eager", nodes=1, seconds=0.0, reason="")
                                                    for _ in range(3000)]) for _ in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(interval)
    assert sorted(g.index for g in summary.graphs()) == list(range(12000))


def test_a_training_graph_whose_first_call_raised_is_tuned_at_the_first_later_call_that_does_not():
    """A first batch with a label past the classes: the training graph ran
    eagerly, untuned, until torch._dynamo.reset(). Each later call that raises
    raises eager's error; the first that does not is tuned, and the gradients
    are eager's."""
    import torch.nn.functional as F

    from kwker import summary

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    eager = copy.deepcopy(model)
    x, bad, good = torch.randn(8, 16), torch.full((8,), 7), torch.randint(0, 4, (8,))
    with pytest.raises(IndexError) as expected:
        F.cross_entropy(eager(x), bad)
    summary.clear()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, y: F.cross_entropy(model(x), y), backend="kwker")
    for _ in range(2):
        with pytest.raises(IndexError) as raised:
            compiled(x, bad)
        assert str(raised.value) == str(expected.value)
    (graph,) = summary.graphs()
    assert graph.kind == "eager" and "which is tuned" in graph.why, kwker.report()
    for y in (good, good.flip(0)):
        compiled(x, y).backward()
        F.cross_entropy(eager(x), y).backward()
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert [g.kind for g in summary.graphs()] == ["eager", "training"], kwker.report()
    assert "tuned at the first later call" in summary.graphs()[1].why, kwker.report()
    torch._dynamo.reset()


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_model_that_raises_run_eagerly_raises_eagers_error_at_every_call(grad, capfd):
    """A float32 input to a bf16 Linear: eager and Inductor raise the op's
    RuntimeError at the call. The tuning, whose truth raised, made it Dynamo's
    BackendCompilerFailed, blaming kwker, Dynamo compiled again at every call,
    and torch.fx printed the graph's failing line to stderr each time. A
    later call of the right dtype is compiled afresh and tuned."""
    from kwker import summary

    torch.manual_seed(0)
    lin, x = torch.nn.Linear(16, 16).to(torch.bfloat16), torch.randn(2, 16)
    with pytest.raises(RuntimeError) as eager:
        lin(x)
    summary.clear()
    torch._dynamo.reset()
    compiled = torch.compile(lin, backend="kwker")
    for _ in range(2):
        with torch.set_grad_enabled(grad), pytest.raises(RuntimeError) as raised:
            compiled(x)
        assert type(raised.value) is RuntimeError and str(raised.value) == str(eager.value)
    (graph,) = summary.graphs()
    assert graph.kind == "eager" and "raised run eagerly" in graph.why, kwker.report()
    assert "FX-traced Module" not in capfd.readouterr().err
    with torch.set_grad_enabled(grad):
        torch.testing.assert_close(compiled(x.bfloat16()), lin(x.bfloat16()))
    assert summary.graphs()[-1].kind == ("training" if grad else "tuned"), kwker.report()
    torch._dynamo.reset()
