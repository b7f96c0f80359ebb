"""A tuned graph's frozen candidate (kwker.freeze): Inductor's freezing, whose
constants kwker watches, never read stale."""

import gc
import subprocess
import sys

import pytest
import torch

import kwker
import kwker.freeze
import kwker.tune
from kwker import summary
from kwker import weights
from kwker.freeze import (FrozenGraph, _convolutions_in_float32, _fold_batch_norms, _model_tensor, _with_constants,
                          cannot_win)
from kwker.testing import mapped_again

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


class ConvBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Conv2d(8, 4, 1)
        with torch.no_grad():  # statistics of their own, so that folding them in matters
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))))


def double_conv_weight(model, other):
    model.conv.weight.mul_(2)


def shift_running_mean(model, other):
    model.bn.running_mean.add_(1)


def load_other_state(model, other):
    model.load_state_dict(other.state_dict())


def replace_head_weight(model, other):
    model.head.weight.data = other.head.weight.data.clone()


def freezing_backend():
    """A backend that returns FrozenGraph (falling back to Dynamo's graph, run
    eagerly), and the list of those it made."""
    made = []

    def backend(gm, example_inputs):
        made.append(FrozenGraph(gm, example_inputs, {}))
        return made[-1]

    return made, backend


@pytest.mark.parametrize("edit", [double_conv_weight, shift_running_mean, load_other_state, replace_head_weight])
def test_a_frozen_graph_follows_every_change_of_the_models_tensors(edit):
    made, backend = freezing_backend()
    model, other, x = ConvBN().eval(), ConvBN().eval(), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        compiled = torch.compile(model, backend=backend)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
        (frozen,) = made
        assert frozen.live is not None and len(frozen.frozen) == 8  # 2 + 2 conv tensors, 4 of the bn
        before = model(x)
        edit(model, other)
        after = model(x)
        assert not torch.allclose(before, after)
        # Inductor's frozen graph alone still gives the old outputs ...
        (stale,) = frozen.live[0](x)
        torch.testing.assert_close(stale, before, rtol=1e-4, atol=1e-5)
        # ... kwker's call sees the change, lets the frozen graph go and runs the fallback
        torch.testing.assert_close(compiled(x), after, rtol=1e-4, atol=1e-5)
        assert frozen.live is None
        torch.testing.assert_close(compiled(x), after, rtol=1e-4, atol=1e-5)


