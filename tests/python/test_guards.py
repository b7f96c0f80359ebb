"""kwker.guard_filter (kwker.guards): Dynamo's tensor guards on the parameters
and buffers a plan checks again are dropped, every other guard is kept, and
what a dropped guard would have caught between two generate() calls gives
eager's tokens or a PlanError naming the parameter."""

import re

import pytest
import torch

import kwker
from kwker import _C, summary
from kwker.guards import guard_filter
from kwker.testing import small_model

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

PROMPT = torch.tensor([[3, 17, 42, 9, 7, 12, 5, 30]])


def greedy(model, compile_config=None):
    return model.generate(PROMPT, max_new_tokens=8, do_sample=False, cache_implementation="static",
                          compile_config=compile_config).tolist()


def recording_filter():
    """kwker.guard_filter, and the list it appends each frame's guards to, with
    what it kept. A function, not an object: CompileConfig deep-copies its
    options, which copies an object but not a function."""
    frames = []

    def record(entries):
        keep = guard_filter(entries)
        frames.append(list(zip(entries, keep)))
        return keep

    return record, frames


def module_tensor_names(model) -> set[str]:
    return {name for name, _ in model.named_parameters(remove_duplicate=False)} | \
        {name for name, _ in model.named_buffers(remove_duplicate=False)}


def dotted(guard_name: str) -> str:
    """args[0]._modules['model']._parameters['w'] -> model.w"""
    return ".".join(re.findall(r"\['([^']*)'\]", guard_name))


def test_the_filter_drops_the_tensor_guards_of_every_module_tensor_of_a_replayed_step_and_nothing_else():
    model = small_model("llama")
    record, frames = recording_filter()
    assert greedy(model, kwker.compile_config(options={"guard_filter_fn": record})) == greedy(model)
    assert [g.kind for g in summary.graphs()] == ["decode-replay"], kwker.report()
    (frame,) = frames
    dropped = [e for e, keep in frame if not keep]
    assert {e.guard_type for e in dropped} == {"TENSOR_MATCH"}
    tensor_guards = [e for e, _ in frame if e.guard_type == "TENSOR_MATCH"]
    in_model = {dotted(e.name) for e in tensor_guards if e.name.startswith("args[0]")}
    assert in_model and in_model <= module_tensor_names(model)
    # every parameter and buffer the step reads, but the first block's and those outside the blocks
    first_block = {"model.norm.weight", "model.rotary_emb.inv_freq", "model.embed_tokens.weight", "lm_head.weight"} | \
        {n for n in in_model if n.startswith("model.layers.0.")}
    assert {dotted(e.name) for e in dropped} == in_model - first_block
    assert {n for n in in_model if n.startswith("model.layers.1.")} <= in_model - first_block
    kept_tensors = {e.name for e, keep in frame if keep and e.guard_type == "TENSOR_MATCH"}
    assert {"kwargs['input_ids']", "kwargs['cache'].layers[0].keys"} <= kept_tensors  # the call's own arguments
    assert len(frame) - len(dropped) > 500  # module structure, globals, the cache's attributes: all kept


def test_a_step_kwker_does_not_replay_keeps_every_guard():
    model = small_model("llama")
    record, frames = recording_filter()
    assert greedy(model, kwker.compile_config(options={"guard_filter_fn": record, "inner": "inductor"})) == \
        greedy(model)
    assert "decode-replay" not in [g.kind for g in summary.graphs()], kwker.report()
    assert all(keep for frame in frames for _, keep in frame)


@pytest.fixture
def plan_kept(monkeypatch):
    """The tuner keeps kwker's plan, whichever candidate this machine times fastest."""
    from kwker import dynamo_backend, tune

    def plan_only(builders, inputs, reference, **how):
        return tune.choose({"plan": builders["plan"]}, inputs, reference="plan", **(how | {"truth": None}))

    monkeypatch.setattr(dynamo_backend, "choose", plan_only)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64)).eval()


@pytest.mark.usefixtures("plan_kept")
def test_a_plan_compiled_with_grad_enabled_keeps_every_guard():
    model = mlp().requires_grad_(False)  # grad enabled, no input requires it: an inference graph
    record, frames = recording_filter()
    compiled = torch.compile(model, backend="kwker", options={"guard_filter_fn": record})
    x = torch.randn(1, 64)
    torch.testing.assert_close(compiled(x), model(x))
    assert [g.choice for g in summary.graphs()] == ["plan"], kwker.report()
    assert frames and all(keep for frame in frames for _, keep in frame)


