"""Decode speed side by side with what users would pick instead of kwker:
eager, stock Inductor, tuned Inductor, kwker (and kwker under `python -m
kwker.run --jemalloc`), OpenVINO and llama.cpp, on the same weights.

    python bench/peers.py [--quick] --out bench/results/peers.json

Writes the JSON to --out and, beside it, the markdown table (.md) and two charts
(-tokens.png: decode tokens/s; -roofline.png: fraction of the read roofline).

The peers are built the first time and kept under build/peers/ (about 15
minutes on 2 cores, with PyPI reachable):
- llama.cpp: `llama-bench` from the llama.cpp sources vendored in
  llama-cpp-python's source package on PyPI (LLAMA_CPP_PYTHON, checked by its
  sha256), built with CMake and GGML_NATIVE=ON; the weights converted by the
  vendored convert_hf_to_gguf.py (f32 or bf16, as the row's dtype), with a small
  SentencePiece tokenizer the converter can read (llama-bench decodes token ids,
  never text);
- OpenVINO: optimum-intel's OVModelForCausalLM, what OpenVINO users run for
  LLMs (a stateful export: the KV cache lives in the compiled model), in a
  virtual environment of its own (OPENVINO_REQUIREMENTS): optimum-intel 2.2 asks
  for transformers < 5.6 and torchvision, which would replace kwker's
  transformers and torch, so it gets transformers 5.5.4 and this machine's torch.

Every backend reads one checkpoint (the bench model, random bf16-valued weights,
saved once under build/peers/models/), decodes `--new-tokens` tokens after a
`--prompt-len`-token prompt, greedy, on torch's thread count. A torch backend's
tokens/s is decode time per token of generate() (bench/decode.py's
timed_generate: from the first decode call to the end); OpenVINO's the same
span of its generate(); llama.cpp's is llama-bench's tg rate (`-p 0 -n N -d
PROMPT_LEN`: the same positions). Each backend runs in a process of its own
(bench/peers_worker.py; llama-bench is its own program), compiled or loaded
once, then rounds interleave them (A B C, B C A, ...). Around each run: the
read bandwidth (bench/ops_bench.c) and the CPU time every other process used
(/proc/stat less the run's own process): a run where others took more than
OTHER_LOAD of a CPU is marked and left out of the medians, and a run whose two
bandwidth readings differ by more than decode.STEADY gives no roofline.
"""

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode  # noqa: E402  (bench/decode.py: generate timing, bytes per step, read bandwidth)
import ops as ops_bench  # noqa: E402  (bench/ops.py: CPU time of everyone)
from models import cpu_name  # noqa: E402
from peers_worker import DTYPES, TORCH_BACKENDS  # noqa: E402

from kwker import _C  # noqa: E402
from kwker.testing import BENCH_CONFIGS, bench_model  # noqa: E402
from kwker.threads import SPIN_VARIABLES, with_short_spin  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "build" / "peers"
WORKER = Path(__file__).resolve().parent / "peers_worker.py"

BACKENDS = TORCH_BACKENDS + ("openvino", "llama.cpp")

