"""Tuned inference graphs: the candidates kwker times and the one it keeps."""

import gc
import time

import pytest
import torch

import kwker
import kwker.tune
from kwker import summary
from kwker.tune import MARGIN, choose

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def taking(seconds, result):
    def run(*inputs):
        time.sleep(seconds)
        return (result.clone(),)

    return lambda: run


def test_the_fastest_candidate_is_kept_and_the_reference_within_the_margin():
    x = torch.ones(3)
    choice = choose({"ref": taking(0.02, x), "fast": taking(0.0, x), "slow": taking(0.04, x)}, [], "ref")
    assert choice.name == "fast" and set(choice.ms) == {"ref", "fast", "slow"}
    assert choice.ms["fast"] < choice.ms["ref"] < choice.ms["slow"]
    # 2 % faster than the reference is within the margin: the reference stays
    almost = choose({"ref": taking(0.02, x), "close": taking(0.02 * (MARGIN + 0.01), x)}, [], "ref")
    assert almost.name == "ref", almost.ms


def test_a_candidate_that_fails_or_gives_other_outputs_is_left_out_with_the_reason():
    x = torch.ones(3)

    def broken():
        raise RuntimeError("cannot build")

    choice = choose({"ref": taking(0.01, x), "wrong": taking(0.0, x + 1e-2), "broken": broken,
                     "shape": taking(0.0, torch.ones(4))}, [], "ref")
    assert choice.name == "ref"
    assert "differs from the reference's by 0.01 (relative L2)" in choice.left_out["wrong"]
    assert choice.left_out["broken"] == "RuntimeError: cannot build"
    assert "not a tensor like the reference's" in choice.left_out["shape"]
    with pytest.raises(RuntimeError, match="cannot build"):
        choose({"ref": broken, "other": taking(0.0, x)}, [], "ref")


def test_an_inference_graph_is_tuned_and_gives_eagers_outputs():
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32)).eval()
    x = torch.randn(4, 64)
    with torch.no_grad():
        compiled = torch.compile(mlp, backend="kwker")
        for _ in range(3):
            torch.testing.assert_close(compiled(x), mlp(x), rtol=1e-4, atol=1e-5)
    (graph,) = summary.graphs()
    assert graph.kind == "tuned" and graph.choice in graph.candidates, kwker.report()
    assert set(graph.candidates) | set(graph.left_out) == {"inductor", "eager", "plan"}, kwker.report()
    assert f"tuned: {graph.choice}" in kwker.report()


def writable(t: torch.Tensor) -> bool:
    """Whether the page in the middle of t's memory is writable (kwker's
    watches protect the pages of the weights it copied from)."""
    addr = t.data_ptr() + t.nbytes // 2
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line.split()[1].startswith("rw")
    raise AssertionError("not mapped")


def test_a_plan_not_kept_leaves_the_models_weights_unwatched(monkeypatch):
    monkeypatch.setattr(kwker.tune, "MARGIN", 0.0)  # the reference, Inductor, is kept whatever the times
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.SiLU(), torch.nn.Linear(512, 256)).eval()
    with torch.no_grad():
        for p in mlp.parameters():  # bf16-valued: the plan reads bf16 copies and watches these
            p.copy_(p.bfloat16().float())
        torch.compile(mlp, backend="kwker")(torch.randn(1, 256))
    (graph,) = summary.graphs()
    assert graph.choice == "inductor" and graph.copies == 0 and "plan" in graph.candidates, kwker.report()
    gc.collect()
    assert all(writable(p) for p in mlp.parameters() if p.dim() == 2)


def test_a_graph_that_writes_its_input_runs_once_per_call_as_in_eager():
    def bump(x):
        x.add_(1.0)
        return x * 2.0

    x, ref = torch.zeros(8), torch.zeros(8)
    with torch.no_grad():
        out = torch.compile(bump, backend="kwker")(x)
    assert torch.equal(out, bump(ref)) and torch.equal(x, ref)  # the input written once, as eager does
    (graph,) = summary.graphs()
    assert graph.kind == "inductor" and "writes the input" in graph.why, kwker.report()


def test_a_batch_norm_in_training_mode_updates_its_statistics_once_per_call():
    """native_batch_norm writes its running statistics without its schema saying
    so; F.batch_norm called directly has no num_batches_tracked += 1 to give it away."""

    def normalize(x, mean, var):
        return torch.nn.functional.batch_norm(x, mean, var, training=True, momentum=0.5)

    x = torch.randn(4, 3, 5, 5) * 3 + 1
    mean, var = torch.zeros(3), torch.ones(3)
    ref_mean, ref_var = mean.clone(), var.clone()
    with torch.no_grad():
        out = torch.compile(normalize, backend="kwker")(x, mean, var)
        torch.testing.assert_close(out, normalize(x, ref_mean, ref_var))
    torch.testing.assert_close((mean, var), (ref_mean, ref_var))  # not moved once per candidate tried
    (graph,) = summary.graphs()
    assert graph.kind == "inductor" and "writes the input" in graph.why, kwker.report()


def test_outputs_agree_by_relative_distance_with_nan_and_infinities_in_the_same_places():
    from kwker.tune import _differs

    inf, nan = float("inf"), float("nan")
    ref = [torch.tensor([1.0, inf, nan, 1e-3])]
    assert _differs([torch.tensor([1.00001, inf, nan, 1.05e-3])], ref) is None  # a tiny element 5 % off
    for other in ([1.0, -inf, nan, 1e-3], [1.0, inf, 2.0, 1e-3], [inf, inf, nan, 1e-3], [1.1, inf, nan, 1e-3]):
        assert _differs([torch.tensor(other)], ref) is not None, other
