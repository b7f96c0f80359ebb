"""How a replayed plan stores the weights its linears read, decided once per
linear (or per mixture of experts' weights), and how its copies are kept equal
to the model's weights.

A weight is read as stored (the model's own tensor, bound on every call) when
it lives in memory other processes share (their writes are never seen, see
shared_with_other_processes), when its copy would not fit in what is left
of the memory for copies (WeightArena.admit), when its linear has rows enough for oneDNN's
matmul to be faster (DNNL_MIN_ROWS: the product is then compute-bound, and
oneDNN has no float32 × bfloat16 matmul), and otherwise unless a copy reads
fewer bytes or fewer calls:
- a float32 weight whose every value is exactly a bfloat16 value (a bf16
  checkpoint loaded in float32) gets a bfloat16 copy: exact, half the bytes;
- linears that read the same input (q/k/v, gate/up) get one copy of their
  weights stacked by rows, and of their biases, and run as one call;
- a copy whose inner size K suits it is stored K-blocked, [K/B, N, B]
  (kw_ops.h says why);
- a [K, N] weight (GPT-2's Conv1D, multiplied as stored: x @ W) is copied as
  its transpose, the [N, K] rows kwker's kernels read; for oneDNN's matmul too,
  which reads a [K, N] float32 weight at 2.3x the time of [N, K] rows
  (Debian's oneDNN 2.6, brgemm on AVX-512, [1024, 768] x [768, 3072] on the
  Intel VM: 31 ms against 12.3).

A copy must never be read stale. Every source of a copy is watched
(kwker._C.Watch: its pages are made read-only and the first write re-opens them
and is recorded; the partial pages at its ends are compared), because a
version counter misses `param.data.mul_(2)` and `param.data = other`. Before
each call the plan checks its sources (the same memory, the same layout, not
written) and asks `CopiedWeights.refresh` to pack again what changed, or, when a
copy can no longer be made the same way (a weight that is no longer
bf16-valued), to have the plan rebuilt.

This module is the only place that decides, makes, lays out or refreshes a
copy. The one change kwker makes to a model's own tensors is elsewhere:
lower.py asks the kernel to back weights read as stored with huge pages, in
place (contents unchanged).
"""

import fractions
import functools
import logging
import math
import os
import re
import warnings
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kwker import _C
from kwker.threads import ForkSafeLock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Storage:
    """How one linear's weight, or a group's stacked, is stored: a copy of this
    dtype, K-blocked by `block` (0: as [N, K]); `kn`: the sources are [K, N],
    and the copy holds their transpose."""

    dtype: torch.dtype
    block: int
    kn: bool = False


def is_bf16_valued(w: torch.Tensor) -> bool:
    return w.dtype == torch.float32 and w.device.type == "cpu" and _C.bf16_exact(w.detach().contiguous())


def copy_dtype(weights: list[torch.Tensor]) -> torch.dtype:
    """bfloat16 when every weight is bf16 or exactly bf16-valued, else as stored."""
    to_bf16 = all(w.dtype == torch.bfloat16 or is_bf16_valued(w) for w in weights)
    return torch.bfloat16 if to_bf16 else weights[0].dtype


# From these rows per call (kw_ops.h's KW_DNNL_MIN_M_*), by the input's dtype,
# oneDNN's matmul measured faster than kwker's linear; for float32 weights
# kwker would read as a bfloat16 copy, from DNNL_MIN_ROWS_OVER_BF16_COPY.
# DNNL_NEVER where it never did (bf16 products on an AMX CPU) or cannot (bf16
# below AVX-512, where oneDNN makes no bf16 matmul).
_P = _C.op_params()
DNNL_NEVER = _P["DNNL_NEVER"]
DNNL_MIN_ROWS = {torch.float32: _P["DNNL_MIN_M_F32"], torch.bfloat16: _P["DNNL_MIN_M_BF16"]}
DNNL_MIN_ROWS_OVER_BF16_COPY = _P["DNNL_MIN_M_F32_BF16_COPY"]


