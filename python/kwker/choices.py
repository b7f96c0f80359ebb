"""Tuning choices remembered on disk, as Inductor remembers its compiled graphs.

A tuned graph's choice (the candidate kept, the one a frozen graph gives up
to, and the times they were chosen on) is written under the graph's key, and a
later compile of a graph with the same key, in this process or another, builds
the kept candidate alone: no other candidate is compiled, checked or timed.
Without it a restarted process tuned every graph again, while Inductor loaded
its own from its caches: DistilBERT at batch 8 in float32 on the 2-vCPU Intel
Xeon, a second process's first compile took 3.0 s with kwker against 0.85 s
with Inductor (6.9 s and 5.7 s with cold caches).

The key holds what the choice rests on: Dynamo's graph and every graph inside
it (a higher-order op's body: checkpoint, cond; two models whose graphs differed
only there would otherwise share a choice, and a recalled Inductor could give
the wrong gradients that tuning had caught in one of them), with the tensors
their get_attr nodes read; each input's type, dtype, shape, strides, whether
it requires grad and which inputs share its storage; whether each float32
parameter is exactly bf16-valued (kwker's plan then reads bf16 copies, at half
the bytes); grad mode, inference
mode, autocast and the precision float32 may be computed in (oneDNN's fp32_precision
settings, which set_float32_matmul_precision sets); kwker's options and Inductor's
config; the CPU (its model name, kwker's ISA, the threads, the preloaded
allocator); and the versions of torch and of kwker's own code (its files,
hashed). What differs in none of these (the weights' values otherwise, the
inputs' values) reuses the choice, as timing on one call's inputs did; a
choice is not checked again, nor timed. So a choice timed while other
processes kept the CPUs busy is not written (dynamo_backend.remember_unless_an_error).

The records live in KWKER_CACHE_DIR, by default a "kwker" folder beside
Inductor's (torch._inductor.runtime.cache_dir_utils.cache_dir()); what turns
Inductor's caches off, torch.compiler.config.force_disable_caches
(TORCHINDUCTOR_FORCE_DISABLE_CACHES=1), turns them off too.
"""

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import stat
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kwker.lower import first_over_storage
from kwker.options import KwkerOptions
from kwker.tune import fp32_precision_settings
from kwker.weights import is_bf16_valued

log = logging.getLogger(__name__)


@dataclass
class Record:
    choice: str  # the candidate kept
    fallback: str | None = None  # the one a kept frozen graph gives up to (tune.Choice.fallback)
    candidates: dict[str, float] = field(default_factory=dict)  # ms per candidate, when it was tuned


