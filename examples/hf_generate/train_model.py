r'''Train the embedded default model: a tiny Llama on Python's own standard library.

The model in ``examples/hf_generate/model/`` is what the example script and the
token-equality tests run when no other checkpoint is given. It is trained from
scratch by this script, offline, on text that ships with every Python: the ``.py``
sources of the standard library (``sysconfig.get_paths()["stdlib"]``, without
``site-packages``, the regression tests, ``idlelib/``, the codec tables in ``encodings/``
and the help prose in ``pydoc_data/``).

What it builds
  * tokenizer: byte-level BPE (``tokenizers``: a code-aware regex split, then the
    ByteLevel pre-tokenizer; ByteLevel decoder), ``--vocab-size`` entries, one special token ``<|endoftext|>`` that is BOS, EOS and
    PAD at once; the tokenizer prepends it to every encoded text, as every training
    file was preceded by it.
  * model: ``LlamaForCausalLM``, grouped-query attention (``--heads`` query heads share
    ``--kv-heads`` key/value heads), ``--layers`` layers, tied input/output embeddings,
    float32 master weights trained under bfloat16 autocast, saved in bfloat16
    (safetensors).

How it trains
  Files are read in sorted path order, tokenized, and joined with ``<|endoftext|>``;
  every 50th file is held out for validation. Each step takes ``--batch-size`` windows
  of ``--seq-len`` tokens at positions drawn from a seeded generator. AdamW
  (betas 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine decay to
  a tenth of ``--lr``, gradients clipped to norm 1. ``torch.set_num_threads(--threads)``
  and fixed seeds: the same Python (3.11.7), torch and machine give the same model.

Usage
  python examples/hf_generate/train_model.py --out examples/hf_generate/model

Arguments (all optional; the defaults made the committed model)
  --out DIR           where to save (default: model/ beside this script)
  --vocab-size N      BPE vocabulary size, special token included (4096)
  --hidden N          hidden size (256)
  --intermediate N    MLP size (768)
  --layers N          decoder layers (4)
  --heads N           query heads (8)
  --kv-heads N        key/value heads (2)
  --seq-len N         training window in tokens (256)
  --batch-size N      windows per step (8)
  --steps N           optimizer steps (2000)
  --warmup N          warm-up steps (100)
  --lr X              peak learning rate (2e-3)
  --seed N            seed for weights and batch positions (0)
  --threads N         torch threads (2)
  --log-every N       steps between loss lines (50)

Result of the committed run (2 cores of an AMD EPYC with AVX-512 BF16, shared with other
jobs; Python 3.11.7, torch 2.13.0 CPU, transformers 5.24.0, tokenizers 0.23.3):
  549 files, 9.1 M characters -> 2.67 M training tokens (0.02 M validation);
  4.07 M parameters; 2000 steps x 8 x 256 tokens = 4.1 M tokens (about 1.5 epochs)
  at ~5,400 tokens/s: training 12.5 min, 12.6 min in all.
  Final training loss 2.97 (smoothed), validation loss 3.26 nats/token (0.95 nats/char).
  8.4 MB on disk. Greedy, from "def fibonacci(n):\n":
      def fibonacci(n):
          """
          Return the current file for the current file file to the file file.
          """
          if not isinstance(p, str):
              return None
  Two runs on the same machine give byte-identical files (checked with --steps 30);
  another Python version has other stdlib sources and so gives another model.

Things that mattered (same ~3-4 M token budget): 8 windows a step rather than 16
(validation 1.01 vs 1.07 nats/char), leaving out the codec tables and pydoc prose, and
the code pre-tokenizer (prompts ending in "\n" are then followed by an indented body).
'''

import argparse
import math
import os
import random
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

SPECIAL_TOKEN = "<|endoftext|>"
# Pre-tokenizer split for code (the ByteLevel step after it maps bytes, no regex):
# newlines apart from the indentation after them, words keep "_" and take the space
# *after* them. So prompts that end the usual ways ("...:\n", "\n    ", "def ") end on a
# token boundary seen in training, which GPT-2's split (" word", "\n   " + " word") breaks.
CODE_PRETOKENIZE_PATTERN = r"[\r\n]+|[\p{L}_][\p{L}\p{N}_]* ?|\p{N}+ ?|[^\s\p{L}\p{N}_]+ ?|[ \t]+|\s+"
STEPS_DEFAULT = 2000
WARMUP_DEFAULT = 100
LR_DEFAULT = 2e-3
LOG_EVERY_DEFAULT = 50
VALIDATION_EVERY_NTH_FILE = 50
SAMPLE_PROMPTS = ("def fibonacci(n):\n", "import os\n\n\ndef ")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "model")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=STEPS_DEFAULT)
    parser.add_argument("--warmup", type=int, default=WARMUP_DEFAULT)
    parser.add_argument("--lr", type=float, default=LR_DEFAULT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=LOG_EVERY_DEFAULT)
    return parser.parse_args()


