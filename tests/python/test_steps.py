"""Steps of more than one token, replayed: the chunks of a chunked prefill, the
verify steps of prompt lookup, a batch of left-padded prompts. Token equality
against eager, as in test_decode_tokens.py (peaked_model rules out argmax
decided by rounding), and each such step a plan, not Inductor."""

import pytest
import torch
import transformers.generation.candidate_generator as candidate_generator

import kwker
from kwker import summary, weights
from kwker.testing import small_model
from test_decode_tokens import DTYPES, generate, peaked_model

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

ARCHS = ["llama", "qwen3", "gemma3", "mixtral"]


def steps_that_left_the_plan():
    return [g for g in summary.graphs() if g.kind != "decode-replay"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_gives_eagers_tokens(arch, dtype):
    """A 300-token prompt in chunks of 64 and of 128: chunks of the full size,
    then a shorter last one, each writing its positions of the static cache."""
    ids = torch.randint(1, 64, (1, 300), generator=torch.Generator().manual_seed(5))
    for chunk in (64, 128):
        model, (ref,) = peaked_model(arch, DTYPES[dtype], [ids], prefill_chunk_size=chunk)
        out = generate(model, ids, kwker.compile_config(), prefill_chunk_size=chunk)
        assert out.sequences.tolist() == ref.sequences.tolist(), chunk
    reasons = [g.reason for g in summary.graphs()]
    assert any("positions" in r and "one position" not in r for r in reasons), kwker.report()
    assert not steps_that_left_the_plan(), kwker.report()
    # Every op native (Gemma 3's q/k norms over a chunk's transposed heads too), but Mixtral's sort of
    # a chunk's experts, whose keys repeat
    assert {op for g in summary.graphs() for op in g.fallback_ops} <= {"aten.sort.default"}, kwker.report()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_lookup_gives_eagers_tokens_and_accepts_candidates(arch, dtype, monkeypatch):
    """Verify steps of up to 4 + 1 positions, the static cache cropped after
    each. The random model's greedy output falls into a cycle, which the
    lookup then finds in the text so far: some candidates must be accepted,
    or the test would not reach a step of more than one position's worth."""
    matches = []
    update = candidate_generator.PromptLookupCandidateGenerator.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        matches.append(int(num_matches))
        return update(self, input_ids, scores, num_matches)

    monkeypatch.setattr(candidate_generator.PromptLookupCandidateGenerator, "update_candidate_strategy", record)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12] * 4])
    lookup = dict(prompt_lookup_num_tokens=4, max_cache_len=ids.shape[1] + 48)  # a verify step may run past the end
    model, (ref,) = peaked_model(arch, DTYPES[dtype], [ids], **lookup)
    matches.clear()
    out = generate(model, ids, kwker.compile_config(), **lookup)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert sum(matches) > 0, matches
    assert not steps_that_left_the_plan(), kwker.report()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_four_with_left_padding_and_a_chunked_prefill_gives_eagers_tokens(arch, dtype):
    pad = 0
    ids = torch.randint(1, 64, (4, 40), generator=torch.Generator().manual_seed(6))
    for row, n_pad in enumerate((0, 3, 17, 39)):
        ids[row, :n_pad] = pad
    mask = (ids != pad).long()
    kw = dict(attention_mask=mask, prefill_chunk_size=16)
    # 4 rows x 32 tokens in bfloat16 tie often: llama's first seed without a tie is 16
    model, (ref,) = peaked_model(arch, DTYPES[dtype], [ids], max_seeds=24, **kw)
    out = generate(model, ids, kwker.compile_config(), **kw)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert not steps_that_left_the_plan(), kwker.report()


def test_the_plans_of_one_step_share_its_weight_copies_and_keep_them_fresh():
    """Plans for a step's several sizes read one copy of each weight
    (kwker.weights._shared); a weight written in place is seen by
    every plan that reads it. The second generate() with a longer cache makes
    Dynamo compile the verify step again with the cache's length dynamic too;
    from then on, another length is another plan of that step."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12] * 4])
    model = small_model("llama")
    config = kwker.compile_config()

    def same_tokens(max_cache_len):
        kw = dict(prompt_lookup_num_tokens=4, max_cache_len=max_cache_len)
        return generate(model, ids, config, **kw).sequences.tolist() == generate(model, ids, **kw).sequences.tolist()

    assert same_tokens(80) and same_tokens(96)  # each longer: generate() keeps a cache at least as long
    step = [g.plan() for g in summary.graphs() if g.plan is not None and hasattr(g.plan(), "plans")][-1]
    kept = dict(weights._shared)
    assert kept and len({id(c.copy) for c in kept.values()}) == len(kept)
    assert same_tokens(112)
    assert len(step.plans) > 1, kwker.report()
    assert all(weights._shared[k] is c for k, c in kept.items())  # the new sizes' plan read the same copies
    with torch.no_grad():
        model.model.layers[1].mlp.gate_proj.weight.mul_(-2.0)
    assert same_tokens(112)
    assert all(weights._shared[k] is c for k, c in kept.items())  # packed again in place


def test_every_plan_of_a_step_with_several_sizes_reads_the_cache_with_kwkers_attention():
    """Steps of 1, 2, 4 and 8 positions called directly, as generate() calls
    them: the plans for the later sizes (traced with the call's own arguments)
    keep no SDPA, repeat_kv copy or mask conversion beside kwker's attention."""
    from transformers import StaticCache

    model = small_model("llama")
    forward = torch.compile(model.forward, backend="kwker", fullgraph=True)
    cache, ref_cache = (StaticCache(config=model.config, max_cache_len=96) for _ in range(2))
    prompt = torch.randint(1, 64, (1, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
        model(prompt, cache=ref_cache, use_cache=True)
        for q in (1, 2, 4, 8):
            ids = torch.randint(1, 64, (1, q), generator=torch.Generator().manual_seed(q))
            kw = dict(input_ids=ids, position_ids=torch.arange(40, 40 + q)[None], cache_position=torch.arange(40, 40 + q),
                      use_cache=True)
            torch.testing.assert_close(forward(cache=cache, **kw).logits, model(cache=ref_cache, **kw).logits)
    plans = []
    for g in summary.graphs():
        step = g.plan()
        plans += list(step.plans.values()) if hasattr(step, "plans") else [step]
    assert len(plans) == 4, kwker.report()
    for plan in plans:
        steps = plan.dump()
        assert steps.count(" attention ") == model.config.num_hidden_layers and "flash_attention" not in steps, steps
