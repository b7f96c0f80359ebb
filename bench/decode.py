"""Hugging Face generate() decode speed: eager, stock Inductor, kwker (with and
without its guard filter), kwker inner="eager".

Random-weight models shaped like SmolLM2-360M, Qwen2.5-0.5B, Llama-3.2-1B,
Gemma-3-270M and a small Mixtral (nothing downloaded), batch 1, a 32-token prompt, a static cache of 1024
positions, greedy decoding. Every backend runs in this one process, side by
side, and the machine's read bandwidth is measured in the same run.

    python bench/decode.py [--quick] --out FILE

Per row: decode tokens/s of the whole generate() loop, first-compile seconds,
the ratio to stock Inductor, the decode step (the model call generate() makes
per token, Dynamo's guards included), for kwker the plan's own replay of that
step and the overhead (step less replay: Dynamo's guards and wrapper, kwker's
checks of its inputs and watched weights), what generate() adds around it per
token, the step against the roofline (bytes a step must read ÷ read bandwidth),
the step and its roofline fraction again with Dynamo's guard check skipped,
whether the tokens equal eager's (and how many leading ones do), and how far
the first decode step's logits are from float32 eager's (relative L2, same
weights: the bench models' weights are bf16-valued). First compiles are a
user's: each in a fresh Python process, with Inductor's on-disk caches off.

OpenMP's spin setting (GOMP_SPINCOUNT and friends, see kwker/threads.py) is read
when torch starts, so it is the environment's: the JSON and the table record it.
Run once as is and once with GOMP_SPINCOUNT=10000 to see both.
"""

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config

import kwker
from kwker import _C, summary
from kwker.weights import is_bf16_valued
from kwker.testing import BENCH_CONFIGS, bench_model
from kwker.threads import SPIN_VARIABLES

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ops as ops_bench  # noqa: E402  (bench/ops.py builds the C benchmark)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# kwker as kwker.compile_config() sets it up (Dynamo's guards on the parameters its
# plan checks again dropped), and with every guard kept (kwker-all-guards).
BACKENDS = {
    "eager": None,
    "inductor": dict(backend="inductor", mode=None),
    "kwker": dict(backend="kwker", mode=None, options={"guard_filter_fn": kwker.guard_filter}),
    "kwker-all-guards": dict(backend="kwker", mode=None),
    "kwker-eager": dict(backend="kwker", mode=None,
                        options={"inner": "eager", "guard_filter_fn": kwker.guard_filter}),
}


def generate(model, ids, new_tokens, compile_kwargs, max_cache_len, **extra):
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  cache_implementation="static", max_cache_len=max_cache_len, **extra)
    if compile_kwargs is not None:
        from transformers import CompileConfig

        config = CompileConfig(fullgraph=True, **compile_kwargs)
        config._compile_all_devices = True
        kwargs["compile_config"] = config
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    return out, time.perf_counter() - start


