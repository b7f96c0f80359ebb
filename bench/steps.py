"""Steps of more than one token: time to first token of a chunked prefill, the
cost of a q-token step against a 1-token step, batched decode, prompt lookup.

Random-weight models shaped like the public checkpoints of bench/decode.py
(nothing downloaded; weights bf16-valued), 2 threads, greedy, a static cache
of 1024 positions. Every backend runs in this one process; the things compared
are interleaved call by call, and the machine's read bandwidth and load are
recorded around each part.

    python bench/steps.py [--quick] [--models SmolLM2-360M] [--dtypes fp32,bf16] --out FILE

* ttft_s: generate() of one new token for a 512-token prompt with
  prefill_chunk_size=128 (four compiled chunk steps), eager, stock Inductor
  and kwker; the median of interleaved calls after two warm-up calls.
* step_cost: the model's forward as generate() calls it, compiled once per
  backend, writing q positions of a static cache holding 256 (q = 1, 2, 4, 5,
  8: a verify step of prompt lookup writes up to K + 1); its median time and
  its ratio to q = 1 of the same backend.
* batch: decode tokens/s summed over the rows of a batch of 1, 4 and 8 prompts
  (32 tokens each, 32 new tokens), the decode part of generate() as
  bench/decode.py times it.
* lookup: the shipped model (examples/hf_generate/model, bf16) generating 128
  tokens greedily from code, plain and with prompt_lookup_num_tokens=4, kwker;
  tokens/s, how many candidates were accepted, and where each way's tokens
  first leave eager greedy's, with eager's top-2 margin there (in bf16 a
  margin of one ulp is a tie rounding decides, not an error).

JSON: {"ttft_s": {backend: s}, "step_cost": [{backend, q, ms, ratio_to_q1}],
"batch": [{backend, batch, tokens_per_s}], "lookup": {...}} per model and dtype
under "runs", with the machine's state. --quick: SmolLM2-360M, fp32.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config
import transformers.generation.candidate_generator as candidate_generator
from transformers import AutoModelForCausalLM, AutoTokenizer, StaticCache

from kwker.testing import BENCH_CONFIGS, bench_model
from kwker.threads import SPIN_VARIABLES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import BACKENDS, generate, read_bandwidth_gbs, timed_generate  # noqa: E402
from models import cpu_name, interleaved_ms  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COMPARED = ["eager", "inductor", "kwker"]
MAX_CACHE_LEN = 1024
PROMPT_LEN, CHUNK = 512, 128
QS = [1, 2, 4, 5, 8]
CACHED = 256  # positions already in the cache when a q-token step runs
BATCHES = [1, 4, 8]
EMBEDDED = Path(__file__).resolve().parents[1] / "examples" / "hf_generate" / "model"


def machine() -> dict:
    return dict(read_gbs=read_bandwidth_gbs(torch.get_num_threads()), load=os.getloadavg()[0])


def spread(values: list[float]) -> dict:
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return dict(median=median, q1=q1, q3=q3, min=min(values), max=max(values))


def ttft(model, repeats: int) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    calls = {b: (lambda b=b: generate(model, ids, 1, BACKENDS[b], MAX_CACHE_LEN, prefill_chunk_size=CHUNK))
             for b in COMPARED}
    firsts = {}
    for b, call in calls.items():
        start = time.perf_counter()
        call()
        firsts[b] = time.perf_counter() - start
        call()
    tokens = {b: generate(model, ids, 1, BACKENDS[b], MAX_CACHE_LEN, prefill_chunk_size=CHUNK)[0][0, -1].item()
              for b in COMPARED}
    times = interleaved_ms(calls, repeats)
    return {b: dict(spread([ms / 1e3 for ms in times[b]]), first_call_s=firsts[b], token_equal_eager=tokens[b] == tokens["eager"])
            for b in COMPARED}


def step_cost(model, repeats: int) -> list[dict]:
    """The forward generate() compiles, called directly: q new tokens at
    positions CACHED.. of a static cache whose first CACHED positions a prefill
    wrote; each backend has its own cache. transformers' StaticCache writes at
    its own counter (cumulative_length), which every call advances, and the
    mask keeps every position written so far, while rotary follows
    cache_position: a backend's calls attend over CACHED positions and then
    those its earlier calls wrote (2 + repeats calls of each q, interleaved:
    at most (2 + repeats) · sum(QS) more), the same for every backend."""
    if CACHED + (2 + repeats) * sum(QS) > MAX_CACHE_LEN:
        raise SystemExit(f"step_cost: {repeats} repeats would write past the cache's {MAX_CACHE_LEN} positions")
    rows = []
    forwards = {"eager": model.forward}
    for b in ("inductor", "kwker"):
        forwards[b] = torch.compile(model.forward, backend=BACKENDS[b]["backend"], fullgraph=True)
    caches, calls = {}, {}
    prompt = torch.randint(0, model.config.vocab_size, (1, CACHED), generator=torch.Generator().manual_seed(2))
    for b, forward in forwards.items():
        caches[b] = StaticCache(config=model.config, max_cache_len=MAX_CACHE_LEN)
        model(prompt, cache=caches[b], use_cache=True)
        for q in QS:
            ids = torch.randint(0, model.config.vocab_size, (1, q), generator=torch.Generator().manual_seed(3))
            pos = torch.arange(CACHED, CACHED + q)

            def call(forward=forward, ids=ids, pos=pos, cache=caches[b]):
                return forward(input_ids=ids, position_ids=pos[None], cache_position=pos, cache=cache, use_cache=True)

            call()
            call()  # compiled: the first sizes compile, the second of a new q may compile again
            calls[(b, q)] = call
    for (b, q), ms in interleaved_ms(calls, repeats).items():
        s = spread(ms)
        rows.append(dict(backend=b, q=q, ms=s.pop("median"), **s))
    for r in rows:
        r["ratio_to_q1"] = r["ms"] / next(x["ms"] for x in rows if x["backend"] == r["backend"] and x["q"] == 1)
    return rows


def batch(model, repeats: int) -> list[dict]:
    rows = []
    for n in BATCHES:
        ids = torch.randint(0, model.config.vocab_size, (n, 32), generator=torch.Generator().manual_seed(4))
        calls = {}
        for b in COMPARED:
            generate(model, ids, 2, BACKENDS[b], MAX_CACHE_LEN)
            calls[b] = lambda b=b, ids=ids: timed_generate(model, ids, 32, BACKENDS[b], MAX_CACHE_LEN)
        per_token = {b: [] for b in COMPARED}
        for _ in range(repeats):
            for b, call in calls.items():
                per_token[b].append(call()[0])
        for b in COMPARED:
            rows.append(dict(backend=b, batch=n, tokens_per_s=n / statistics.median(per_token[b]),
                             ms_per_step=statistics.median(per_token[b]) * 1e3))
    return rows


LOOKUP_PROMPT = '''import os


def list_python_files(root):
    """Every .py file under root, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            if name.endswith(".py"):
                found.append(os.path.join(dirpath, name))
    return sorted(found)


