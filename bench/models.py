"""Graphs that are not decode steps: eager, stock Inductor and kwker side by side.

Random-weight models built from transformers configs (nothing downloaded),
shaped like the public checkpoints they are named after: BERT-base, DistilBERT
and RoBERTa-base over 128 tokens, ViT-base, ResNet-50, ConvNeXt-tiny,
MobileNetV2 and EfficientNet-B0 over 224x224 images, the Whisper-tiny encoder
over 80 mel bins x 3000 frames, the T5-small encoder over 128 tokens, GPT-2
(small) over a whole 128-token sequence, and a 4-layer MLP of width 1024. Each
runs in eval mode under torch.no_grad(), at every batch and dtype asked for:
fp32, fp32-bf16w (fp32 whose every weight is a bfloat16 value, as a bf16
checkpoint loaded in fp32) and bf16. Then training steps (forward, loss,
backward, SGD) of the MLP, of a 2-layer BERT and of ResNet-18 (its batch norms
in training mode), fp32, batch 8.

    python bench/models.py [--quick] [--models a,b] [--batches 1,8]
                           [--dtypes fp32,fp32-bf16w,bf16] [--train-models mlp,bert-small,resnet-18]
                           [--repeats N] --out FILE

Per row: the latency of eager, Inductor and kwker (the median of calls
interleaved one of each at a time, with quartiles, min and max), kwker's
speedup over Inductor, each backend's first compile in a Python process of
its own (the first call less the second, Inductor's on-disk caches off),
what kwker did with the row's graphs
(kwker.summary: each graph's kind, and its choice and candidates' times where
kwker records them), the largest error against eager, and the machine around
the row: the read bandwidth just before and just after it (bench/ops_bench.c
--read-only) and the load average. Every backend's calls are timed in this one
process.
"""

import argparse
import copy
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._inductor.config
import torch.nn.functional as F
import torch.utils._pytree as pytree
import transformers
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from kwker import _C, summary
from kwker.threads import SPIN_VARIABLES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import read_bandwidth_gbs  # noqa: E402  (ops_bench --read-only, built once by bench/ops.py)

SEQ_LEN = 128
IMAGE_SIZE = 224
MEL_FRAMES = 3000  # Whisper's encoder takes exactly 30 s of audio: 2 x max_source_positions frames
MLP_WIDTH, MLP_LAYERS = 1024, 4
TRAIN_BATCH = 8
LEARNING_RATE = 0.01
WARMUP_CALLS = 3  # per backend, after its first (compiling) call and before the timed ones
LOSS_RTOL = 1e-4  # a compiled training step's first loss "equals" eager's within this

COMPILED = ("kwker", "inductor")
BACKENDS = ("eager", "inductor", "kwker")  # the table's order

DTYPES = ("fp32", "fp32-bf16w", "bf16")


def mlp() -> torch.nn.Module:
    layers = [torch.nn.Linear(MLP_WIDTH, MLP_WIDTH)]
    for _ in range(MLP_LAYERS - 1):
        layers += [torch.nn.GELU(), torch.nn.Linear(MLP_WIDTH, MLP_WIDTH)]
    return torch.nn.Sequential(*layers)


def mlp_inputs(model, batch, gen):
    return dict(input=torch.randn(batch, MLP_WIDTH, generator=gen))


def token_inputs(model, batch, gen):
    """What a tokenizer gives for SEQ_LEN tokens, none of them padding."""
    ids = torch.randint(0, model.config.vocab_size, (batch, SEQ_LEN), generator=gen)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def image_inputs(model, batch, gen):
    return dict(pixel_values=torch.randn(batch, model.config.num_channels, IMAGE_SIZE, IMAGE_SIZE, generator=gen))


def mel_inputs(model, batch, gen):
    return dict(input_features=torch.randn(batch, model.config.num_mel_bins, MEL_FRAMES, generator=gen))


def gpt2_inputs(model, batch, gen):
    # A whole sequence, as a prefill or a scoring pass sees it; no KV cache returned.
    return dict(token_inputs(model, batch, gen), use_cache=False)


@dataclass(frozen=True)
class Model:
    """One benchmark model: how to build it (fp32, random weights: the caller
    seeds) and its inputs for a batch."""

    build: Callable[[], torch.nn.Module]
    inputs: Callable[[torch.nn.Module, int, torch.Generator], dict]