class StepTimer:
    """Times every call generate() makes to the model after the prefill: the
    decode step as the caller sees it (for a compiled backend, Dynamo's compiled
    callable, its guards included), and when the first one started, so that the
    decode part of the same generate() is known. When kwker replayed the step,
    also the plan's own replay (kwker._C.Plan.last_call) of each of them."""

    def __init__(self, model, compiled: bool):
        self.model, self.compiled, self.times, self.replays, self.first_start = model, compiled, [], [], None

    def _timed(self, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.times.append(time.perf_counter() - start)
            self.first_start = self.first_start or start
            plan = next((g for g in reversed(summary.graphs()) if g.kind == "decode-replay"), None)
            if plan is not None and plan.last_call is not None:
                self.replays.append(plan.last_call["replay_us"] / 1e6)
            return out
        return call

    def __enter__(self):
        if self.compiled:
            compiled_call = self.model.get_compiled_call
            self.model.get_compiled_call = lambda config: self._timed(compiled_call(config))
        else:  # generate() decodes through self.__call__ (the prefill calls self(...))
            self.model.__call__ = self._timed(type(self.model).__call__.__get__(self.model))
        return self

    def __exit__(self, *exc):
        del self.model.__dict__["get_compiled_call" if self.compiled else "__call__"]


def timed_generate(model, ids, new_tokens, compile_kwargs, max_cache_len):
    """One full generate(): the decode time per token (from the first decode
    call to the end: the step and generate()'s own Python around it), the
    steps' median, what generate() adds per token (its decode time less the
    steps', both summed), and the median replay of a kwker plan (None for
    other backends)."""
    with StepTimer(model, compiled=compile_kwargs is not None) as timer:
        generate(model, ids, new_tokens, compile_kwargs, max_cache_len)
        span = time.perf_counter() - timer.first_start
    n = len(timer.times)
    assert n == new_tokens - 1, (n, new_tokens)
    replay = statistics.median(timer.replays) if len(timer.replays) == n else None
    return span / n, statistics.median(timer.times), (span - sum(timer.times)) / n, replay


STEADY = 0.15  # bandwidth readings before and after a generate this close: no change of state seen


def steady_generates(model, ids, compile_kwargs, new_tokens, repeats, max_cache_len, step_bytes, reads):
    """Full generates (timed_generate) until `repeats` of them ran in one
    bandwidth state (at most twice `repeats`). The read bandwidth of this VM
    moves (about 35 or 60 GB/s, with where the host puts its vCPUs, sometimes
    within one generate), so it is read after every generate (`reads` holds the
    reading before the first); a generate whose two readings differ by more
    than STEADY saw a change of state and gives no roofline. A generate's
    roofline fraction is its median step time against the mean of its two
    readings."""
    threads = torch.get_num_threads()
    per_token, steps, around, replays, roofline = [], [], [], [], []
    while len(roofline) < repeats and len(steps) < 2 * repeats:
        token_s, step_s, around_s, replay_s = timed_generate(model, ids, new_tokens, compile_kwargs, max_cache_len)
        per_token.append(token_s)
        steps.append(step_s)
        around.append(around_s)
        if replay_s is not None:
            replays.append(replay_s)
        before, after = reads[-1], read_bandwidth_gbs(threads)
        reads.append(after)
        if abs(before - after) <= STEADY * min(before, after):
            roofline.append(step_bytes / ((before + after) / 2 * 1e9) / step_s)
    return dict(token_s=statistics.median(per_token), step_s=statistics.median(steps),
                around_s=statistics.median(around), generates=len(steps), steady_generates=len(roofline),
                roofline_frac=statistics.median(roofline) if roofline else None,
                replay_s=statistics.median(replays) if replays else None)


def measure_backend(model, ids, backend, new_tokens, repeats, max_cache_len, step_bytes):
    """The first call, a two-token generate (one decode step: it compiles).
    Then steady_generates: decode time per token, the decode step's time and
    its roofline fraction, medians over the generates; for a compiled backend
    again under torch.compiler.set_stance(skip_guard_eval_unsafe=True) (README,
    "The guards kwker drops"), which shows what Dynamo's guard check costs a
    step. The compile in this process (the first call less a warm two-token
    generate) goes to the JSON; the table's first compile comes from a fresh
    process (first_compile). The logits of the first decode step come untimed."""
    torch._dynamo.reset()
    compile_kwargs = BACKENDS[backend]
    _, first = generate(model, ids, 2, compile_kwargs, max_cache_len)
    tokens, _ = generate(model, ids, new_tokens, compile_kwargs, max_cache_len)
    reads = [read_bandwidth_gbs(torch.get_num_threads())]
    result = steady_generates(model, ids, compile_kwargs, new_tokens, repeats, max_cache_len, step_bytes, reads)
    result["skip_guards"] = None
    if compile_kwargs is not None:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            result["skip_guards"] = steady_generates(model, ids, compile_kwargs, new_tokens, repeats, max_cache_len,
                                                     step_bytes, reads)
    two = [generate(model, ids, 2, compile_kwargs, max_cache_len, output_logits=True, return_dict_in_generate=True)
           for _ in range(repeats)]
    return dict(result, tokens=tokens, read_gbs=statistics.median(reads),
                compile_in_process_s=max(first - statistics.median(t for _, t in two), 0.0),
                step_input=two[0][0].sequences[0, :-1], step_logits=two[0][0].logits[1][0].float())


def matching_tokens(tokens, ref, prompt_len) -> int:
    """How many new tokens agree with the reference before the first difference."""
    differ = (tokens[0, prompt_len:] != ref[0, prompt_len:]).nonzero()
    return int(differ[0, 0]) if len(differ) else tokens.shape[1] - prompt_len


def logits_error(r, ref) -> float | None:
    """Relative L2 distance of the first decode step's logits from the float32
    eager ones, when both steps saw the same tokens; None otherwise."""
    if ref is None or not torch.equal(r["step_input"], ref["step_input"]):
        return None
    return float((r["step_logits"] - ref["step_logits"]).norm() / ref["step_logits"].norm())


def bytes_per_step(model, backend, avg_len):
    """What a decode step must read: every linear weight (kwker reads the bf16
    copy of a bf16-valued float32 weight), the experts a token is routed to,
    and the valid part of the KV cache."""
    kwker_packs = backend.startswith("kwker")

    def read_bytes(w):
        return w.numel() * (2 if kwker_packs and (w.dtype == torch.bfloat16 or is_bf16_valued(w)) else w.element_size())

    weights = sum(read_bytes(p) for name, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in name)
    # A mixture of experts' [experts, ...] weights (kwker's bf16 copy where bf16-valued, like a linear's):
    # one token reads its top-k experts' share.
    c = model.config
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        weights += sum(read_bytes(p) for p in model.parameters() if p.dim() == 3) * c.num_experts_per_tok // experts
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        weights += read_bytes(model.get_output_embeddings().weight)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * avg_len * model.dtype.itemsize
    return weights + kv


@functools.cache
def _ops_bench_exe() -> str:
    return str(ops_bench.build())


def read_bandwidth_gbs(threads: int) -> float:
    """The read bandwidth kwker's pool reaches over 2 GiB, measured now (bench/ops_bench.c,
    built on the first call only: each build ran CMake right before a timed generate)."""
    out = subprocess.run([_ops_bench_exe(), "--threads", str(threads), "--read-only"], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)["read_gbs"]


def prompt(model, prompt_len):
    return torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))