def test_a_frozen_graph_given_a_class_id_past_its_embedding_raises_eagers_index_error():
    """Its Inductor graph's bounds check throws inside an OpenMP parallel region
    where the lookup is parallel, which aborts the process: the ids it reads
    from an input are checked first (kwker.bounds). Run in a child."""
    code = """
import torch
from kwker.freeze import FrozenGraph
class Conditioned(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.BatchNorm2d(64)
        self.classes = torch.nn.Embedding(10, 64 * 32 * 32)
    def forward(self, x, label):
        return self.bn(self.conv(x)) + self.classes(label).view(-1, 64, 32, 32)
model, x = Conditioned().eval(), torch.randn(8, 3, 32, 32)
made = []
def backend(gm, example_inputs):
    made.append(FrozenGraph(gm, example_inputs, {}))
    return made[-1]
with torch.no_grad():
    compiled = torch.compile(model, backend=backend)
    label = torch.arange(8)
    torch.testing.assert_close(compiled(x, label), model(x, label), rtol=1e-4, atol=1e-5)
    try:
        compiled(x, label + 3)
    except IndexError as e:
        print("raised", e)
    print(made[0].live is not None)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.split()[:5] == ["raised", "index", "out", "of", "range"], out
    assert out.stdout.split()[-1] == "True", out.stdout


def test_a_sigsegv_handler_installed_after_a_frozen_graph_is_put_behind_kwkers_at_its_next_call():
    """A write into a frozen (watched) tensor faults, and kwker's handler must
    see it first: a late faulthandler.enable() in front of it would print a
    "Fatal Python error" dump for an ordinary write. A process of its own, as
    the test changes the process's SIGSEGV handlers."""
    import pathlib
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import faulthandler, sys, tempfile, torch
        sys.path.insert(0, %r)
        from test_freeze import freezing_backend
        made, backend = freezing_backend()
        # a weight of 144 KiB: whole pages of it are write-protected, so the write faults
        model = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3), torch.nn.BatchNorm2d(64)).eval()
        x = torch.randn(1, 64, 8, 8)
        dump = tempfile.TemporaryFile()
        with torch.no_grad():
            compiled = torch.compile(model, backend=backend)
            compiled(x)
            faulthandler.enable(file=dump)  # in front of kwker's handler now
            compiled(x)
            assert made[0].live is not None
            model[0].weight.mul_(2)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        dump.seek(0)
        print(repr(dump.read().decode()))
    """) % str(pathlib.Path(__file__).parent)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "''", out.stdout


class Foldable(torch.nn.Module):
    """Batch norms after convolutions with and without a bias, one without
    affine parameters, one after a 1-d convolution, one after a convolution given
    its weight by keyword, and an in-place op on a folded output; and three
    that must stay: one whose convolution's output is used twice, one after a
    pooling, one after an unbatched convolution (its channels are dim 0)."""

    def __init__(self):
        super().__init__()
        self.conv_a, self.bn_a = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.conv_b, self.bn_b = torch.nn.Conv2d(8, 8, 1, bias=False), torch.nn.BatchNorm2d(8, affine=False)
        self.conv_c, self.bn_c = torch.nn.Conv2d(8, 8, 1), torch.nn.BatchNorm2d(8)
        self.bn_d = torch.nn.BatchNorm2d(8)
        self.conv_e, self.bn_e = torch.nn.Conv1d(8, 4, 3), torch.nn.BatchNorm1d(4)
        self.w_f, self.bn_f = torch.nn.Parameter(torch.randn(4, 3, 1, 1)), torch.nn.BatchNorm2d(4)
        self.w_u, self.bn_u = torch.nn.Parameter(torch.randn(4, 3, 1)), torch.nn.BatchNorm1d(4)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                    m.running_mean.uniform_(-1, 1)
                    m.running_var.uniform_(0.5, 2)
                    if m.affine:
                        m.weight.uniform_(0.5, 2)
                        m.bias.uniform_(-1, 1)

    def forward(self, x, v):
        f = self.bn_f(torch.nn.functional.conv2d(x, weight=self.w_f))
        x = self.bn_b(self.conv_b(torch.relu(self.bn_a(self.conv_a(x)))))
        c = self.conv_c(x)
        x = self.bn_c(c) + c
        x = self.bn_d(torch.nn.functional.max_pool2d(x, 2))
        e = self.bn_e(self.conv_e(x.flatten(2)))
        e.relu_()
        return e, f, self.bn_u(torch.nn.functional.conv1d(v, self.w_u))


def with_model_constants(gm, example_inputs):
    """Dynamo's graph with the model's tensors as constants, as FrozenGraph
    makes it, and what picks the arguments it still takes from a call's."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    frozen = {n: x for n, x in zip(placeholders, example_inputs) if _model_tensor(n, x)}
    return _with_constants(gm, frozen), lambda args: [a for n, a in zip(placeholders, args) if n not in frozen]


def test_batch_norms_after_convolutions_are_folded_into_them_before_inductor_freezes():
    batch_norms = []

    def fold_and_compare(gm, example_inputs):
        graph, kept = with_model_constants(gm, example_inputs)
        _fold_batch_norms(graph)
        batch_norms.extend(n for n in graph.graph.nodes if n.target is torch.nn.functional.batch_norm)
        torch.testing.assert_close(graph(*kept(example_inputs)), gm(*example_inputs), rtol=1e-5, atol=1e-5)
        return gm

    with torch.no_grad():  # v: 3 channels of length 4, whose convolution gives 4 channels of length 4
        torch.compile(Foldable().eval(), backend=fold_and_compare)(torch.randn(2, 3, 8, 8), torch.randn(3, 4))
    assert [n.args[0].target for n in batch_norms] == [torch.conv2d, torch.nn.functional.max_pool2d, torch.conv1d]