# transformers' default configs are the named checkpoints' shapes (BertConfig()
# is bert-base-uncased, ViTConfig() vit-base-patch16-224, ResNetConfig()
# resnet-50, ConvNextConfig() convnext-tiny-224, WhisperConfig() whisper-tiny,
# T5Config() t5-small, GPT2Config() gpt2, DistilBertConfig()
# distilbert-base-uncased); where they are not, the fields are written out.
MODELS = {
    "mlp": Model(mlp, mlp_inputs),
    "bert-base": Model(lambda: transformers.BertModel(transformers.BertConfig()), token_inputs),
    "distilbert": Model(lambda: transformers.DistilBertModel(transformers.DistilBertConfig()), token_inputs),
    "roberta-base": Model(lambda: transformers.RobertaModel(transformers.RobertaConfig(
        vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5)), token_inputs),
    "vit-base": Model(lambda: transformers.ViTModel(transformers.ViTConfig()), image_inputs),
    "resnet-50": Model(lambda: transformers.ResNetModel(transformers.ResNetConfig()), image_inputs),
    "convnext-tiny": Model(lambda: transformers.ConvNextModel(transformers.ConvNextConfig()), image_inputs),
    "mobilenet-v2": Model(lambda: transformers.MobileNetV2Model(transformers.MobileNetV2Config()), image_inputs),
    # transformers' default EfficientNetConfig is B7's; these are B0's (224x224, 1280 channels at the end)
    "efficientnet-b0": Model(lambda: transformers.EfficientNetModel(transformers.EfficientNetConfig(
        width_coefficient=1.0, depth_coefficient=1.0, image_size=224, hidden_dim=1280)), image_inputs),
    "whisper-tiny-encoder": Model(lambda: WhisperEncoder(transformers.WhisperConfig()), mel_inputs),
    "t5-small-encoder": Model(lambda: transformers.T5EncoderModel(transformers.T5Config()), token_inputs),
    "gpt2": Model(lambda: transformers.GPT2Model(transformers.GPT2Config()), gpt2_inputs),
}


@dataclass(frozen=True)
class TrainModel:
    """One training benchmark: the model, a batch (its inputs and target) and
    the loss of the model's output against the target."""

    build: Callable[[], torch.nn.Module]
    batch: Callable[[int, torch.Generator], tuple[dict, torch.Tensor]]
    loss: Callable[[object, torch.Tensor], torch.Tensor]


def mlp_batch(batch, gen):
    return dict(input=torch.randn(batch, MLP_WIDTH, generator=gen)), torch.randn(batch, MLP_WIDTH, generator=gen)


def small_bert():
    # Dropout off: Inductor draws its random numbers its own way, so with
    # dropout on no compiled step's loss could equal eager's.
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2))


def small_bert_batch(batch, gen):
    ids = torch.randint(0, transformers.BertConfig().vocab_size, (batch, SEQ_LEN), generator=gen)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids)), torch.randint(0, 2, (batch,), generator=gen)


def resnet18():
    return transformers.ResNetForImageClassification(transformers.ResNetConfig(
        layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512], num_labels=10))


def resnet18_batch(batch, gen):
    images = torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
    return dict(pixel_values=images), torch.randint(0, 10, (batch,), generator=gen)


TRAIN_MODELS = {
    "mlp": TrainModel(mlp, mlp_batch, F.mse_loss),
    "bert-small": TrainModel(small_bert, small_bert_batch, lambda out, labels: F.cross_entropy(out.logits, labels)),
    "resnet-18": TrainModel(resnet18, resnet18_batch, lambda out, labels: F.cross_entropy(out.logits, labels)),
}


def build(spec: Model, batch: int, dtype_name: str, seed=0):
    """The model in eval mode and its inputs, in the dtype asked for."""
    torch.manual_seed(seed)
    model = spec.build().eval()
    inputs = spec.inputs(model, batch, torch.Generator().manual_seed(seed))
    if dtype_name == "fp32-bf16w":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    elif dtype_name == "bf16":
        model = model.to(torch.bfloat16)
        inputs = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
                  for k, v in inputs.items()}
    return model, inputs