def rows_per_call(x: torch.Tensor) -> int:
    """The rows a linear of input x multiplies: every dimension but the last."""
    return math.prod(x.shape[:-1])


# A model's own weight that a linear of fewer rows than this reads as stored is
# moved onto 2 MiB pages at the plan's build (kwker._C.prefer_huge_pages): there
# the kernels stream it, and through 4 KiB pages it read 20 % slower at 60 GB/s
# (Zen 5 VM); on the Intel VM (28 GB/s) [3072, 768] weights read 5-13 % slower
# in fp32 and 2-8 % in bf16 at 1-16 rows, within 3 % at 64 rows and the same from
# 256. The move copies at about 0.55 GB/s: ViT-base's 73 weights in fp32 took
# 0.5 s of its plan's build at batch 8 (1576 rows), where nothing is streamed.
HUGE_PAGES_BELOW_ROWS = 64


def by_matmul(dtype: torch.dtype, rows: int) -> bool:
    """Whether a linear of these rows over an input and weight of this dtype is oneDNN's."""
    return rows >= DNNL_MIN_ROWS.get(dtype, rows + 1)


def shared_with_other_processes(tensors: list[torch.Tensor]) -> bool:
    """Whether one of these tensors lives in memory other processes map too:
    `share_memory()` and torch.multiprocessing's tensors (Tensor.is_shared),
    and any other in a writable shared mapping of this process (a
    multiprocessing.shared_memory block or a file mapped MAP_SHARED, read
    through torch.frombuffer or numpy, which is_shared calls False). A watch
    sees the writes of this process only (the pages are read-only in its own
    mapping), so a copy of it would be read stale after another process's
    write. Such a weight is always read as stored. A read-only or private
    mapping of a file (safetensors' mmap of a checkpoint, torch.load(mmap=True))
    is not counted: nothing of this process writes through it, and its weights
    would lose their copies; a write to the file itself while it is mapped
    (pwrite, another process's shared mapping) is not seen, and the copy is
    read stale (README: replace a checkpoint by renaming a new file over it)."""
    if any(t.is_shared() for t in tensors):
        return True
    spans = _writable_shared_mappings()
    for t in tensors:
        storage = t.untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        if any(lo < end and start < hi for lo, hi in spans):
            return True
    return False


def _writable_shared_mappings() -> list[tuple[int, int]]:
    """The address ranges this process maps writable and shared (/proc/self/maps'
    "rw?s"); none where it cannot be read."""
    try:
        with open("/proc/self/maps", "rb") as f:  # bytes: a mapped file's name need not be UTF-8
            maps = f.read()
    except OSError:
        return []
    return [(int(lo, 16), int(hi, 16)) for lo, hi in _WRITABLE_SHARED.findall(maps)]


_WRITABLE_SHARED = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) rw.s", re.MULTILINE)


def decide(weights: list[torch.Tensor], rows: int, kn: bool = False) -> Storage | None:
    """The storage for the weights of linears that share an input (one weight
    when none does) of `rows` rows per call, or None: each read as stored.
    kn: the weights are [K, N], multiplied as stored."""
    if shared_with_other_processes(weights):
        return None
    dtype = copy_dtype(weights)
    as_stored = dtype == weights[0].dtype
    if by_matmul(dtype, rows) if as_stored else rows >= DNNL_MIN_ROWS_OVER_BF16_COPY:
        # oneDNN's, as stored; a single [K, N] weight as its transpose (a group would be linear_multi's)
        return Storage(weights[0].dtype, 0, True) if kn and len(weights) == 1 else None
    if len(weights) == 1 and as_stored and not kn:
        return None
    k = weights[0].shape[0 if kn else 1]
    return Storage(dtype, _C.linear_block(k) if weights[0].dim() == 2 else 0, kn)