def list_text_files(root):
    """Every .txt file under root, sorted."""
'''


def first_difference(tokens, eager) -> dict | None:
    """Where tokens first leave eager greedy's, with eager's top-2 margin there
    in units in the last place of bf16 at the second logit (2^-7 relative): a
    margin of 1 is two neighbouring bf16 values, a tie that rounding decides.
    None where they agree."""
    at = next((i for i, (a, b) in enumerate(zip(tokens.tolist(), eager.sequences[0, -len(tokens):].tolist())) if a != b), None)
    if at is None:
        return None
    top2 = eager.logits[at][0].float().topk(2).values
    ulp = 2.0**-7 * 2.0 ** torch.floor(torch.log2(top2[1].abs())).item()
    return dict(token=at, eager_margin_ulps=((top2[0] - top2[1]) / ulp).item())


def lookup(repeats: int) -> dict:
    """Prompt lookup on the shipped model: a function the prompt all but
    contains already. Candidates accepted are counted through transformers'
    own update_candidate_strategy."""
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED)
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED, dtype=torch.bfloat16).eval()
    ids = tokenizer(LOOKUP_PROMPT, return_tensors="pt").input_ids
    new = 128
    kw = dict(pad_token_id=model.config.eos_token_id)
    accepted = []
    update = candidate_generator.PromptLookupCandidateGenerator.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        accepted.append(int(num_matches))
        return update(self, input_ids, scores, num_matches)

    candidate_generator.PromptLookupCandidateGenerator.update_candidate_strategy = record
    try:
        ways = {"greedy": {}, "lookup": dict(prompt_lookup_num_tokens=4)}
        cache = ids.shape[1] + new + 8  # a verify step may write past the last token
        outs = {w: generate(model, ids, new, BACKENDS["kwker"], cache, **kw, **extra)[0] for w, extra in ways.items()}
        eager = generate(model, ids, new, None, cache, **kw, output_logits=True, return_dict_in_generate=True)[0]
        accepted.clear()
        times = interleaved_ms({w: (lambda extra=extra: generate(model, ids, new, BACKENDS["kwker"], cache, **kw, **extra))
                             for w, extra in ways.items()}, repeats)
    finally:
        candidate_generator.PromptLookupCandidateGenerator.update_candidate_strategy = update
    verify_steps = len(accepted) / repeats
    return dict(new_tokens=new, against_eager={w: first_difference(out[0, ids.shape[1]:], eager) for w, out in outs.items()},
                greedy_tokens_per_s=new / (statistics.median(times["greedy"]) / 1e3),
                lookup_tokens_per_s=new / (statistics.median(times["lookup"]) / 1e3),
                verify_steps=verify_steps, accepted_per_verify_step=sum(accepted) / max(len(accepted), 1))


def run(models, dtypes, repeats) -> dict:
    torch._inductor.config.force_disable_caches = True
    # Every backend compiles the same forward, side by side: Dynamo's limit of 8
    # graphs per function counts them all together.
    torch._dynamo.config.recompile_limit = 64
    runs = []
    with torch.no_grad():
        for name in models:
            for dtype_name in dtypes:
                model = bench_model(name, dtype=DTYPES[dtype_name])
                r = dict(model=name, dtype=dtype_name, machine_before=machine())
                print(f"{name} {dtype_name}: time to first token", file=sys.stderr)
                r["ttft_s"] = ttft(model, repeats)
                print(json.dumps(r["ttft_s"]), file=sys.stderr)
                torch._dynamo.reset()
                print(f"{name} {dtype_name}: step cost", file=sys.stderr)
                r["step_cost"] = step_cost(model, 2 * repeats)
                print(json.dumps(r["step_cost"]), file=sys.stderr)
                torch._dynamo.reset()
                print(f"{name} {dtype_name}: batches", file=sys.stderr)
                r["batch"] = batch(model, repeats)
                print(json.dumps(r["batch"]), file=sys.stderr)
                r["machine_after"] = machine()
                runs.append(r)
                torch._dynamo.reset()
        print("prompt lookup on the shipped model", file=sys.stderr)
        looked = lookup(repeats)
    return dict(runs=runs, lookup=looked, threads=torch.get_num_threads(), repeats=repeats,
                openmp_spin={k: os.environ[k] for k in SPIN_VARIABLES if k in os.environ},
                cpu=cpu_name())


def markdown(result) -> str:
    lines = [f"{result['cpu']}, {result['threads']} threads, medians of {result['repeats']}+ interleaved calls", ""]
    for r in result["runs"]:
        m0, m1 = r["machine_before"], r["machine_after"]
        lines += [f"### {r['model']} {r['dtype']} (read {m0['read_gbs']:.1f} / {m1['read_gbs']:.1f} GB/s, "
                  f"load {m0['load']:.2f} / {m1['load']:.2f} before / after)", "",
                  f"Time to first token, {PROMPT_LEN}-token prompt, prefill_chunk_size={CHUNK}:", "",
                  "| backend | s (q1-q3) | first call s | token = eager |", "|---|---|---|---|"]
        for b, t in r["ttft_s"].items():
            lines.append(f"| {b} | {t['median']:.3f} ({t['q1']:.3f}-{t['q3']:.3f}) | {t['first_call_s']:.1f} "
                         f"| {'yes' if t['token_equal_eager'] else 'NO'} |")
        lines += ["", f"A step writing q positions after {CACHED} cached, ms (× the same backend's q = 1):", "",
                  "| backend | " + " | ".join(f"q={q}" for q in QS) + " |", "|---|" + "---|" * len(QS)]
        for b in COMPARED:
            cells = [next(x for x in r["step_cost"] if x["backend"] == b and x["q"] == q) for q in QS]
            lines.append(f"| {b} | " + " | ".join(f"{c['ms']:.1f} ({c['ratio_to_q1']:.2f}×)" for c in cells) + " |")
        lines += ["", "Decode tokens/s summed over a batch:", "",
                  "| backend | " + " | ".join(f"batch {n}" for n in BATCHES) + " |", "|---|" + "---|" * len(BATCHES)]
        for b in COMPARED:
            cells = [next(x for x in r["batch"] if x["backend"] == b and x["batch"] == n) for n in BATCHES]
            lines.append(f"| {b} | " + " | ".join(f"{c['tokens_per_s']:.1f}" for c in cells) + " |")
        lines.append("")
    lk = result["lookup"]
    lines.append(f"Prompt lookup (K = 4) on the shipped model, kwker, {lk['new_tokens']} tokens: "
                 f"greedy {lk['greedy_tokens_per_s']:.1f} tok/s, lookup {lk['lookup_tokens_per_s']:.1f} tok/s, "
                 f"{lk['verify_steps']:.0f} verify steps, {lk['accepted_per_verify_step']:.2f} accepted each; "
                 "against eager greedy: " + ", ".join(
                     f"{w} " + ("equal" if d is None else f"first differs at new token {d['token']}, where eager's "
                                f"top-2 margin is {d['eager_margin_ulps']:.1f} ulp")
                     for w, d in lk["against_eager"].items()))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="SmolLM2-360M shape, fp32")
    parser.add_argument("--out", required=True, help="where to write the JSON")
    parser.add_argument("--models", default="SmolLM2-360M", help=", ".join(BENCH_CONFIGS))
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.quick:
        args.models, args.dtypes, args.repeats = "SmolLM2-360M", "fp32", 3
    result = run(args.models.split(","), args.dtypes.split(","), args.repeats)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(markdown(result))


if __name__ == "__main__":
    main()