def directory() -> Path | None:
    """Where records are kept, or None when caches are off."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if torch.compiler.config.force_disable_caches:
        return None
    return _absolute(os.environ.get("KWKER_CACHE_DIR") or os.path.join(cache_dir(), "kwker"))


@functools.cache
def _absolute(folder: str) -> Path:
    """A relative folder is taken from the working directory where it is first
    used, as Inductor takes its own at start: after an os.chdir the records
    would otherwise be written and looked for in another folder."""
    return Path(folder).absolute()


def key(kind: str, gm: torch.fx.GraphModule, example_inputs, opts: KwkerOptions) -> str:
    from torch._inductor import config as inductor_config

    digest = hashlib.sha256()
    for part in (kind, _graphs(gm), repr(opts), repr(sorted(inductor_config.save_config_portable().items())),
                 _modes(), _machine(), torch.__version__, _kwker_code()):
        digest.update(part.encode() + b"\0")
    # which inputs share a storage: such inputs cannot become a plan
    for x, first in zip(example_inputs, first_over_storage(example_inputs)):
        digest.update(f"{_describe(x)}:{first}".encode() + b"\0")
    return digest.hexdigest()


MAX_RECORD_BYTES = 1 << 16  # a record is a choice and a few candidates' times: under 1 KiB


def recall(key_: str) -> Record | None:
    """The record under key_, or None (caches off, none, or one that cannot be read: logged)."""
    folder = directory()
    if folder is None:
        return None
    path = folder / f"{key_}.json"
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block the read forever, /dev/zero fill the memory
            raise ValueError("not a regular file")
        with path.open("rb") as f:
            text = f.read(MAX_RECORD_BYTES + 1)  # bounded: the file may grow after the stat
        if len(text) > MAX_RECORD_BYTES:
            raise ValueError(f"over {MAX_RECORD_BYTES} bytes, which no record is")
        return _checked(Record(**json.loads(text)))
    except (FileNotFoundError, NotADirectoryError):  # the latter: the folder is a file, which remember() names
        return None
    except (OSError, ValueError, TypeError, RecursionError, OverflowError) as e:  # Recursion: JSON nested too deep
        log.warning("kwker: the tuning choice in %s cannot be read (%s: %s); the graph is tuned again",
                    path, type(e).__name__, e)
        return None


def _checked(record: Record) -> Record:
    """record, when each field has its type and a sense (kwker.report() prints
    them: a name holding a newline or a terminal's escape would print a row of
    its own, a time NaN or inf)."""
    times = record.candidates
    if not (isinstance(record.choice, str) and isinstance(record.fallback, (str, type(None)))
            and isinstance(times, dict)
            and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in times.values())):
        raise ValueError(f"fields of the wrong types: {record!r:.200}")
    names = [record.choice, *([record.fallback] if record.fallback is not None else []), *times]
    if not all(isinstance(n, str) and n.isidentifier() for n in names) \
            or not all(math.isfinite(t) and t >= 0 for t in times.values()):  # float(10**400): OverflowError
        raise ValueError(f"a candidate that is no name, or a time that is no duration: {record!r:.200}")
    return record


def remember(key_: str, record: Record) -> None:
    """Written whole or not at all (a temporary file renamed over): another
    process reading it meanwhile sees the old record or the new one. Its mode
    is the umask's, as Inductor's cache files' (a NamedTemporaryFile's 0600
    left the record unreadable to the other users of a shared folder)."""
    folder = directory()
    if folder is None:
        return
    written = None
    try:
        if folder.exists() and not folder.is_dir():  # mkdir's own error says "File exists"
            raise NotADirectoryError(f"{folder} is a file, not a folder")
        folder.mkdir(parents=True, exist_ok=True)
        written = folder / f".{key_}.{os.getpid()}.{threading.get_ident()}.tmp"  # this thread's alone
        with os.fdopen(os.open(written, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666), "w") as f:
            json.dump(asdict(record), f)
        os.replace(written, folder / f"{key_}.json")
    except OSError as e:  # a read-only or full disk: the choice is simply not remembered
        log.warning("kwker: the tuning choice could not be written to %s (%s)", folder, e)
        if written is not None:
            with contextlib.suppress(OSError):  # on a read-only disk the unlink fails too
                Path(written).unlink(missing_ok=True)


def _graphs(gm: torch.fx.GraphModule) -> str:
    """The code of gm and of every graph inside it, with what each get_attr reads."""
    parts = []
    for name, module in gm.named_modules():
        if isinstance(module, torch.fx.GraphModule):
            parts.append(f"{name}:{module.code}")
            parts += [f"{n.target}:{_describe(_attribute(module, n.target))}" for n in module.graph.nodes
                      if n.op == "get_attr"]
    return "\n".join(parts)


def _attribute(module: torch.nn.Module, target: str):
    try:
        return functools.reduce(getattr, target.split("."), module)
    except AttributeError:
        return None


def _modes() -> str:
    # the default dtype: factory ops without one (torch.arange(n)) make it, which a graph's code does not show
    return (f"grad {torch.is_grad_enabled()}, inference {torch.is_inference_mode_enabled()}, "
            f"default dtype {torch.get_default_dtype()}, "
            f"autocast {torch.is_autocast_enabled('cpu')} {torch.get_autocast_dtype('cpu')}, "
            f"float32 precision {sorted(fp32_precision_settings().items())}")


def _describe(x) -> str:
    if isinstance(x, torch.nn.Module):  # a graph inside, whose code _graphs holds
        return type(x).__name__
    if not isinstance(x, torch.Tensor):
        return f"{type(x).__name__}:{x!r}"
    parameter = isinstance(x, torch.nn.Parameter)
    bf16_valued = parameter and x.dtype == torch.float32 and is_bf16_valued(x)
    return (f"{type(x).__name__}:{x.dtype}:{tuple(x.shape)}:{x.stride()}:{x.storage_offset()}:"
            f"{x.requires_grad}:{x.device}:{bf16_valued}")


def _machine() -> str:
    return (f"{_cpu_model()}|{torch.get_num_threads()}|{len(os.sched_getaffinity(0))}|"
            f"{os.environ.get('LD_PRELOAD', '')}|{os.environ.get('GOMP_SPINCOUNT', '')}")


@functools.cache
def _cpu_model() -> str:
    from kwker import _C

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{model}|{_C.cpu_isa()}"


@functools.cache
def _kwker_code() -> str:
    """A hash of kwker's own code, its Python files and its built extension: a
    choice made by other code is not reused, released or not. A hidden file is
    none of its modules (Emacs's lock `.#choices.py`, a link to nowhere, made
    every compile fail), and a file gone by the time it is read (a checkout
    under way) is hashed as gone."""
    from kwker import _C

    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")) + [Path(_C.__file__)]:
        if path.name.startswith("."):
            continue
        try:
            content = path.read_bytes()
        except OSError as e:
            content = f"unreadable: {type(e).__name__}".encode()
        digest.update(path.as_posix().encode() + b"\0" + content)
    return digest.hexdigest()