def fresh_compile_state():
    """A fresh Dynamo and kwker report for every row. Without the reset, the
    second batch size of a model would find the first's compiled code, and
    Dynamo would compile it again with the batch as a dynamic size (automatic
    dynamic shapes): another graph than the static one a process that runs one
    shape compiles, and one that kwker routes to Inductor."""
    torch._dynamo.reset()
    summary.clear()


def warm_up_compilers():
    """One untimed compile of a tiny model per backend, inference and training:
    a process's first compile also imports and initialises Dynamo, Inductor and
    kwker (15.8 s for a 2-linear MLP here, against 1.4 s for the same graph
    compiled next), which would otherwise go to whichever row came first. The
    training graph's backward is Inductor's first C++ kernel, whose compile
    takes 8-9 s more in a fresh process (an inference-only warm-up left it to
    the first row: the MLP's first compile 9.0 s against 0.9)."""
    tiny, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
    for backend in COMPILED:
        torch._dynamo.reset()
        compiled = torch.compile(tiny, backend=backend)
        with torch.no_grad():
            compiled(x)
        compiled(x).sum().backward()


def interleaved_ms(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Milliseconds of each call, `rounds` times: every round calls each backend
    once, so a change of the machine's state (another process, where the host
    puts the vCPUs) reaches all of them alike; the order rotates by one each
    round so that none always runs right after the same other one."""
    names, times = list(calls), {name: [] for name in calls}
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            calls[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def spread(backend: str, ms: list[float]) -> dict:
    q1, median, q3 = statistics.quantiles(ms, n=4, method="inclusive")
    return {f"{backend}_ms": median, f"{backend}_q1_ms": q1, f"{backend}_q3_ms": q3,
            f"{backend}_min_ms": min(ms), f"{backend}_max_ms": max(ms)}


def output_error(out, ref) -> tuple[float, float]:
    """The largest absolute difference over every tensor of the output, and the
    same over the largest absolute value of eager's (an elementwise relative
    error means nothing where eager's value is near zero)."""
    pairs = list(zip(tensors(out), tensors(ref), strict=True))
    abs_err = max(float((o.float() - r.float()).abs().max()) for o, r in pairs)
    largest = max(float(r.float().abs().max()) for _, r in pairs)
    if largest == 0.0:  # eager's outputs all zero (EfficientNet-B0's random weights: activations vanish)
        return abs_err, 0.0 if abs_err == 0.0 else math.inf
    return abs_err, abs_err / largest


def tensors(out) -> list[torch.Tensor]:
    """The output's tensors: a tensor, or those of a transformers ModelOutput (a pytree)."""
    return [x for x in pytree.tree_leaves(out) if torch.is_tensor(x)]


def kwker_graphs() -> list[dict]:
    """What kwker did with each graph it compiled since fresh_compile_state():
    the kind every record has, and, for records that carry them, the candidate
    kept, the candidates timed (name -> ms) and those left out (name -> why);
    read with getattr, as kwker's records may not have them."""
    return [dict(kind=g.kind, nodes=g.nodes, seconds=g.seconds, why=g.why, choice=getattr(g, "choice", None),
                 candidates=getattr(g, "candidates", None), left_out=getattr(g, "left_out", None))
            for g in summary.graphs()]


def compared(timed: dict[str, list[float]], first_s: dict[str, float], graphs: list[dict]) -> dict:
    """The fields every row has: each backend's spread, kwker's speedup over
    Inductor, the compiles (a backend's first call less its median call) and
    kwker's choice, the kinds of all its graphs joined by "+"."""
    row = {}
    for backend in BACKENDS:
        row.update(spread(backend, timed[backend]))
    row["speedup_vs_inductor"] = row["inductor_ms"] / row["kwker_ms"]
    row["compile_in_process_s"] = max(first_s["kwker"] - row["kwker_ms"] / 1e3, 0.0)
    row["inductor_compile_in_process_s"] = max(first_s["inductor"] - row["inductor_ms"] / 1e3, 0.0)
    row["choice"] = "+".join(g["kind"] for g in graphs)
    row["graphs"] = graphs
    return row