def first_compile(name, dtype_name, backend, prompt_len, max_cache_len) -> float:
    """A user's first compile: a new Python process builds the model and runs a
    two-token generate twice; the first less the second. In the bench's own
    process every backend after the first finds Dynamo (and kwker its own
    modules) already warm, which took 2-6 s off a SmolLM2-360M compile."""
    out = subprocess.run([sys.executable, __file__, "--first-compile", name, dtype_name, backend,
                          "--prompt-len", str(prompt_len), "--max-cache-len", str(max_cache_len)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.splitlines()[-1])["first_compile_s"]


def first_compile_here(name, dtype_name, backend, prompt_len, max_cache_len) -> dict:
    model = bench_model(name, dtype=DTYPES[dtype_name])
    ids = prompt(model, prompt_len)
    _, first = generate(model, ids, 2, BACKENDS[backend], max_cache_len)
    _, warm = generate(model, ids, 2, BACKENDS[backend], max_cache_len)
    return dict(first_compile_s=max(first - warm, 0.0))


def run(models, dtypes, new_tokens, repeats, prompt_len=32, max_cache_len=1024):
    """Every backend of one model and dtype side by side."""
    rows = []
    for name in models:
        fp32_eager = None  # the reference for every dtype's logits
        for dtype_name in dtypes:
            model = bench_model(name, dtype=DTYPES[dtype_name])
            ids = prompt(model, prompt_len)
            results = {
                b: measure_backend(model, ids, b, new_tokens, repeats, max_cache_len,
                                   bytes_per_step(model, b, prompt_len + new_tokens / 2))
                for b in BACKENDS
            }
            if dtype_name == "fp32":
                fp32_eager = results["eager"]
            ref = results["eager"]["tokens"]
            for backend, r in results.items():
                skipped = r["skip_guards"] or dict(step_s=None, roofline_frac=None)
                rows.append(dict(
                    model=name, dtype=dtype_name, backend=backend,
                    tokens_per_s=1.0 / r["token_s"],
                    first_compile_s=first_compile(name, dtype_name, backend, prompt_len, max_cache_len),
                    compile_in_process_s=r["compile_in_process_s"],
                    ratio_vs_inductor=results["inductor"]["token_s"] / r["token_s"],
                    step_ms=r["step_s"] * 1e3,
                    replay_ms=r["replay_s"] and r["replay_s"] * 1e3,
                    overhead_ms=r["replay_s"] and (r["step_s"] - r["replay_s"]) * 1e3,
                    generate_overhead_ms=r["around_s"] * 1e3,
                    roofline_frac=r["roofline_frac"],
                    generates=r["generates"],
                    steady_generates=r["steady_generates"],
                    step_ms_skip_guards=skipped["step_s"] and skipped["step_s"] * 1e3,
                    roofline_frac_skip_guards=skipped["roofline_frac"],
                    tokens_equal=bool(torch.equal(r["tokens"], ref)),
                    matching_tokens=matching_tokens(r["tokens"], ref, prompt_len),
                    logits_error_vs_fp32=logits_error(r, fp32_eager),
                    read_gbs=r["read_gbs"],
                ))
                print(_row_line(rows[-1]), file=sys.stderr, flush=True)
            del model
    return dict(threads=torch.get_num_threads(), new_tokens=new_tokens, repeats=repeats,
                prompt_len=prompt_len, max_cache_len=max_cache_len, torch=torch.__version__,
                openmp_spin={name: os.environ[name] for name in SPIN_VARIABLES if name in os.environ},
                machine=platform.processor() or platform.machine(), isa=_C.cpu_isa(), rows=rows)


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _row_line(r):
    return (f"| {r['model']} | {r['dtype']} | {r['backend']} | {r['tokens_per_s']:.2f} | {r['first_compile_s']:.1f} "
            f"| {r['ratio_vs_inductor']:.2f} | {r['step_ms']:.1f} | {_fmt(r['replay_ms'], '.1f')} "
            f"| {_fmt(r['overhead_ms'], '.2f')} | {r['generate_overhead_ms']:.1f} "
            f"| {_fmt(r['roofline_frac'], '.2f')} ({r['steady_generates']}/{r['generates']}) "
            f"| {_fmt(r['step_ms_skip_guards'], '.1f')} | {_fmt(r['roofline_frac_skip_guards'], '.2f')} "
            f"| {r['read_gbs']:.1f} "
            f"| {'yes' if r['tokens_equal'] else 'NO'} ({r['matching_tokens']}) "
            f"| {_fmt(r['logits_error_vs_fp32'], '.1e')} |")


def markdown(result) -> str:
    spin = ", ".join(f"{k}={v}" for k, v in result["openmp_spin"].items()) or "OpenMP's default spinning"
    lines = [f"{result['threads']} threads, {result['new_tokens']} new tokens, median of {result['repeats']}, {spin}",
             "",
             "| model | dtype | backend | decode tok/s | first compile s | × inductor | step ms | replay ms "
             "| overhead ms | generate() ms | roofline (steady/generates) | step ms, guards skipped "
             "| roofline, guards skipped | read GB/s | tokens = eager (leading equal) | logits error vs fp32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [_row_line(r) for r in result["rows"]])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="SmolLM2-360M shape only, fp32, 32 new tokens")
    parser.add_argument("--out", help="where to write the JSON")
    parser.add_argument("--models", default=",".join(BENCH_CONFIGS))
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--first-compile", nargs=3, metavar=("MODEL", "DTYPE", "BACKEND"),
                        help="(run by the bench) one first compile in this fresh process, as JSON")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-cache-len", type=int, default=1024)
    args = parser.parse_args()
    torch._inductor.config.force_disable_caches = True
    if args.first_compile:
        print(json.dumps(first_compile_here(*args.first_compile, args.prompt_len, args.max_cache_len)))
        return
    if not args.out:
        parser.error("--out is required")
    if args.quick:
        args.models, args.dtypes, args.new_tokens, args.repeats = "SmolLM2-360M", "fp32", 32, 3
    result = run(args.models.split(","), args.dtypes.split(","), args.new_tokens, args.repeats,
                 args.prompt_len, args.max_cache_len)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(markdown(result))


if __name__ == "__main__":
    main()
