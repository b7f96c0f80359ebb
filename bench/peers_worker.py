"""One backend of bench/peers.py in a process of its own (run by peers.py, not by hand).

    python bench/peers_worker.py BACKEND MODEL_DIR --dtype fp32|bf16 ...

Each backend gets a fresh process: its first compile is a user's, its settings
(tuned Inductor's globals, jemalloc preloaded by `python -m kwker.run`, an
OpenVINO environment of its own) touch nothing else. The worker loads the saved
model, compiles or exports it, makes the reference run's tokens, says `ready`,
then answers each `run` line on stdin with one timed generate(). Messages are
JSON lines on the stdout the worker started with; everything a library prints
goes to stderr.

Imports kwker and bench/decode.py only for the torch backends: the OpenVINO
worker runs in an environment of its own (peers.py, `openvino_python`) without them.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Tuned Inductor: what PyTorch's CPU performance guides turn on for LLM inference.
INDUCTOR_TUNED = {"freezing": True, "cpp_wrapper": True, "cpp.enable_concat_linear": True}

# The backends whose tokens come from Hugging Face generate() on the torch model.
TORCH_BACKENDS = ("eager", "inductor", "inductor-tuned", "kwker", "kwker+jemalloc")


def protocol_stream():
    """The stdout the worker started with, for its messages; fd 1 then points at
    stderr, so that whatever Python or C code prints cannot break a message."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return stream


class TorchBackend:
    """eager, Inductor (stock or tuned) or kwker through generate()'s compile_config,
    timed as bench/decode.py times it (decode.timed_generate: the decode time per
    token from the first decode call to the end of generate())."""

    def __init__(self, name, model_dir, dtype, max_cache_len, max_autotune):
        from transformers import AutoModelForCausalLM

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import decode  # noqa: PLC0415  (bench/decode.py, beside this file)

        self.decode, self.max_cache_len = decode, max_cache_len
        torch._inductor.config.force_disable_caches = True  # a user's first compile
        self.settings = {}
        if name == "inductor-tuned":
            torch._inductor.config.load_config(INDUCTOR_TUNED)  # for this whole process
            self.settings = dict(INDUCTOR_TUNED, mode="max-autotune" if max_autotune else None)
        self.compile_kwargs = {
            "eager": None,
            "inductor": dict(backend="inductor", mode=None),
            "inductor-tuned": dict(backend="inductor", mode="max-autotune" if max_autotune else None),
            "kwker": dict(backend="kwker", mode=None),
            "kwker+jemalloc": dict(backend="kwker", mode=None),
        }[name]
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
        self.load_s = time.perf_counter() - start

    def compile(self, ids) -> float:
        """A user's first compile: the first two-token generate less a warm one."""
        _, first = self.decode.generate(self.model, ids, 2, self.compile_kwargs, self.max_cache_len)
        _, warm = self.decode.generate(self.model, ids, 2, self.compile_kwargs, self.max_cache_len)
        return max(first - warm, 0.0)

    def tokens(self, ids, new_tokens) -> list[int]:
        out, _ = self.decode.generate(self.model, ids, new_tokens, self.compile_kwargs, self.max_cache_len)
        return out[0, ids.shape[1]:].tolist()

    def decode_token_s(self, ids, new_tokens) -> float:
        return self.decode.timed_generate(self.model, ids, new_tokens, self.compile_kwargs, self.max_cache_len)[0]


class OpenVINOBackend:
    """optimum-intel's OVModelForCausalLM, as OpenVINO users run LLMs: a stateful
    model (the KV cache lives inside the compiled model) exported once from the
    saved checkpoint into MODEL_DIR/openvino, compiled for the CPU with the
    precision hint of the row's dtype. Timed as generate() from its first decode
    call (the second call of the model) to the end of generate()."""

    def __init__(self, name, model_dir, dtype, max_cache_len, max_autotune):
        from optimum.intel import OVModelForCausalLM

        self.config = {"INFERENCE_PRECISION_HINT": {"fp32": "f32", "bf16": "bf16"}[dtype],
                       "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1", "CACHE_DIR": ""}
        exported = Path(model_dir) / "openvino"
        self.export_s = None
        if not (exported / "openvino_model.xml").exists():
            start = time.perf_counter()
            OVModelForCausalLM.from_pretrained(model_dir, export=True, stateful=True, compile=False,
                                               load_in_8bit=False).save_pretrained(exported)
            self.export_s = time.perf_counter() - start
        start = time.perf_counter()
        self.model = OVModelForCausalLM.from_pretrained(exported, ov_config=self.config)
        self.load_s = time.perf_counter() - start
        compiled = self.model.request.get_compiled_model()
        self.settings = dict(self.config, export="optimum-intel OVModelForCausalLM, stateful",
                             kv_cache_precision=compiled.get_property("KV_CACHE_PRECISION").to_string(),
                             inference_precision=compiled.get_property("INFERENCE_PRECISION_HINT").to_string(),
                             threads=int(compiled.get_property("INFERENCE_NUM_THREADS")))

    def compile(self, ids) -> float:
        return self.load_s  # compile_model ran in from_pretrained: the load is the compile

    def generate(self, ids, new_tokens):
        return self.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def tokens(self, ids, new_tokens) -> list[int]:
        return self.generate(ids, new_tokens)[0, ids.shape[1]:].tolist()

    def decode_token_s(self, ids, new_tokens) -> float:
        starts = []
        forward = self.model.forward

        def timed(*args, **kwargs):
            starts.append(time.perf_counter())
            return forward(*args, **kwargs)

        self.model.forward = timed
        try:
            self.generate(ids, new_tokens)
            end = time.perf_counter()
        finally:
            del self.model.forward
        assert len(starts) == new_tokens, (len(starts), new_tokens)
        return (end - starts[1]) / (new_tokens - 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("backend", choices=TORCH_BACKENDS + ("openvino",))
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", choices=DTYPES, required=True)
    parser.add_argument("--prompt-len", type=int, required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--max-cache-len", type=int, required=True)
    parser.add_argument("--max-autotune", action="store_true")
    args = parser.parse_args()
    out = protocol_stream()
    cls = OpenVINOBackend if args.backend == "openvino" else TorchBackend
    with torch.no_grad():
        backend = cls(args.backend, args.model_dir, args.dtype, args.max_cache_len, args.max_autotune)
        ids = torch.randint(0, backend.model.config.vocab_size, (1, args.prompt_len),
                            generator=torch.Generator().manual_seed(0))
        compile_s = backend.compile(ids)
        tokens = backend.tokens(ids, args.new_tokens)
        print(json.dumps(dict(ready=True, compile_s=compile_s, load_s=backend.load_s, tokens=tokens,
                              settings=backend.settings, threads=torch.get_num_threads(),
                              export_s=getattr(backend, "export_s", None))), file=out)
        for line in sys.stdin:
            if line.strip() != "run":
                break
            print(json.dumps(dict(token_s=backend.decode_token_s(ids, args.new_tokens))), file=out)


if __name__ == "__main__":
    main()