def measure_inference(name: str, batch: int, dtype_name: str, rounds: int) -> dict:
    """Eager's output first (the reference), then each backend's first call
    (it compiles), warm-up calls, and `rounds` interleaved calls of all three;
    then each backend's first compile in a process of its own."""
    fresh_compile_state()
    model, inputs = build(MODELS[name], batch, dtype_name)
    calls, first_s, row = {"eager": model}, {}, {}
    with torch.no_grad():
        reference = model(**inputs)
        for backend in COMPILED:
            calls[backend] = torch.compile(model, backend=backend)
            start = time.perf_counter()
            out = calls[backend](**inputs)
            first_s[backend] = time.perf_counter() - start
            row[f"{backend}_max_abs_err"], row[f"{backend}_max_rel_err"] = output_error(out, reference)
        for _ in range(WARMUP_CALLS):
            for call in calls.values():
                call(**inputs)
        timed = interleaved_ms({b: functools.partial(calls[b], **inputs) for b in BACKENDS}, rounds)
    return dict(row, **compared(timed, first_s, kwker_graphs()), **first_compiles("inference", name, batch, dtype_name))


def first_compiles(kind: str, name: str, batch: int, dtype_name: str) -> dict:
    """compile_s and inductor_compile_s: each backend's first compile of the
    row's model, in a Python process of its own (first_compile_here). In this
    process the backend compiled second finds Dynamo's and transformers' Python
    warm from the first's compile of the same model: stock Inductor's compile of
    DistilBERT at batch 8, fp32, took 4.6-4.7 s after kwker's here (2-vCPU Intel
    Xeon) against 5.5 s in a process of its own."""
    def child(backend):
        out = subprocess.run([sys.executable, __file__, "--first-compile", kind, name, str(batch), dtype_name,
                              backend], check=True, capture_output=True, text=True)
        return json.loads(out.stdout.splitlines()[-1])["first_compile_s"]

    return dict(compile_s=child("kwker"), inductor_compile_s=child("inductor"))


def first_compile_here(kind: str, name: str, batch: int, dtype_name: str, backend: str) -> dict:
    """A user's first compile of one model, in this fresh process: after the
    warm-up compile of a tiny model with each backend (as the bench's own
    process has), the model's first compiled call less its second."""
    warm_up_compilers()
    if kind == "inference":
        model, inputs = build(MODELS[name], batch, dtype_name)
        call = functools.partial(torch.compile(model, backend=backend), **inputs)
    else:
        call = training_step(name, backend, *build_training(name, batch))
    seconds = []
    with torch.set_grad_enabled(kind == "training"):
        for _ in range(2):
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
    return dict(first_compile_s=max(seconds[0] - seconds[1], 0.0))


def build_training(name: str, batch: int) -> tuple[torch.nn.Module, dict, torch.Tensor]:
    """A training row's seeded model, in train mode, and its batch (inputs, target)."""
    spec = TRAIN_MODELS[name]
    torch.manual_seed(0)
    return spec.build().train(), *spec.batch(batch, torch.Generator().manual_seed(0))


def training_step(name: str, backend: str, model, inputs, target) -> Callable[[], torch.Tensor]:
    """One SGD step of `model` on the batch, its forward run by `backend` ("eager": the model itself)."""
    forward = model if backend == "eager" else torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    return functools.partial(train_step, forward, optimizer, TRAIN_MODELS[name].loss, inputs, target)


def train_step(forward, optimizer, loss_fn, inputs, target) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(forward(**inputs), target)
    loss.backward()
    optimizer.step()
    return loss.detach()


def measure_training(name: str, batch: int, rounds: int) -> dict:
    """Each backend trains its own copy of one seeded model on the same batch
    (only the model's forward is compiled; the loss, backward and SGD step are
    the caller's, as in a user's loop), so every backend's first step starts
    from the same weights and its loss can be compared with eager's. Then
    warm-up steps and `rounds` interleaved steps of all three."""
    fresh_compile_state()
    base, inputs, target = build_training(name, batch)
    steps, first_s, first_loss = {}, {}, {}
    for backend in ("eager",) + COMPILED:
        steps[backend] = training_step(name, backend, copy.deepcopy(base), inputs, target)
        start = time.perf_counter()
        first_loss[backend] = float(steps[backend]())
        first_s[backend] = time.perf_counter() - start
    for _ in range(WARMUP_CALLS):
        for step in steps.values():
            step()
    row = dict(compared(interleaved_ms({b: steps[b] for b in BACKENDS}, rounds), first_s, kwker_graphs()),
               eager_first_loss=first_loss["eager"])
    for backend in COMPILED:
        error = abs(first_loss[backend] - first_loss["eager"]) / abs(first_loss["eager"])
        row.update({f"{backend}_first_loss": first_loss[backend], f"{backend}_loss_rel_err": error,
                    f"{backend}_loss_equal": error <= LOSS_RTOL})
    return dict(row, **first_compiles("training", name, batch, "fp32"))