def decide_experts(weights: torch.Tensor) -> Storage | None:
    """The storage of a mixture of experts' weights [E, N, K] (grouped_linear's):
    a bf16 copy when they are bf16-valued float32, else None (read as stored).
    Never K-blocked, and never oneDNN's: it has no grouped matmul."""
    if shared_with_other_processes([weights]) or not is_bf16_valued(weights):
        return None
    return Storage(torch.bfloat16, 0)


def convolution_storage(weight: torch.Tensor) -> Storage | None:
    """A float32 copy of a bfloat16 convolution's weight where PyTorch's oneDNN
    has no bfloat16 convolution for this CPU (below AVX-512), so that the
    convolution runs in float32 between its input's exact widening and its
    output's one rounding, the arithmetic oneDNN's bf16 convolution does (f32
    accumulation); else None, as stored. On a Zen 3 EPYC (AVX2, 2 threads)
    PyTorch's bf16 convolutions took 8-70x its f32 ones: a 3 x 3 of 64 channels
    over 56 x 56, NCHW, 97 ms against 2.3, channels-last 12.7 against 1.3."""
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported() \
            and not shared_with_other_processes([weight]):
        return Storage(torch.float32, 0)
    return None


def group_copies(weights: list, biases: list, storage: Storage, dtype_of=lambda t: t.dtype) -> list[tuple[list, Storage]]:
    """The copies a group of linears reads, its weights in storage (decide's),
    (sources, storage) each: its weights, and its biases where it has several,
    stacked, as stored. weights, biases: tensors, or the graph's nodes of them
    (dtype_of says a bias's dtype)."""
    read = [(weights, storage)]
    if biases and len(weights) > 1:
        read.append((biases, Storage(dtype_of(biases[0]), 0)))
    return read


def copy_nbytes(sources: list[torch.Tensor], storage: Storage | None) -> int:
    """The memory one copy of the sources in this storage takes from a
    WeightArena, its alignment included (0: no sources, or None: no copy)."""
    return sum(s.numel() for s in sources) * storage.dtype.itemsize + 64 if sources and storage else 0


# ---- memory ------------------------------------------------------------------------------


