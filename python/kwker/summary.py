"""What kwker compiled in this process, which ``kwker.report()`` prints: each
graph with its kind, the candidates timed and the one kept, the fallback ops in
its plan and its compile seconds. ``graphs()`` gives the same as records."""

import weakref
from collections import Counter
from dataclasses import dataclass, field

from kwker.threads import ForkSafeLock
from kwker.weights import size


@dataclass
class GraphReport:
    index: int
    kind: str  # "decode-replay", "tuned", "training" (tuned too), "eager", "inductor", "inductor-unchanged"
    nodes: int
    seconds: float
    reason: str
    rewrites: dict[str, int] = field(default_factory=dict)
    fallback_ops: list[str] = field(default_factory=list)
    copies: int = 0  # weight copies kwker made and keeps fresh (kwker.weights)
    copies_refused: int = 0  # bytes of weight copies not made: they would not fit in the memory left (WeightArena)
    why: str = ""
    candidates: dict[str, float] = field(default_factory=dict)  # a tuned graph's: ms per candidate timed
    choice: str = ""  # the candidate kept
    recalled: bool = False  # the choice remembered from an earlier tuning (kwker.choices), built alone
    left_out: dict[str, str] = field(default_factory=dict)  # candidates not timed, and why
    busy: str | None = None  # how busy other processes kept the machine while the candidates ran, if they did
    plan: object = None  # a replayed graph's plan, weakly: its last_call timings while it lives

    def __post_init__(self):
        self.why = self.why or self.reason
        if self.plan is not None:
            self.plan = weakref.ref(self.plan)

    @property
    def last_call(self) -> dict | None:
        """The plan's last call, phase by phase in µs (kwker._C.Plan.last_call)."""
        plan = self.plan() if self.plan is not None else None
        return plan.last_call if plan is not None else None


_graphs: list[GraphReport] = []
_lock = ForkSafeLock()  # two threads compiling at once: each graph its own index


def record(**fields) -> GraphReport:
    with _lock:
        entry = GraphReport(index=len(_graphs), **fields)
        _graphs.append(entry)
    return entry


def graphs() -> list[GraphReport]:
    return list(_graphs)


def format_report() -> str:
    kinds = [(f"{g.kind}: {g.choice}" if g.choice else g.kind) + (" (recalled)" if g.recalled else "") for g in _graphs]
    width = max([18, *map(len, kinds)])
    lines = [f"{'graph':>5}  {'kind':<{width}} {'nodes':>5} {'compile s':>9}  candidates / fallback ops / why"]
    for g, kind in zip(_graphs, kinds):
        if g.candidates:
            extra = ", ".join(f"{name} {ms:.3g} ms" for name, ms in g.candidates.items())
            extra += "".join(f"; {name} left out: {why}" for name, why in g.left_out.items())
            extra += f"; not remembered: {g.busy}" if g.busy else ""
        elif g.fallback_ops:
            extra = ", ".join(f"{op} ×{n}" if n > 1 else op for op, n in Counter(g.fallback_ops).items())
        else:
            extra = g.why
        if g.copies_refused:
            extra += f"; {size(g.copies_refused)} of weight copies not made: no memory left for them (KWKER_COPY_MEMORY)"
        lines.append(f"{g.index:>5}  {kind:<{width}} {g.nodes:>5} {g.seconds:>9.2f}  {extra}")
    return "\n".join(lines)


def clear() -> None:
    with _lock:
        _graphs.clear()