LLAMA_CPP_PYTHON = dict(
    version="0.3.36",
    url="https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
        "llama_cpp_python-0.3.36.tar.gz",
    sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")

# optimum-intel and what it needs, installed without its torchvision (never imported
# for a causal LM) and with this machine's torch: see the docstring.
OPENVINO_REQUIREMENTS = (
    ["torch==2.13.0"],
    ["--no-deps", "optimum-intel==2.2.0", "optimum==2.3.0", "transformers==5.5.4", "tokenizers==0.22.2"],
    ["openvino==2026.4.1", "openvino-tokenizers==2026.4.1.0", "nncf==3.4.0", "huggingface-hub>=0.23.2,<1.22",
     "safetensors", "requests>=2.33,<3", "setuptools", "packaging", "pyyaml", "regex", "tqdm", "filelock", "typer"],
)

OTHER_LOAD = 0.10  # CPU seconds other processes may use per second of a run before it is marked


def logged(cmd, log: Path, **kwargs) -> None:
    """Runs a build step with its output in `log`; a failure names the log and shows its end."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"peers: {' '.join(map(str, cmd))}  (log: {log})", file=sys.stderr, flush=True)
    with open(log, "a") as f:
        done = subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, **kwargs)
    if done.returncode:
        tail = log.read_text().splitlines()[-20:]
        raise RuntimeError(f"{cmd[0]} failed ({done.returncode}); the end of {log}:\n" + "\n".join(tail))


def llama_cpp_sources() -> Path:
    """The llama.cpp sources vendored in llama-cpp-python's sdist, downloaded once and checked."""
    src = PEERS / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON['version']}"
    if not (src / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        archive = PEERS / "src" / f"{src.name}.tar.gz"
        archive.parent.mkdir(parents=True, exist_ok=True)
        if not archive.exists():
            print(f"peers: downloading {LLAMA_CPP_PYTHON['url']}", file=sys.stderr, flush=True)
            with urllib.request.urlopen(LLAMA_CPP_PYTHON["url"]) as r, open(f"{archive}.part", "wb") as f:
                shutil.copyfileobj(r, f)
            os.replace(f"{archive}.part", archive)
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != LLAMA_CPP_PYTHON["sha256"]:
            archive.unlink()
            raise RuntimeError(f"{archive.name}: sha256 {digest}, expected {LLAMA_CPP_PYTHON['sha256']}")
        with tarfile.open(archive) as t:
            t.extractall(archive.parent, filter="data")
    return src / "vendor" / "llama.cpp"


def llama_bench() -> Path:
    exe = PEERS / "llama-build" / "bin" / "llama-bench"
    if not exe.exists():
        source = llama_cpp_sources()
        log = PEERS / "llama-build.log"
        logged(["cmake", "-S", source, "-B", exe.parent.parent, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_SERVER=OFF"], log)
        logged(["cmake", "--build", exe.parent.parent, "--target", "llama-bench", f"-j{os.cpu_count()}"], log)
    return exe


def openvino_python() -> Path:
    """The OpenVINO environment's python, made once (a stamp holds its requirements)."""
    venv = PEERS / "openvino-venv"
    python, stamp = venv / "bin" / "python", venv / "requirements.json"
    want = json.dumps(OPENVINO_REQUIREMENTS)
    if not stamp.exists() or stamp.read_text() != want:
        log = PEERS / "openvino-venv.log"
        logged([sys.executable, "-m", "venv", "--clear", venv], log)
        for packages in OPENVINO_REQUIREMENTS:
            logged([python, "-m", "pip", "install", "-q", *packages], log)
        stamp.write_text(want)
    return python


def model_dir(name: str) -> Path:
    """bench_model(name) saved once in float32 (every weight bf16-valued, so the
    bf16 rows load the same values), with a tokenizer llama.cpp's converter reads."""
    path = PEERS / "models" / name
    if not (path / "tokenizer.model").exists():  # written last
        bench_model(name).save_pretrained(path)
        sentencepiece_tokenizer(path)
    return path


def sentencepiece_tokenizer(path: Path) -> None:
    """A small SentencePiece model (trained on kwker's README) as tokenizer.model:
    convert_hf_to_gguf.py pads its vocabulary up to the config's vocab_size."""
    import sentencepiece

    lines = (ROOT / "README.md").read_text().splitlines()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(path / "tokenizer"),
                                             vocab_size=512, model_type="bpe", hard_vocab_limit=False,
                                             minloglevel=2)
    (path / "tokenizer.vocab").unlink()


def gguf(name: str, dtype: str) -> Path:
    out = PEERS / "models" / f"{name}-{dtype}.gguf"
    if not out.exists():
        source = llama_cpp_sources()
        env = dict(os.environ, PYTHONPATH=str(source / "gguf-py"))
        logged([sys.executable, source / "convert_hf_to_gguf.py", model_dir(name), "--outtype",
                {"fp32": "f32", "bf16": "bf16"}[dtype], "--outfile", f"{out}.part"], PEERS / "gguf.log", env=env)
        os.replace(f"{out}.part", out)
    return out


def pid_cpu_s(pid: int) -> float:
    """CPU seconds a live process (all its threads) has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class Worker:
    """A backend in its own process (bench/peers_worker.py): started and
    compiled once; each run() is one timed generate()."""

    def __init__(self, backend, model_path, dtype, args):
        worker = [WORKER, backend, model_path, "--dtype", dtype, "--prompt-len", args.prompt_len,
                  "--new-tokens", args.new_tokens, "--max-cache-len", args.max_cache_len]
        worker += ["--max-autotune"] if args.max_autotune else []
        if backend == "openvino":
            cmd = [openvino_python()] + worker
        elif backend == "kwker+jemalloc":
            cmd = [sys.executable, "-m", "kwker.run", "--jemalloc", "--"] + worker
        else:
            cmd = [sys.executable] + worker
        self.proc = subprocess.Popen(list(map(str, cmd)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=worker_env())
        self.ready = self._message()

    def _message(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.args[1:3]} exited ({self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def run(self) -> tuple[float, float]:
        """Decode seconds per token, and the CPU seconds the worker used meanwhile."""
        cpu = pid_cpu_s(self.proc.pid)
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        token_s = self._message()["token_s"]
        return token_s, pid_cpu_s(self.proc.pid) - cpu

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


class LlamaBench:
    """llama.cpp's own benchmark on the converted weights, one repetition per run."""

    def __init__(self, name, dtype, args):
        threads = torch.get_num_threads()
        base = [str(llama_bench()), "-m", str(gguf(name, dtype)), "-p", "0", "-d", str(args.prompt_len),
                "-t", str(threads), "-r", "1", "-o", "json"]
        self.cmd, self.new_tokens = base + ["-n", str(args.new_tokens)], args.new_tokens
        start = time.perf_counter()
        subprocess.run(base + ["-n", "1"], check=True, capture_output=True, env=worker_env())
        self.ready = dict(compile_s=time.perf_counter() - start, load_s=None, tokens=None, threads=threads,
                          settings=dict(command=" ".join(self.cmd[1:]), llama_cpp_python=LLAMA_CPP_PYTHON["version"]))

    def run(self) -> tuple[float, float]:
        cpu = ops_bench.children_cpu_s()
        out = subprocess.run(self.cmd, check=True, capture_output=True, text=True, env=worker_env())
        test = json.loads(out.stdout)[0]
        assert test["n_gen"] == self.new_tokens, test
        return 1.0 / test["avg_ts"], ops_bench.children_cpu_s() - cpu

    def close(self):
        pass


def worker_env() -> dict:
    """Every backend's environment: this one, its OpenMP spin as kwker.run sets it."""
    return with_short_spin(os.environ)


def timed_run(backend, threads) -> dict:
    """One run with the machine around it: read bandwidth before and after, and the
    CPU time every other process used during it."""
    before = decode.read_bandwidth_gbs(threads)
    busy, own, start = ops_bench.cpu_busy_s(), own_cpu_s(), time.perf_counter()
    token_s, run_cpu = backend.run()
    wall = time.perf_counter() - start
    others = ops_bench.cpu_busy_s() - busy - run_cpu - (own_cpu_s() - own)
    after = decode.read_bandwidth_gbs(threads)
    return dict(token_s=token_s, read_gbs_before=before, read_gbs_after=after, others_cpu_per_s=max(others, 0) / wall,
                loaded=others / wall > OTHER_LOAD)


def row(name, dtype, backend, ready, runs, step_bytes, eager_tokens) -> dict:
    clean = [r for r in runs if not r["loaded"]] or runs
    token_s = [r["token_s"] for r in clean]
    steady = [step_bytes / ((r["read_gbs_before"] + r["read_gbs_after"]) / 2 * 1e9) / r["token_s"] for r in clean
              if abs(r["read_gbs_before"] - r["read_gbs_after"]) <= decode.STEADY * min(r["read_gbs_before"],
                                                                                        r["read_gbs_after"])]
    tokens = ready["tokens"] if eager_tokens is not None else None  # compared with eager's, when eager ran
    return dict(
        model=name, dtype=dtype, backend=backend,
        tokens_per_s=1.0 / statistics.median(token_s),
        tokens_per_s_min=1.0 / max(token_s), tokens_per_s_max=1.0 / min(token_s),
        roofline_frac=statistics.median(steady) if steady else None,
        read_gbs=statistics.median(r[k] for r in clean for k in ("read_gbs_before", "read_gbs_after")),
        step_bytes=step_bytes,
        compile_s=ready["compile_s"], load_s=ready["load_s"], export_s=ready.get("export_s"),
        tokens_equal=None if tokens is None else tokens == eager_tokens,
        matching_tokens=None if tokens is None else next(
            (i for i, (a, b) in enumerate(zip(tokens, eager_tokens)) if a != b), len(tokens)),
        clean_runs=sum(not r["loaded"] for r in runs), runs=runs, loaded=all(r["loaded"] for r in runs),
        steady_runs=len(steady), threads=ready["threads"], settings=ready["settings"])


def start(backend, name, dtype, path, args):
    print(f"peers: {name} {dtype} {backend}: compiling", file=sys.stderr, flush=True)
    if backend == "llama.cpp":
        return LlamaBench(name, dtype, args)
    return Worker(backend, path, dtype, args)


def measure(name, dtype, backends, args) -> list[dict]:
    """Every backend of one model and dtype: started one after another (each
    compile alone on the machine), then `args.repeats` interleaved rounds."""
    path = model_dir(name)
    model = bench_model(name, dtype=DTYPES[dtype])
    step_bytes = {b: decode.bytes_per_step(model, b, args.prompt_len + args.new_tokens / 2) for b in backends}
    del model
    started, errors = {}, {}
    for b in backends:
        try:
            started[b] = start(b, name, dtype, path, args)
        except Exception as e:  # a peer that cannot be built or started costs its own row
            errors[b] = f"{type(e).__name__}: {e}"
            print(f"peers: {b}: {errors[b]}", file=sys.stderr, flush=True)
    runs = {b: [] for b in started}
    names = list(started)
    threads = torch.get_num_threads()
    for i in range(args.repeats):
        for b in names[i % len(names):] + names[:i % len(names)]:
            runs[b].append(timed_run(started[b], threads))
            r = runs[b][-1]
            print(f"peers: {name} {dtype} {b}: {1 / r['token_s']:.2f} tok/s, read {r['read_gbs_before']:.1f}/"
                  f"{r['read_gbs_after']:.1f} GB/s, others {r['others_cpu_per_s']:.2f} CPU", file=sys.stderr,
                  flush=True)
    for b in started.values():
        b.close()
    eager_tokens = started["eager"].ready["tokens"] if "eager" in started else None
    rows = [row(name, dtype, b, started[b].ready, runs[b], step_bytes[b], eager_tokens)
            for b in started]
    rows += [dict(model=name, dtype=dtype, backend=b, error=e) for b, e in errors.items()]
    return rows


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def markdown(result) -> str:
    lines = [f"{result['cpu']}, {result['threads']} threads, {result['new_tokens']} new tokens after "
             f"{result['prompt_len']}, median of {result['repeats']} interleaved runs, torch {result['torch']}",
             "",
             "| model | dtype | backend | decode tok/s (min–max) | × tuned Inductor | roofline | read GB/s "
             "| compile/load s | tokens = eager (leading equal) | clean runs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['dtype']} | {r['backend']} | failed: {r['error'][:120]} "
                         "| | | | | | |")
            continue
        tuned = next((t for t in result["rows"] if t["backend"] == "inductor-tuned" and "error" not in t
                      and (t["model"], t["dtype"]) == (r["model"], r["dtype"])), None)
        equal = "-" if r["tokens_equal"] is None else f"{'yes' if r['tokens_equal'] else 'NO'} ({r['matching_tokens']})"
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['backend']} | {r['tokens_per_s']:.2f} ({r['tokens_per_s_min']:.2f}–"
            f"{r['tokens_per_s_max']:.2f}) | {_fmt(tuned and r['tokens_per_s'] / tuned['tokens_per_s'], '.2f')} "
            f"| {_fmt(r['roofline_frac'], '.2f')} | {r['read_gbs']:.1f} | {r['compile_s']:.1f} | {equal} "
            f"| {r['clean_runs']}/{len(r['runs'])}{' LOADED' if r['loaded'] else ''} |")
    return "\n".join(lines)


def charts(result, stem: Path) -> list[Path]:
    """Two bar charts, one group of bars per model and dtype, one bar per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "error" not in r]
    groups = list(dict.fromkeys((r["model"], r["dtype"]) for r in rows))
    backends = [b for b in BACKENDS if any(r["backend"] == b for r in rows)]
    paths = []
    for field, label, suffix in (("tokens_per_s", "decode tokens/s", "tokens"),
                                 ("roofline_frac", "fraction of the read roofline", "roofline")):
        fig, ax = plt.subplots(figsize=(3.2 + 1.2 * len(groups) * len(backends) / 3, 4))
        width = 0.8 / len(backends)
        for j, b in enumerate(backends):
            values = [next((r[field] or 0 for r in rows if (r["model"], r["dtype"]) == g and r["backend"] == b), 0)
                      for g in groups]
            bars = ax.bar([i + j * width for i in range(len(groups))], values, width, label=b)
            ax.bar_label(bars, fmt="%.1f" if field == "tokens_per_s" else "%.2f", fontsize=6)
        ax.set_xticks([i + width * (len(backends) - 1) / 2 for i in range(len(groups))],
                      [f"{m}\n{d}" for m, d in groups])
        ax.set_ylabel(label)
        ax.set_title(f"{label}, {result['threads']} threads, {result['cpu']}", fontsize=9)
        ax.margins(y=0.1)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        paths.append(stem.with_name(f"{stem.name}-{suffix}.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the SmolLM2-360M shape only, 64 new tokens")
    parser.add_argument("--out", required=True, help="the JSON; the .md and charts go beside it")
    parser.add_argument("--models", default="SmolLM2-360M,Qwen2.5-0.5B,Llama-3.2-1B")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-cache-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-autotune", action="store_true",
                        help="tuned Inductor with mode='max-autotune' too (its compile took minutes)")
    args = parser.parse_args()
    if args.quick:
        args.models, args.new_tokens = "SmolLM2-360M", 64
    models, dtypes, backends = args.models.split(","), args.dtypes.split(","), args.backends.split(",")
    for value, known in ((models, BENCH_CONFIGS), (dtypes, DTYPES), (backends, BACKENDS)):
        if unknown := [v for v in value if v not in known]:
            parser.error(f"unknown {unknown}; known: {', '.join(known)}")
    if args.prompt_len + args.new_tokens > args.max_cache_len:
        parser.error("--prompt-len + --new-tokens must fit in --max-cache-len")
    rows = [r for name in models for dtype in dtypes for r in measure(name, dtype, backends, args)]
    result = dict(cpu=cpu_name(), machine=platform.machine(), isa=_C.cpu_isa(), threads=torch.get_num_threads(),
                  torch=torch.__version__, new_tokens=args.new_tokens, prompt_len=args.prompt_len,
                  max_cache_len=args.max_cache_len, repeats=args.repeats, max_autotune=args.max_autotune,
                  environment={k: v for k, v in worker_env().items() if k in SPIN_VARIABLES}, rows=rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    table = markdown(result)
    out.with_suffix(".md").write_text(table + "\n")
    for path in charts(result, out.with_suffix("")):
        print(f"peers: wrote {path}", file=sys.stderr)
    print(table)


if __name__ == "__main__":
    main()
