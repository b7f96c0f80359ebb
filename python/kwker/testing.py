"""Random-weight language models built from transformers configs, for kwker's
token-equality tests and benchmarks. Nothing is downloaded: the configs are
written out here, shaped like the checkpoints they are named after. And
memory shared with other processes, with a second mapping of it through which
tests write as another process does. And the records a logger emits meanwhile."""

import contextlib
import logging
import mmap
from multiprocessing import shared_memory

import torch

# Small configs, one per architecture the decode path must handle. Each has
# grouped-query attention where the architecture allows it.
_SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

SMALL_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    # Full attention in every layer: sliding-window layers, whose steps compile
    # again as the window fills, have a test of their own
    # (test_sliding_window_caches_give_eagers_tokens_from_one_plan_per_step).
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 16,
                                    "layer_types": ["full_attention", "full_attention"]}),
    "olmo2": ("Olmo2Config", {}),
    # Positions divided as integers (Llama 4-style attention scaling); ALiBi's
    # float x int64 slopes and baddbmm attention. Neither may fail a compile.
    "ministral3": ("Ministral3Config", {"head_dim": 16}),
    "bloom": ("BloomConfig", {}),
    # Conv1D: [K, N] weights multiplied as stored (addmm), copied as their transpose.
    "gpt2": ("GPT2Config", {}),
    # Attention and MLP in parallel on one norm's output: five linears over one input.
    "cohere": ("CohereConfig", {}),
    # Rotary on the first 8 dims of each head, its pairs interleaved (a stack of halves).
    "gptj": ("GPTJConfig", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512, "rotary_dim": 8}),
    # Mixture of experts: top-2 routing, its sort and inverse permutation written
    # in place, the experts' grouped matmuls (fallback steps of the plan).
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 64}),
}

# Shaped like the checkpoints the decode benchmark names (public configs).
BENCH_CONFIGS = {
    "SmolLM2-360M": ("LlamaConfig", dict(
        vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
        num_attention_heads=15, num_key_value_heads=5, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)),
    "Qwen2.5-0.5B": ("Qwen2Config", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)),
    "Llama-3.2-1B": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192})),
    # Five sliding-window layers (512 positions) to one of full attention.
    "Gemma-3-270M": ("Gemma3TextConfig", dict(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        query_pre_attn_scalar=256, max_position_embeddings=32768)),
    # Mixtral's layout at a size that fits the machine (no public checkpoint is this small):
    # 8 experts, 2 per token; 0.39 B parameters, 0.13 B of them read per token.
    "Mixtral-8x2-small": ("MixtralConfig", dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
        num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1000000.0)),
}


def make_config(config_class: str, **kwargs):
    import transformers

    return getattr(transformers, config_class)(**kwargs)


def random_model(config, dtype=torch.float32, seed=0, bf16_valued=True, head_scale=1.0):
    """A causal LM with random weights, in eval mode.

    bf16_valued: every weight is exactly a bfloat16 value, as when a bf16
    checkpoint is loaded in float32. head_scale multiplies the output head,
    which spreads the logits (see tests/python/test_decode_tokens.py for how the
    tests use it)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        if head_scale != 1.0:
            model.get_output_embeddings().weight.mul_(head_scale)
        for p in model.parameters():
            if bf16_valued or dtype == torch.bfloat16:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    # Random weights: no token means "end", so every run makes all its new tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(dtype)


def small_model(arch: str, dtype=torch.float32, seed=0, config: dict | None = None, **kw):
    """SMALL_CONFIGS[arch], its fields overridden by config, as random_model(**kw) makes it."""
    config_class, extra = SMALL_CONFIGS[arch]
    fields = {**_SMALL, **extra, **(config or {})}
    return random_model(make_config(config_class, **fields), dtype=dtype, seed=seed, **kw)


def bench_model(name: str, dtype=torch.float32, seed=0):
    config_class, kwargs = BENCH_CONFIGS[name]
    return random_model(make_config(config_class, **kwargs), dtype=dtype, seed=seed)


def mapped_again(t: torch.Tensor) -> torch.Tensor:
    """t's shared memory (t.share_memory_()) through a second mapping of its
    own, as another process sees it: a write there never touches this
    process's mapping of t."""
    fd, size = t.untyped_storage()._share_fd_cpu_()
    mapping = mmap.mmap(fd, size)
    again = torch.frombuffer(mapping, dtype=t.dtype, count=t.numel()).view(t.shape)
    assert again.data_ptr() != t.data_ptr()
    return again


def in_shared_memory_block(model) -> shared_memory.SharedMemory:
    """Moves model's parameters into one multiprocessing.shared_memory block,
    each read through torch.frombuffer (Tensor.is_shared() calls them False),
    and returns the block. Close and unlink it once the model is gone."""
    params = list(model.parameters())
    offsets, size = [], 0
    for p in params:
        offsets.append(size)
        size += -(-p.numel() * p.element_size() // 64) * 64
    block = shared_memory.SharedMemory(create=True, size=size)
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            t = torch.frombuffer(block.buf, dtype=p.dtype, count=p.numel(), offset=offset).view(p.shape)
            p.data = t.copy_(p)
    return block


def block_mapped_again(block: shared_memory.SharedMemory, t: torch.Tensor) -> torch.Tensor:
    """t, a tensor in block, through a mapping of the block of its own, as
    another process attaches it: a write there never touches this process's
    mapping of t. The attachment lives as long as the tensor."""
    again = shared_memory.SharedMemory(name=block.name)
    base = torch.frombuffer(block.buf, dtype=torch.uint8, count=1).data_ptr()
    view = torch.frombuffer(again.buf, dtype=t.dtype, count=t.numel(), offset=t.data_ptr() - base).view(t.shape)
    assert view.data_ptr() != t.data_ptr()
    view.attachment = again  # frombuffer does not keep the mapping: gone with it, a write would fault
    return view


@contextlib.contextmanager
def logged(name: str, level: int = logging.WARNING):
    """The records of `level` and above that logger `name` emits meanwhile (a
    handler of the caller's own: the sanitized test run has no caplog)."""
    records, handler, logger = [], logging.Handler(level), logging.getLogger(name)
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