@pytest.mark.usefixtures("plan_kept")
def test_a_tuned_graph_that_kept_kwkers_plan_drops_its_parameters_guards_and_reads_them_as_they_are():
    model = mlp()
    record, frames = recording_filter()
    compiled = torch.compile(model, backend="kwker", options={"guard_filter_fn": record})
    x = torch.randn(1, 64)
    with torch.no_grad():
        compiled(x)
        assert [g.choice for g in summary.graphs()] == ["plan"], kwker.report()
        dropped = {dotted(e.name) for frame in frames for e, keep in frame if not keep}
        assert dropped == {"2.weight", "2.bias"}  # the first item's guards kept
        model[2].weight.mul_(-1.0)
        model[2].bias.data = torch.randn(64)
        torch.testing.assert_close(compiled(x), model(x))
        model[2].weight.data = torch.randn(64, 128)  # eager raises too (0.weight gives 256 features)
        with pytest.raises(_C.PlanError, match=r"'2\.weight'.*expected shape \(64, 256\), got \(64, 128\)"):
            compiled(x)


# ---- what a dropped guard would have caught, between two generate() calls ----------------------


def _widen_mlp(model):
    mlp = model.model.layers[1].mlp
    mlp.gate_proj.weight.data = torch.randn(96, 64).bfloat16().float()
    mlp.up_proj.weight.data = torch.randn(96, 64).bfloat16().float()
    mlp.down_proj.weight.data = torch.randn(64, 96).bfloat16().float()


def _replace_parameter(model):
    model.model.layers[1].self_attn.o_proj.weight = torch.nn.Parameter(torch.randn(64, 64).bfloat16().float())


def _relayout_parameter(model):
    weight = model.model.layers[1].self_attn.o_proj.weight
    weight.data = weight.data.t().contiguous().t()


def _reassign_buffer(model):
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq * 0.5


def _edit_buffer_in_place(model):
    model.model.rotary_emb.inv_freq.mul_(0.5)


def _model_to_bfloat16(model):
    model.to(torch.bfloat16)


def _zero_attention_scaling(model):
    """A float attribute changed: Dynamo compiles again with it as a symbolic
    float, which kwker's ATen trace cannot branch on (NotLowerable, never a
    failed compile); Dynamo then specialises it."""
    model.model.layers[0].self_attn.scaling = 0.0


@pytest.mark.parametrize("change", [_replace_parameter, _relayout_parameter, _reassign_buffer,
                                    _edit_buffer_in_place, _model_to_bfloat16, _zero_attention_scaling])
def test_a_change_a_dropped_guard_would_have_caught_gives_eagers_tokens(change):
    model = small_model("llama")
    config = kwker.compile_config()
    assert greedy(model, config) == greedy(model)
    change(model)
    want = greedy(model)
    assert greedy(model, config) == want
    assert set(g.kind for g in summary.graphs()) == {"decode-replay"}, kwker.report()


def _edit_experts_in_place(model):
    weight = model.model.layers[0].mlp.experts.gate_up_proj
    weight.data.copy_(torch.randn_like(weight).bfloat16().float() * 4)


def _replace_experts(model):
    experts = model.model.layers[1].mlp.experts
    experts.down_proj = torch.nn.Parameter(torch.randn_like(experts.down_proj).bfloat16().float() * 4)


@pytest.mark.parametrize("change", [_edit_experts_in_place, _replace_experts])
def test_a_change_to_a_mixture_of_experts_weights_gives_eagers_tokens(change):
    """The experts' weights are read as bf16 copies (grouped_linear), kept fresh as a linear's are."""
    model = small_model("mixtral")
    config = kwker.compile_config()
    before = greedy(model)
    assert greedy(model, config) == before
    assert summary.graphs()[0].copies > 0 and summary.graphs()[0].rewrites["grouped_linear"] == 4, kwker.report()
    change(model)
    want = greedy(model)
    assert want != before  # a stale copy would show
    assert greedy(model, config) == want
    assert set(g.kind for g in summary.graphs()) == {"decode-replay"}, kwker.report()


@pytest.mark.parametrize("path", ["model.layers.1.input_layernorm",  # bound as it is
                                  "model.layers.1.self_attn.o_proj"])  # read through a copy, its source watched