def test_bf16_convolutions_run_in_float32_where_onednn_has_no_bf16_convolution(monkeypatch):
    """Where weights.convolution_storage copies a bf16 convolution's weight to
    float32 (below AVX-512; forced here, so that every host runs the test), the
    frozen graph's convolutions read float32 constants, with the batch norm
    folded into them in float32, and their input widened, and round their
    output to bf16 once: bf16 outputs within bf16 rounding of eager's, and
    within a bf16 step of float32 arithmetic rounded where the rewrite rounds.
    Where it does not, the convolutions are left as they are."""
    assert (weights.convolution_storage(torch.zeros(1, dtype=torch.bfloat16)) is None) == \
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    torch.manual_seed(0)
    model = ConvBN().eval().bfloat16()
    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)

    def rounded_at_each_convolution(m, x):  # the batch norm folded into the first one
        h = m.bn(m.conv(x.float())).bfloat16().float()
        return m.head(torch.relu(h)).bfloat16()

    for forced in (weights.Storage(torch.float32, 0), None):
        monkeypatch.setattr(weights, "convolution_storage", lambda w, forced=forced: forced)
        graphs = []

        def rewrite(gm, example_inputs):
            graph, kept = with_model_constants(gm, example_inputs)
            _convolutions_in_float32(graph)
            _fold_batch_norms(graph)
            graphs.append(graph)
            return lambda *args: graph(*kept(args))

        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(model, backend=rewrite)(x)
            want, exact = model(x), rounded_at_each_convolution(model.float(), x)
            model.bfloat16()
        (graph,) = graphs
        constants = [getattr(graph, n.target) for n in graph.graph.nodes if n.op == "get_attr"]
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        if forced is None:
            assert {c.dtype for c in constants} == {torch.bfloat16}
            continue
        # two weights and two biases, the batch norm folded into the first pair in float32
        assert len(constants) == 4 and {c.dtype for c in constants} == {torch.float32}
        assert not [n for n in graph.graph.nodes if n.target is torch.nn.functional.batch_norm]
        # one rounding to bf16 at each convolution's end, none in between (a first rounding
        # that falls the other way moves the head's sum by a few of its input's steps)
        torch.testing.assert_close(got, exact, rtol=2 ** -7, atol=2 ** -7)