def with_machine_state(measure: Callable[[], dict]) -> dict:
    """measure() with the machine around it: the load average (1, 5, 15
    minutes) and kwker's pool's read bandwidth just before and just after (the
    bandwidth of this VM moves with where the host puts its vCPUs; a row whose
    two readings differ was measured across a change)."""
    threads = torch.get_num_threads()
    load_start = os.getloadavg()
    read_before = read_bandwidth_gbs(threads)
    row = measure()
    load_end = os.getloadavg()
    return dict(row, load_start=load_start, load_end=load_end, read_gbs_before=read_before,
                read_gbs_after=read_bandwidth_gbs(threads))


def guarded_row(head: dict, measure: Callable[[], dict]) -> dict:
    """One row, or the error that stopped it: a model that fails to build or a
    backend that raises costs its own row, not the rows after it."""
    try:
        row = dict(head, **with_machine_state(measure))
    except Exception as e:  # recorded in the row, its traceback on stderr
        traceback.print_exc()
        row = dict(head, error=f"{type(e).__name__}: {e}")
    print(_row_line(row), file=sys.stderr, flush=True)
    return row


def cpu_name() -> str:
    """The model name with the CPU family and model: a VM's "AMD EPYC" is Zen 4
    in family 25 and Zen 5 in family 26, which run AVX-512 at half and full width."""
    with open("/proc/cpuinfo") as f:
        fields = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return f"{fields.get('model name', 'unknown')} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"


def geomean_speedup(rows) -> float | None:
    speedups = [r["speedup_vs_inductor"] for r in rows if "error" not in r]
    return math.exp(statistics.fmean(math.log(s) for s in speedups)) if speedups else None


def run(models, batches, dtypes, train_models, repeats) -> dict:
    machine = dict(cpu=cpu_name(), threads=torch.get_num_threads())
    load_start = os.getloadavg()
    warm_up_compilers()
    rows = [guarded_row(dict(model=name, batch=batch, dtype=dtype_name, **machine),
                        functools.partial(measure_inference, name, batch, dtype_name, repeats))
            for name in models for batch in batches for dtype_name in dtypes]
    training_rows = [guarded_row(dict(model=name, batch=TRAIN_BATCH, dtype="fp32", training=True, **machine),
                                 functools.partial(measure_training, name, TRAIN_BATCH, repeats))
                     for name in train_models]
    return dict(machine, load_start=load_start, load_end=os.getloadavg(), repeats=repeats,
                warmup_calls=WARMUP_CALLS, torch=torch.__version__, transformers=transformers.__version__,
                isa=_C.cpu_isa(),
                openmp_spin={name: os.environ[name] for name in SPIN_VARIABLES if name in os.environ},
                geomean_speedup_vs_inductor=geomean_speedup(rows),
                training_geomean_speedup_vs_inductor=geomean_speedup(training_rows),
                rows=rows, training_rows=training_rows)


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _choices(graphs) -> str:
    """Each graph's kind, and the candidate kwker kept where it records one (as kwker.report() shows it)."""
    return "+".join(f"{g['kind']}: {g['choice']}" if g["choice"] else g["kind"] for g in graphs) or "-"


def _candidates(graphs) -> str:
    """Each graph's candidates (name ms, ...), graphs apart by " / "; "-" when kwker records none."""
    listed = [", ".join(f"{name} {ms:.2f}" for name, ms in g["candidates"].items())
              for g in graphs if g["candidates"]]
    return " / ".join(listed) or "-"