def stdlib_source_files():
    """The standard library's .py files in a fixed (sorted) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    # not code to learn from: regression tests, IDLE, codec tables (encodings/), help prose (pydoc_data/)
    skipped_dirs = {"site-packages", "dist-packages", "test", "tests", "idlelib", "encodings", "pydoc_data", "__pycache__"}
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if skipped_dirs.intersection(relative.parts[:-1]) or relative.name.startswith("_sysconfigdata"):
            continue
        files.append(path)
    return files


def read_texts(files):
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def train_tokenizer(texts, vocab_size):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CODE_PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[SPECIAL_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    special_id = tokenizer.token_to_id(SPECIAL_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKEN} $A",
        pair=f"{SPECIAL_TOKEN} $A {SPECIAL_TOKEN} $B",
        special_tokens=[(SPECIAL_TOKEN, special_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=SPECIAL_TOKEN,
        eos_token=SPECIAL_TOKEN,
        pad_token=SPECIAL_TOKEN,
        unk_token=None,
        model_max_length=4096,
    )


def token_stream(tokenizer, texts):
    """All texts as one 1-D tensor, each preceded by the special token."""
    encodings = tokenizer.backend_tokenizer.encode_batch(texts)  # post-processor adds BOS
    ids = [token for encoding in encodings for token in encoding.ids]
    return torch.tensor(ids, dtype=torch.long)


def build_model(args, tokenizer):
    special_id = tokenizer.convert_tokens_to_ids(SPECIAL_TOKEN)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=special_id,
        eos_token_id=special_id,
        pad_token_id=special_id,
    )
    return LlamaForCausalLM(config)


def batch_at(stream, positions, seq_len):
    windows = torch.stack([stream[p : p + seq_len + 1] for p in positions.tolist()])
    return windows[:, :-1], windows[:, 1:]


def learning_rate(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(model, lr):
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def next_token_loss(model, inputs, targets):
    with torch.autocast("cpu", dtype=torch.bfloat16):  # about twice fp32's speed on AVX512-BF16 CPUs
        logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def validation_loss(model, stream, seq_len, windows=32):
    model.eval()
    stride = max(1, (len(stream) - seq_len - 1) // windows)
    positions = torch.arange(windows) * stride
    losses = [next_token_loss(model, *batch_at(stream, positions[i : i + 8], seq_len)) for i in range(0, windows, 8)]
    model.train()
    return torch.stack(losses).mean().item()


def train(model, train_stream, val_stream, args):
    optimizer = make_optimizer(model, args.lr)
    positions_rng = torch.Generator().manual_seed(args.seed)
    model.train()
    start, smoothed = time.time(), None
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        positions = torch.randint(0, len(train_stream) - args.seq_len - 1, (args.batch_size,), generator=positions_rng)
        loss = next_token_loss(model, *batch_at(train_stream, positions, args.seq_len))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        smoothed = loss.item() if smoothed is None else 0.9 * smoothed + 0.1 * loss.item()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            elapsed = time.time() - start
            tokens_per_s = (step + 1) * args.batch_size * args.seq_len / elapsed
            print(f"step {step + 1:5d}  loss {smoothed:.3f}  lr {learning_rate(step, args):.2e}  "
                  f"{tokens_per_s:,.0f} tok/s  {elapsed:6.0f} s", flush=True)
    train_seconds = time.time() - start
    return smoothed, validation_loss(model, val_stream, args.seq_len), train_seconds


def save(model, tokenizer, out):
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
        do_sample=False,
        max_new_tokens=64,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return sum(f.stat().st_size for f in out.iterdir() if f.is_file())


@torch.no_grad()
def print_samples(out):
    """Greedy continuations, from the saved files (bfloat16) as a user would load them."""
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        generated = model.generate(ids, max_new_tokens=64, do_sample=False)
        print(f"--- sample ({model.dtype}, greedy) ---\n{tokenizer.decode(generated[0], skip_special_tokens=True)}")


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    total_start = time.time()

    files = stdlib_source_files()
    texts = read_texts(files)
    val_texts = texts[::VALIDATION_EVERY_NTH_FILE]
    train_texts = [t for i, t in enumerate(texts) if i % VALIDATION_EVERY_NTH_FILE]
    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    train_stream, val_stream = token_stream(tokenizer, train_texts), token_stream(tokenizer, val_texts)
    print(f"{len(texts)} files, {sum(map(len, texts)) / 1e6:.1f} M chars; tokens: "
          f"{len(train_stream) / 1e6:.2f} M train, {len(val_stream) / 1e6:.2f} M validation "
          f"({time.time() - total_start:.0f} s)", flush=True)

    model = build_model(args, tokenizer)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters; "
          f"{args.steps} steps x {args.batch_size} x {args.seq_len} tokens", flush=True)
    train_loss, val_loss, train_seconds = train(model, train_stream, val_stream, args)
    size = save(model, tokenizer, args.out)
    val_tokens_per_char = len(val_stream) / sum(map(len, val_texts))
    print(f"final train loss {train_loss:.3f}, validation loss {val_loss:.3f} "
          f"({val_loss * val_tokens_per_char:.3f} nats/char); "
          f"training {train_seconds / 60:.1f} min, total {(time.time() - total_start) / 60:.1f} min; "
          f"saved {size / 1e6:.1f} MB to {args.out}", flush=True)
    print_samples(args.out)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    main()