def test_a_parameter_of_another_python_type_raises_a_plan_error_naming_it(path):
    class TaggedParameter(torch.nn.Parameter):  # its own __torch_function__ could change what every op does
        pass

    model = small_model("llama")
    config = kwker.compile_config()
    assert greedy(model, config) == greedy(model)
    module = model.get_submodule(path)
    module.weight = TaggedParameter(module.weight.detach().clone())
    with pytest.raises(_C.PlanError, match=rf"'{re.escape(path)}\.weight'.*expected type .*Parameter.*TaggedParameter"):
        greedy(model, config)


def _norm_to_bfloat16(model):
    norm = model.model.layers[1].input_layernorm
    norm.weight.data = norm.weight.data.bfloat16()  # the norm casts back to float32


def _q_bias_to_none(model):
    model.model.layers[1].self_attn.q_proj.bias = None


@pytest.mark.parametrize("arch, change, error", [
    # bound as it is
    ("llama", _norm_to_bfloat16, r"'model\.layers\.1\.input_layernorm\.weight'.*expected dtype torch\.float32, "
                                 r"got torch\.bfloat16"),
    # read through copies, whose sources the plan watches: q, k and v's biases stacked; gate and up stacked
    ("qwen2", _q_bias_to_none, r"'model\.layers\.1\.self_attn\.q_proj\.bias'.*expected type .*Parameter.*, got "
                               r".*NoneType"),
    ("llama", _widen_mlp, r"'model\.layers\.1\.mlp\.(gate|up|down)_proj\.weight'.*expected shape "
                          r"\((160, 64|64, 160)\), got \((96, 64|64, 96)\)"),
])
def test_a_change_the_plan_cannot_follow_raises_a_plan_error_naming_the_parameter(arch, change, error):
    """Where a dropped guard would have made Dynamo compile the frame again.
    A copy's source set to None once raised AttributeError from the copy's
    refresh on every call; one given another shape had the plan compiled again
    from Dynamo's graph, traced for the old shape, which the frame's Python may
    have read (BLOOM's slices by pretraining_tp): wrong values, no error."""
    model = small_model(arch)
    config = kwker.compile_config()
    assert greedy(model, config) == greedy(model)
    assert summary.graphs()[0].copies > 0, kwker.report()
    change(model)
    greedy(model)  # eager runs it
    with pytest.raises(_C.PlanError, match=error + ".*guard_filter_fn"):
        greedy(model, config)
    torch._dynamo.reset()  # what the error says: compile again
    assert greedy(model, config) == greedy(model)


@pytest.mark.parametrize("arch, fields, other_fields", [
    ("llama", {}, {"intermediate_size": 96}),
    ("llama", {}, {"vocab_size": 96}),
    # experts after a dense first layer: the experts' first of their kind is in layer 1
    ("qwen2_moe", {"mlp_only_layers": [0]}, {"mlp_only_layers": [0], "moe_intermediate_size": 48}),
])
def test_another_model_of_the_same_class_and_another_config_compiles_the_step_again(arch, fields, other_fields):
    """A config decides the shapes of each kind of tensor alike, so the first of
    each kind's guards, kept, make Dynamo compile the step again for a second
    model of the same class with another config, as without the filter. With
    them dropped too, its generate() raised PlanError."""
    model, other = small_model(arch, config=fields), small_model(arch, seed=1, config=other_fields)
    config = kwker.compile_config()
    assert greedy(model, config) == greedy(model)
    assert greedy(other, config) == greedy(other)
    assert greedy(model, config) == greedy(model)  # its own step again
    assert [g.kind for g in summary.graphs()] == ["decode-replay"] * 2, kwker.report()


def test_a_resized_vocabulary_and_a_smaller_assistant_of_the_same_class_give_eagers_tokens():
    model = small_model("llama", head_scale=4.0)
    config = kwker.compile_config()
    assert greedy(model, config) == greedy(model)
    model.resize_token_embeddings(96, mean_resizing=False)
    prompt = torch.tensor([[90, 3, 17, 80, 9]])  # ids only the resized vocabulary has
    kw = dict(max_new_tokens=8, do_sample=False, cache_implementation="static")
    assert model.generate(prompt, compile_config=config, **kw).tolist() == model.generate(prompt, **kw).tolist()
    assistant = small_model("llama", seed=1, config={"vocab_size": 96, "intermediate_size": 96}, head_scale=4.0)
    kw.update(assistant_model=assistant, cache_config={"max_cache_len": 64})
    assert model.generate(PROMPT, compile_config=config, **kw).tolist() == model.generate(PROMPT, **kw).tolist()