def _row_line(r) -> str:
    head = f"| {r['model']} | {r['batch']} | {r['dtype']} "
    if "error" in r:
        return head + f"| error: {r['error'].splitlines()[0]} |"
    line = head + "".join(f"| {r[f'{b}_ms']:.2f} ({r[f'{b}_q1_ms']:.2f}-{r[f'{b}_q3_ms']:.2f}) " for b in BACKENDS)
    line += (f"| {r['speedup_vs_inductor']:.2f} | {r['inductor_compile_s']:.1f} / {r['compile_s']:.1f} "
             f"| {_choices(r['graphs'])} | {_candidates(r['graphs'])} ")
    if r.get("training"):
        line += "".join(f"| {r[f'{b}_loss_rel_err']:.1e} ({'yes' if r[f'{b}_loss_equal'] else 'NO'}) "
                        for b in ("inductor", "kwker"))
    else:
        line += "".join(f"| {r[f'{b}_max_abs_err']:.1e} / {r[f'{b}_max_rel_err']:.1e} " for b in ("inductor", "kwker"))
    return line + (f"| {r['read_gbs_before']:.1f} / {r['read_gbs_after']:.1f} "
                   f"| {r['load_start'][0]:.2f} / {r['load_end'][0]:.2f} |")


def _table(rows, error_columns) -> list[str]:
    columns = ["model", "batch", "dtype", "eager ms (q1-q3)", "inductor ms (q1-q3)", "kwker ms (q1-q3)",
               "× inductor", "compile s inductor / kwker", "kwker choice", "candidates ms", *error_columns,
               "read GB/s before / after", "load before / after"]
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + [_row_line(r) for r in rows]


def markdown(result) -> str:
    spin = ", ".join(f"{k}={v}" for k, v in result["openmp_spin"].items()) or "OpenMP's default spinning"
    lines = [f"{result['cpu']}, {result['threads']} threads, median of {result['repeats']} interleaved calls, {spin}, "
             f"load average {result['load_start'][0]:.2f} at the start, {result['load_end'][0]:.2f} at the end", ""]
    if result["rows"]:
        lines += _table(result["rows"], ["inductor error vs eager (abs / rel)", "kwker error vs eager (abs / rel)"])
        lines += ["", f"geometric mean of × inductor: {_fmt(result['geomean_speedup_vs_inductor'], '.3f')}", ""]
    if result["training_rows"]:
        lines += _table(result["training_rows"], ["inductor first loss vs eager (= eager?)",
                                                  "kwker first loss vs eager (= eager?)"])
        lines += ["", f"geometric mean of × inductor, training: "
                      f"{_fmt(result['training_geomean_speedup_vs_inductor'], '.3f')}"]
    return "\n".join(lines)


def names(value: str, known) -> list[str]:
    chosen = [v for v in value.split(",") if v]
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown: {', '.join(unknown)} (known: {', '.join(known)})")
    return chosen


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="mlp, bert-base and resnet-50 at batch 1, fp32, 10 repeats; training of the MLP only")
    parser.add_argument("--out", help="where to write the JSON (required)")
    parser.add_argument("--models", type=lambda v: names(v, MODELS), default=list(MODELS),
                        help=f"inference rows, comma-separated (default: all of {','.join(MODELS)})")
    parser.add_argument("--batches", type=lambda v: [int(b) for b in v.split(",")], default=[1, 8],
                        help="inference batch sizes (default: 1,8)")
    parser.add_argument("--dtypes", type=lambda v: names(v, DTYPES), default=list(DTYPES),
                        help=f"inference dtypes (default: {','.join(DTYPES)})")
    parser.add_argument("--train-models", type=lambda v: names(v, TRAIN_MODELS), default=list(TRAIN_MODELS),
                        help=f"training rows, batch 8, fp32 (default: {','.join(TRAIN_MODELS)}; '' for none)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls of each backend per row (default: 20)")
    parser.add_argument("--first-compile", nargs=5, metavar=("KIND", "MODEL", "BATCH", "DTYPE", "BACKEND"),
                        help="(run by the bench) one first compile in this fresh process, as JSON")
    args = parser.parse_args()
    if args.quick:
        args.models, args.batches, args.dtypes = ["mlp", "bert-base", "resnet-50"], [1], ["fp32"]
        args.train_models, args.repeats = ["mlp"], 10
    # As bench/decode.py: every compile is a user's first, not a load from Inductor's on-disk caches.
    torch._inductor.config.force_disable_caches = True
    if args.first_compile:
        kind, name, batch, dtype_name, backend = args.first_compile
        print(json.dumps(first_compile_here(kind, name, int(batch), dtype_name, backend)))
        return
    if not args.out:
        parser.error("--out is required")
    result = run(args.models, args.batches, args.dtypes, args.train_models, args.repeats)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(markdown(result))


if __name__ == "__main__":
    main()