def weight_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """Memory for a weight kwker streams: kw_mem's, on 2 MiB pages where the
    kernel gives them (PyTorch's allocations get 4 KiB pages unless THP is
    "always"), zeroed."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(_C.weight_memory(nbytes), dtype=dtype).view(shape)


class WeightArena:
    """The memory of the weights kwker copies for one graph, reserved before the
    graph is traced to ATen and faulted in meanwhile by a thread of _C's: fresh
    memory faulted in at 0.5-1 GB/s on the VMs measured, about 1.5 s of a first
    compile for SmolLM2-360M's 724 MB of copies, now on the otherwise idle
    core. Copies are cut from it in order; close() returns the unused tail.

    The copies take at most the memory left for them (memory_for_copies, read
    at the first copy reserved or admitted): the rewrites ask admit() for each group's copies,
    in the graph's order, and read the weights of the groups refused as stored.
    A model that nearly fills the memory keeps the copies of its first layers,
    not none: a refused bf16 copy of a bf16-valued float32 weight reads twice
    its bytes at every token.

    family: the CallLock of the plan the copies are for. Given (a plan rebuilt
    keeps its own), only copies of that family are shared; else that of the
    first copy it shares with other plans (_shared), or a new one at its first
    copy. shares=False: the plan shares no copy, and no other plan shares its
    copies. That is the tuner's plan (kwker.dynamo_backend): the tuner calls it
    inside Dynamo's compile lock, and a plan compiled again inside its call
    holds its CallLock while it waits for that compile lock, so the tuner's
    plan must hold a lock no other plan can hold."""

    def __init__(self, planned: list[tuple[list[torch.Tensor], Storage]], family=None, shares: bool = True):
        """planned: the copies the rewrites will ask for, (sources, storage)
        each (kwker.rewrite.planned_copies); the memory of those this plan
        would make, not share, is reserved."""
        self.family, self.shares = family, shares
        self.admitted: set = set()  # the keys (_shared_key) of the copies admitted
        self.handed: set = set()  # the keys of the copies make_copy gave this plan
        self.taken = self.refused = 0  # bytes of copies admitted, and refused
        nbytes = sum(self._to_make(planned)[0].values())
        nbytes = min(nbytes, self.budget) if nbytes else 0
        self.memory = _C.weight_reserve(nbytes) if nbytes else None
        self.capacity, self.used = nbytes, 0
        self._scratch = torch.empty(0)

    @functools.cached_property
    def budget(self) -> int:
        """memory_for_copies, read when a copy is first reserved or admitted:
        a plan that copies nothing (a graph without weights, each new size of
        a model's steps that shares its copies) reads no file for it. Notes
        where it came from, for close()'s warning."""
        self.budget_setting = copy_memory_setting()
        return max(memory_for_copies(), 0)

    def admit(self, copies: list[tuple[list[str], Storage]], params: dict[str, torch.Tensor]) -> bool:
        """Whether a group's copies ((source names, storage) each, all or none)
        fit in what is left of the budget; they are counted when they do. A
        copy of the same sources made the same way counts once (a weight that
        two calls read), and one that other plans read and this one can share
        (shared) not at all. A shared copy whose sources were written since is
        made again (make_copy), so it counts."""
        new, family = self._to_make([([params[n] for n in names], storage) for names, storage in copies])
        nbytes = sum(new.values())
        if nbytes and self.taken + nbytes > self.budget:
            self.refused += nbytes
            return False
        self.admitted.update(new)
        self.taken += nbytes
        self.family = family  # what make_copy then shares, admitted with the group
        return True

    def _to_make(self, copies: list[tuple[list[torch.Tensor], Storage]]) -> tuple[dict[tuple, int], object]:
        """Of these copies, those this plan would make, by key (_shared_key)
        with their bytes: neither admitted before nor to be shared; and the
        family of those to be shared."""
        new, family = {}, self.family
        for tensors, storage in copies:
            key = _shared_key(tensors, storage)
            same = self._shareable(key, tensors, family)
            if same is not None:
                family = same.family
            elif key not in self.admitted:
                new[key] = copy_nbytes(tensors, storage)
        return new, family

    def shared(self, key: tuple, tensors: list[torch.Tensor]) -> "CopiedWeight | None":
        """The copy other plans read of these sources made this way, where its
        sources are unchanged since and it is of this plan's family (the first
        found decides it)."""
        same = self._shareable(key, tensors, self.family)
        if same is not None:
            self.family = same.family
        return same

    def _shareable(self, key: tuple, tensors: list[torch.Tensor], family) -> "CopiedWeight | None":
        same = _fresh_shared(key, tensors) if self.shares else None
        return same if same is not None and (family is None or same.family is family) else None

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        count = math.prod(shape)
        start = -(-self.used // 64) * 64
        end = start + count * dtype.itemsize
        if self.memory is None or count == 0 or end > self.capacity:
            return weight_empty(shape, dtype)
        self.used = end
        return torch.frombuffer(self.memory, dtype=dtype, count=count, offset=start).view(shape)

    def scratch(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """One buffer for every K-blocking to go through (fresh memory faults in slowly)."""
        if self._scratch.numel() < count or self._scratch.dtype != dtype:
            self._scratch = torch.empty(count, dtype=dtype)
        return self._scratch[:count]

    def close(self) -> None:
        if self.memory is not None:
            self.memory.trim(self.used)
        self._scratch = torch.empty(0)
        if self.refused:
            global _warned_memory
            left = "KWKER_COPY_MEMORY less the copies made before" if self.budget_setting is not None else \
                "what is available less what the process may still need; KWKER_COPY_MEMORY sets it"
            quiet = _warned_memory or self.budget_setting == 0  # KWKER_COPY_MEMORY=0: none asked for
            (log.info if quiet else log.warning)(
                "kwker: %s of the graph's weight copies would not fit in the memory left for them (%s: %s); %s were "
                "made, and the weights of the rest are read as stored", size(self.refused), size(self.budget), left,
                size(self.taken))
            _warned_memory = _warned_memory or not quiet


_warned_memory = False  # the first graph whose copies did not all fit is warned about, the others logged


def size(nbytes: int) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def memory_for_copies() -> int:
    """The bytes kwker's weight copies may take now: KWKER_COPY_MEMORY's, less
    the copies alive (copy_memory_setting); where it is not set, the memory available to this
    process (Linux's MemAvailable, or its memory cgroup's limit less its use
    where that is less: a container's) less what the rest of the process may
    still need (Inductor's compile, activations, a cache): an eighth of its
    memory, at least 2 GiB and at most 8. A bf16 model's stacked q/k/v and gate/up copies
    are about 65 % of its linear weights: Llama-3-8B's 16 GB would take about
    9 more (by its shapes), past a 24 GB machine's memory, and the kernel's
    OOM killer would end the process. Unbounded where nothing says."""
    setting = copy_memory_setting()
    if setting is not None:
        with _alive_lock:  # a WeakSet changed by another thread's plan meanwhile raises in the sum
            return setting - sum(c.copy.nbytes for c in _alive)
    total, available = 1 << 62, 1 << 62
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:]}
        total, available = info["MemTotal"], info["MemAvailable"]
    except (OSError, KeyError, ValueError, IndexError):
        pass
    for limit, used in _cgroup_memory():
        total, available = min(total, limit), min(available, limit - used)
    return available - min(max(2 << 30, total // 8), 8 << 30)


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_warned_setting: set = set()


def copy_memory_setting() -> int | None:
    """KWKER_COPY_MEMORY: the most memory kwker's weight copies may take in
    this process, in bytes or with a unit (K, M, G, T of 1024, with or without
    iB or B; `3G`, `1.5GiB`), `0` for none. It is taken as given, in place of
    the estimate of the memory left: a user who knows better may allow more
    copies (each halves the bytes a bf16-valued float32 weight reads at every
    token) or fewer. None where it is unset, or not understood (warned once)."""
    value = os.environ.get("KWKER_COPY_MEMORY")
    if not value:  # unset or empty, as KWKER_CACHE_DIR
        return None
    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgt]?)(?:i?b)?\s*", value, re.IGNORECASE | re.ASCII)
    if found and (found[2] or "." not in found[1]):  # exact, however many digits (a float overflowed)
        return int(fractions.Fraction(found[1]) * _UNITS[found[2].lower()])
    if value not in _warned_setting:
        _warned_setting.add(value)
        warnings.warn(f"kwker: KWKER_COPY_MEMORY={value!r} is not a size (bytes, or a number with K, M, G or T: "
                      "'3G', '1.5GiB', '0'); the memory left is estimated instead", UserWarning, stacklevel=2)
    return None


def _cgroup_memory(cgroups: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> list[tuple[int, int]]:
    """(limit, bytes in use less inactive file pages, which the kernel reclaims
    first) of this process's memory cgroup and each above it that has a limit,
    cgroup v2's or v1's."""
    found = []
    try:
        with open(cgroups, errors="surrogateescape") as f:  # a cgroup's name need not be UTF-8
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return found
    for _, controllers, path in (line for line in lines if len(line) == 3):
        if controllers == "":  # v2
            top, files = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            top, files = f"{root}/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            folder = "/".join([top, *parts[:depth]])
            try:
                with open(f"{folder}/{files[0]}") as f:
                    limit = f.read().strip()
                if limit == "max" or int(limit) >= 1 << 60:
                    continue
                with open(f"{folder}/{files[1]}") as f:
                    used = int(f.read())
            except (OSError, ValueError):
                continue
            try:
                with open(f"{folder}/memory.stat") as f:
                    used -= int(dict(line.split() for line in f if len(line.split()) == 2).get(files[2], 0))
            except (OSError, ValueError):
                pass  # no reclaimable pages counted
            found.append((int(limit), used))
    return found


# ---- copies ------------------------------------------------------------------------------


def copy_shape(sources: list[torch.Tensor], storage: Storage) -> tuple[int, ...]:
    sources = _as_rows(sources, storage)
    rows = sum(s.shape[0] for s in sources)
    if storage.block:
        k = sources[0].shape[1]
        return (k // storage.block, rows, storage.block)
    return (rows, *sources[0].shape[1:])


def _as_rows(sources: list[torch.Tensor], storage: Storage) -> list[torch.Tensor]:
    """The sources as [N, K] rows: transposed views of [K, N] ones."""
    return [s.t() for s in sources] if storage.kn else sources


def fill_copy(copy: torch.Tensor, sources: list[torch.Tensor], storage: Storage, scratch: torch.Tensor | None = None):
    """Writes the sources, stacked by rows and converted, into copy (in its
    layout). scratch: copy.numel() elements of its dtype to go through when
    K-blocked."""
    sources = _as_rows(sources, storage)
    if not storage.block:
        row = 0
        for s in sources:
            copy[row:row + s.shape[0]].copy_(s.detach())
            row += s.shape[0]
        return
    kb, n, b = copy.shape
    flat = scratch if scratch is not None else torch.empty(copy.numel(), dtype=copy.dtype)
    stacked = flat.view(n, kb * b)
    row = 0
    for s in sources:
        stacked[row:row + s.shape[0]].copy_(s.detach())
        row += s.shape[0]
    copy.copy_(stacked.view(n, kb, b).transpose(0, 1))


@dataclass(eq=False)
class CopiedWeight:
    """A copy kwker made of one weight, or of a group's weights or biases
    stacked; plans of several graphs may read it (_shared)."""

    storage: Storage
    copy: torch.Tensor
    family: object  # the CallLock of the plans that read it
    watches: list = field(default_factory=list)  # a kwker._C.Watch per source

    def refresh(self, tensors: list[torch.Tensor]) -> bool:
        """Packs the copy again from tensors (the sources' current values, of
        the dtypes and shapes watched: plan._Refresh checks), watching them
        afresh first; False when it cannot be made the same way (no longer
        bf16-valued) or must not be made at all (a source moved into memory
        other processes share: share_memory() after the plan was made): the
        plan is rebuilt then, and decides again. Where the packing fails on the
        way (an interrupt, no memory), the watches report changed until the next
        refresh: rearmed, they would have passed the half-made copy as fresh."""
        if self.storage.dtype != copy_dtype(tensors) and self.storage.dtype == torch.bfloat16:
            return False
        # moved: param.data = other, or its storage freed and allocated again
        moved = [w.moved(t) for w, t in zip(self.watches, tensors)]
        if any(moved) and shared_with_other_processes([t for m, t in zip(moved, tensors) if m]):
            return False
        was = _shared_key([w.tensor for w in self.watches], self.storage) if any(moved) else None
        try:
            for i, t in enumerate(tensors):
                if moved[i]:  # the old watch reports changed to the plans that still check it: they look again
                    self.watches[i].invalidate()
                    self.watches[i] = _C.Watch(t)
                else:
                    self.watches[i].rearm()  # the same memory, written: watch afresh, then copy
            fill_copy(self.copy, tensors, self.storage)
        except BaseException:
            for w in self.watches:
                w.invalidate()
            raise
        if was is not None and _shared.get(was) is self:  # shared under the memory it read: now under what it reads
            del _shared[was]
            now = _shared_key(tensors, self.storage)
            if _fresh_shared(now, tensors) is None:
                _shared[now] = self
        return True


class PlanCopy(NamedTuple):
    """A copy as one plan reads it: the graph inputs it is made from (by this
    graph's names, stacked in this order) and the copy."""

    sources: list[str]
    weight: CopiedWeight


class CopiedWeights:
    """The copies one plan reads, and their sources' watches by argument index."""

    def __init__(self, copies: list[PlanCopy], arg_index: dict[str, int]):
        self.copies = copies
        self.arg_index = arg_index

    def watched(self) -> list[tuple[int, object]]:
        """(argument index, Watch) for every source: what the plan checks (kwker._C.Plan.watch)."""
        return [(self.arg_index[name], w) for c in self.copies for name, w in zip(c.sources, c.weight.watches)]

    def refresh(self, args) -> bool:
        """Brings every copy whose sources changed up to date; False when one
        cannot be (the plan must be rebuilt). Watches may be replaced: read
        watched() again."""
        for c in self.copies:
            tensors = [args[self.arg_index[name]] for name in c.sources]
            if all(w.matches(t) for w, t in zip(c.weight.watches, tensors)):
                continue
            if not c.weight.refresh(tensors):
                return False
        return True


# The copies plans read, by their sources' memory and layout and their storage,
# while one reads them: the graphs Dynamo makes of one model (a static
# decode step and the dynamic one compiled after it, the chunks of a chunked
# prefill, a plan per size of decode.StepPerSizes) read one copy of each weight,
# not one each (before, SmolLM2-360M's 724 MB of bf16 copies were made again by
# the second generate() of another length). The plans that share copies hold one
# CallLock: whichever first sees a source written packs the copy again, in place,
# and the others must not replay it meanwhile.
_shared: "weakref.WeakValueDictionary[tuple, CopiedWeight]" = weakref.WeakValueDictionary()
_alive: "weakref.WeakSet[CopiedWeight]" = weakref.WeakSet()  # every copy a plan reads: KWKER_COPY_MEMORY's use
_alive_lock = ForkSafeLock()


def _shared_key(tensors: list[torch.Tensor], storage: Storage) -> tuple:
    """A copy's sources by memory and layout: a source's watch keeps its memory
    alive (Watch.tensor), so no other tensor takes that address while a plan
    reads the copy."""
    return (storage, tuple((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in tensors))


def _fresh_shared(key: tuple, tensors: list[torch.Tensor]) -> CopiedWeight | None:
    same = _shared.get(key)
    return same if same is not None and all(w.matches(t) for w, t in zip(same.watches, tensors)) else None


def make_copy(tensors: list[torch.Tensor], storage: Storage, arena: WeightArena) -> CopiedWeight:
    """Watches the sources, then copies them: a write in between is seen. A
    copy other plans read of the same sources, made the same way and still
    fresh, is returned instead (WeightArena.shared), but for sources of
    other names in the same plan (two Parameters over one memory): one copy
    cannot follow both once one is moved (`a.data = other`), and the plan read
    the other's values for it. A copy made where admit() counted none (one
    admitted as shared that a thread wrote since, or that second copy) is
    counted then."""
    key = _shared_key(tensors, storage)
    again = key in arena.handed
    arena.handed.add(key)
    same = None if again else arena.shared(key, tensors)
    if same is not None:
        return same
    if again or key not in arena.admitted:
        arena.admitted.add(key)
        arena.taken += copy_nbytes(tensors, storage)
    watches = [_C.Watch(t) for t in tensors]
    copy = arena.empty(copy_shape(tensors, storage), storage.dtype)
    fill_copy(copy, tensors, storage, arena.scratch(copy.numel(), storage.dtype) if storage.block else None)
    if arena.family is None:
        arena.family = _C.CallLock()
    made = CopiedWeight(storage, copy, arena.family, watches)
    with _alive_lock:
        _alive.add(made)
    if arena.shares:
        _shared[key] = made
    return made
