"""Hugging Face generate() with a static KV cache: eager vs Inductor vs kwker on CPU.

For each backend the script loads a fresh copy of the model, resets Dynamo, and runs
greedy ``generate(..., cache_implementation="static")`` with the decode step compiled
by that backend (eager: nothing compiled). It prints one row per backend:

  first call s   wall time of the first generate(): prefill, compilation, decoding
                 (Inductor reuses its on-disk caches from earlier runs; --cold-compile
                 starts from empty ones)
  decode tok/s   from the first generated token to the last, timed by a streamer
                 (prefill, compilation and the generate() set-up are excluded; the
                 per-step overhead of generate() itself is included); median of
                 ``--runs`` warm calls after the first
  tokens equal to eager   whether every call produced exactly eager's tokens

then the text eager generated, and the text of any backend whose tokens differ.

Two ways to compile (``--compile-via``):
  config   generate(..., compile_config=CompileConfig(backend=NAME, mode=None)) with
           ``_compile_all_devices = True`` (without it generate() compiles only on
           accelerators); generate() runs the prefill eagerly and compiles the decode step.
  forward  model.forward = torch.compile(model.forward, backend=NAME); the prefill is
           compiled too (a second graph).

The kwker backend is found by name through its ``torch_dynamo_backends`` entry point;
this script never imports kwker.

  python examples/hf_generate/generate.py                      # embedded model, all backends
  python examples/hf_generate/generate.py --backends eager,inductor --max-new-tokens 32
"""

import argparse
import atexit
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

EMBEDDED_MODEL = Path(__file__).resolve().parent / "model"
BACKENDS = ("eager", "inductor", "kwker")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": "auto"}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=EMBEDDED_MODEL, help="local HF checkpoint (default: the embedded model)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights dtype (auto: as saved)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt", default="def fibonacci(n):\n")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma list from eager, inductor, kwker")
    parser.add_argument("--compile-via", choices=("config", "forward"), default="config")
    parser.add_argument("--runs", type=int, default=3, help="warm generate() calls timed after the first")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--cold-compile", action="store_true",
                        help="start from empty Inductor caches, so the first call pays the whole compilation")
    args = parser.parse_args()
    args.backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    unknown = [name for name in args.backends if name not in BACKENDS]
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
    return args


class TokenTimes(BaseStreamer):
    """Records when generate() hands over each new token (the first put() is the prompt)."""

    def __init__(self):
        self.times = []
        self.prompt_seen = False

    def put(self, value):
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self):
        pass

    def decode_tokens_per_s(self):
        if len(self.times) < 2:
            return float("nan")
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])


def load_model(path, dtype):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    return model.eval()


def compile_config_for(backend):
    config = transformers.CompileConfig(backend=backend, mode=None)  # default is "reduce-overhead"
    config._compile_all_devices = True  # otherwise generate() compiles only on cuda/xpu/...
    return config


def prepare(model, backend, compile_via):
    """Extra generate() kwargs for this backend; for compile_via=forward, compiles model.forward."""
    if backend == "eager":
        return {"disable_compile": True}
    if compile_via == "forward":
        model.forward = torch.compile(model.forward, backend=backend)
        return {"disable_compile": True}
    return {"compile_config": compile_config_for(backend)}


def pad_token_id(model):
    config = model.generation_config
    if config.pad_token_id is not None:
        return config.pad_token_id
    eos = config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


def timed_generate(model, input_ids, max_new_tokens, extra_kwargs):
    """One greedy static-cache generate(): (new tokens, wall seconds, decode tokens/s)."""
    streamer = TokenTimes()
    start = time.perf_counter()
    # No attention_mask (batch 1, nothing padded): a 2-D mask grows by one every step, a
    # changing shape that --compile-via forward would have to compile as a dynamic graph.
    output = model.generate(
        input_ids,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=pad_token_id(model),
        streamer=streamer,
        **extra_kwargs,
    )
    seconds = time.perf_counter() - start
    return output[0, input_ids.shape[1]:], seconds, streamer.decode_tokens_per_s()


def run_backend(backend, args, input_ids):
    torch._dynamo.reset()
    model = load_model(args.model, args.dtype)
    extra_kwargs = prepare(model, backend, args.compile_via)
    tokens, first_seconds, _ = timed_generate(model, input_ids, args.max_new_tokens, extra_kwargs)
    token_runs, rates = [tokens], []
    for _ in range(args.runs):
        tokens, _, rate = timed_generate(model, input_ids, args.max_new_tokens, extra_kwargs)
        token_runs.append(tokens)
        rates.append(rate)
    decode_tok_s = statistics.median(rates) if rates else float("nan")
    return {"backend": backend, "first_s": first_seconds, "decode_tok_s": decode_tok_s, "token_runs": token_runs}


def same_tokens(result, reference):
    return all(torch.equal(tokens, reference) for tokens in result["token_runs"])


def print_table(results, reference):
    print(f"\n{'backend':<10} | {'first call s':>12} | {'decode tok/s':>12} | tokens equal to eager")
    print(f"{'-' * 10}-+-{'-' * 12}-+-{'-' * 12}-+-{'-' * 21}")
    for result in results:
        equal = "-" if reference is None else ("yes" if same_tokens(result, reference) else "no")
        print(f"{result['backend']:<10} | {result['first_s']:>12.2f} | {result['decode_tok_s']:>12.1f} | {equal}")


def first_differing_tokens(result, reference):
    return next(tokens for tokens in result["token_runs"] if not torch.equal(tokens, reference))


def print_texts(results, reference_result, tokenizer, prompt):
    """The reference backend's text (eager's if it ran), then that of each backend whose tokens differ."""
    reference = reference_result["token_runs"][0]
    texts = [(reference_result["backend"], reference)]
    texts += [(r["backend"], first_differing_tokens(r, reference)) for r in results if not same_tokens(r, reference)]
    for backend, tokens in texts:
        print(f"\n--- {backend} ({len(tokens)} new tokens) ---")
        print(prompt + tokenizer.decode(tokens, skip_special_tokens=True))


def check_backend_exists(backend):
    if backend == "eager":
        return
    try:
        torch._dynamo.lookup_backend(backend)  # loads entry-point backends, as torch.compile would
    except torch._dynamo.exc.InvalidBackend:
        raise SystemExit(f"torch.compile has no backend {backend!r}; for kwker, install the project "
                         f"(pip install -e .) or drop it with --backends eager,inductor")


def main():
    args = parse_args()
    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cold_compile:  # read when Inductor first needs its cache, i.e. after this
        cache_dir = tempfile.mkdtemp(prefix="hf_generate_inductor_")
        atexit.register(shutil.rmtree, cache_dir, ignore_errors=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    print(f"model {args.model} ({args.dtype}), prompt {len(input_ids[0])} tokens, "
          f"max {args.max_new_tokens} new tokens, compile via {args.compile_via}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    for backend in args.backends:
        check_backend_exists(backend)
    results = []
    for backend in args.backends:
        print(f"running {backend} ...", flush=True)
        results.append(run_backend(backend, args, input_ids))
    eager = next((r for r in results if r["backend"] == "eager"), None)
    print_table(results, eager["token_runs"][0] if eager else None)
    print_texts(results, eager or results[0], tokenizer, args.prompt)


if __name__ == "__main__":
    main()