def test_a_convolution_called_twice_has_one_float32_copy_of_its_weight(monkeypatch):
    """One module called twice (a shared weight and bias): its two convolutions
    read one float32 copy of each, and both are eager's within bf16 rounding."""
    monkeypatch.setattr(weights, "convolution_storage", lambda w: weights.Storage(torch.float32, 0))
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 4, 3, padding=1).bfloat16()
    x = torch.randn(1, 4, 8, 8, dtype=torch.bfloat16)
    graphs = []

    def rewrite(gm, example_inputs):
        graph, kept = with_model_constants(gm, example_inputs)
        _convolutions_in_float32(graph)
        graphs.append(graph)
        return lambda *args: graph(*kept(args))

    def twice(x):
        return conv(torch.relu(conv(x)))

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(twice, backend=rewrite)(x)
        want = twice(x)
    (graph,) = graphs
    constants = {n.target for n in graph.graph.nodes if n.op == "get_attr"}
    assert {getattr(graph, c).dtype for c in constants} == {torch.float32} and len(constants) == 2, constants
    assert len([n for n in graph.graph.nodes if n.target is torch.conv2d]) == 2
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_a_second_model_of_the_same_class_is_not_read_through_the_first_ones_constants():
    made, backend = freezing_backend()
    first, second, x = ConvBN().eval(), ConvBN().eval(), torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        forward = torch.compile(ConvBN.forward, backend=backend)
        torch.testing.assert_close(forward(first, x), first(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(forward(second, x), second(x), rtol=1e-4, atol=1e-5)
    assert len(made) == 1 and made[0].live is None  # Dynamo reused the graph; kwker did not reuse the values


def test_a_conv_bn_graph_is_tuned_with_a_frozen_candidate_that_stays_correct(monkeypatch):
    real = kwker.tune._median_ms

    def frozen_fastest(built, run, times, reference, first):
        ms = real(built, run, times, reference, first)
        return {name: (0.0 if name == "frozen" else t) for name, t in ms.items()}

    monkeypatch.setattr(kwker.tune, "_median_ms", frozen_fastest)
    # The gate reads one call of each candidate: a slow one of Inductor's (19 ms
    # against 0.3 once in CI) would leave the frozen candidate out.
    monkeypatch.setattr(kwker.freeze, "MAX_GAIN_OVER_INDUCTOR", float("inf"))
    model, other, x = ConvBN().eval(), ConvBN().eval(), torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        compiled = torch.compile(model, backend="kwker")
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
        (graph,) = summary.graphs()
        assert graph.choice == "frozen" and {"inductor", "eager", "frozen"} <= set(graph.candidates), kwker.report()
        model.load_state_dict(other.state_dict())
        torch.testing.assert_close(compiled(x), other(x), rtol=1e-4, atol=1e-5)


def test_a_model_in_memory_shared_with_other_processes_gets_no_frozen_candidate(monkeypatch):
    """No watch sees another process's write (share_memory(), Hogwild), so no
    constants are made of such a model's tensors."""
    monkeypatch.setattr(kwker.freeze, "MAX_GAIN_OVER_INDUCTOR", float("inf"))
    model, x = ConvBN().eval(), torch.randn(1, 3, 16, 16)
    model.share_memory()
    with torch.no_grad():
        compiled = torch.compile(model, backend="kwker")
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
        (graph,) = summary.graphs()
        assert "shared with other processes" in graph.left_out.get("frozen", ""), kwker.report()
        mapped_again(model.conv.weight).mul_(2)  # as another process writes
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_model_whose_frozen_constants_would_not_fit_in_the_memory_left_gets_no_frozen_candidate(monkeypatch):
    monkeypatch.setattr(weights, "memory_for_copies", lambda: 1024)  # ConvBN's tensors: 1.3 KB
    made, backend = freezing_backend()
    with torch.no_grad(), pytest.raises(Exception, match="would not fit in the memory left"):
        torch.compile(ConvBN().eval(), backend=backend)(torch.randn(2, 3, 16, 16))
    assert made == []


def test_freezing_is_not_tried_where_it_measured_no_gain_or_under_grad():
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()).eval()
    with torch.no_grad():
        torch.compile(mlp, backend="kwker")(torch.randn(2, 16))
    (graph,) = summary.graphs()
    assert "frozen" not in set(graph.candidates) | set(graph.left_out), kwker.report()
    with pytest.raises(ValueError, match="grad is enabled"):
        FrozenGraph(torch.fx.symbolic_trace(mlp), [torch.randn(2, 16)], {})


def test_a_frozen_candidate_is_not_compiled_where_inductors_call_shows_it_cannot_win():
    assert cannot_win({"inductor": 10.0, "eager": 3.0, "plan": 2.6}) is None  # 3.8x: freezing might still win
    why = cannot_win({"inductor": 412.0, "eager": 17.0})  # EfficientNet-B0's, where Inductor's pooling is slow
    assert why and "Inductor's call takes 412 ms against eager's 17" in why
    assert cannot_win({"eager": 17.0}) is None  # no Inductor time: nothing to go by


def test_a_frozen_candidate_not_kept_leaves_the_models_tensors_unwatched(monkeypatch):
    from test_tune import writable

    monkeypatch.setattr(kwker.tune, "MARGIN", 0.0)  # the reference, Inductor, is kept whatever the times
    monkeypatch.setattr(kwker.freeze, "MAX_GAIN_OVER_INDUCTOR", float("inf"))  # and the frozen one always built
    model = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3), torch.nn.BatchNorm2d(64)).eval()  # 147 KiB of weight
    with torch.no_grad():
        torch.compile(model, backend="kwker")(torch.randn(1, 64, 8, 8))
    (graph,) = summary.graphs()
    assert graph.choice == "inductor" and "frozen" in graph.candidates, kwker.report()
    gc.collect()
    assert writable(model[0].weight)
