"""The small model the repo trains and ships (examples/hf_generate/model)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kwker
from kwker import summary

MODEL_DIR = Path(__file__).resolve().parents[2] / "examples" / "hf_generate" / "model"
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef "]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def load(dtype):
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=dtype).eval()


def greedy(model, ids, **kw):
    return model.generate(ids, max_new_tokens=32, do_sample=False, cache_implementation="static",
                          pad_token_id=model.config.eos_token_id, **kw)


def test_it_is_a_small_bf16_llama_with_grouped_query_attention():
    files = sum(f.stat().st_size for f in MODEL_DIR.iterdir())
    assert files <= 20 * 2**20
    model = load("auto")
    c = model.config
    assert c.model_type == "llama" and c.num_hidden_layers >= 4
    assert c.num_attention_heads % c.num_key_value_heads == 0 and c.num_key_value_heads < c.num_attention_heads
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_it_continues_python_with_python(tokenizer):
    model = load(torch.float32)
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    text = tokenizer.decode(greedy(model, ids)[0, ids.shape[1]:])
    compile(PROMPTS[0] + "    pass\n", "<prompt>", "exec")  # the prompt itself is valid Python
    assert any(word in text for word in ("return", "if ", "for ", "self", "(")), text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kwker_gives_eagers_tokens(tokenizer, dtype):
    torch._dynamo.reset()
    summary.clear()
    model = load(dtype)
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert greedy(model, ids, compile_config=kwker.compile_config()).tolist() == greedy(model, ids).tolist()
    assert [g.kind for g in summary.graphs()].count("decode-replay") >= 1, kwker.report()
