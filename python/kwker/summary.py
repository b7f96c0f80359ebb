"""What kwker compiled in this process, which ``kwker.report()`` prints: each
graph with its kind, the fallback ops in its plan and its compile seconds."""

import weakref
from dataclasses import dataclass, field


@dataclass
class GraphReport:
    index: int
    kind: str  # "decode-replay", "eager", "inductor", "inductor-unchanged"
    nodes: int
    seconds: float
    reason: str
    rewrites: dict[str, int] = field(default_factory=dict)
    fallback_ops: list[str] = field(default_factory=list)
    copies: int = 0  # weight copies kwker made and keeps fresh (kwker.weights)
    why: str = ""
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


def record(**fields) -> GraphReport:
    entry = GraphReport(index=len(_graphs), **fields)
    _graphs.append(entry)
    return entry


def graphs() -> list[GraphReport]:
    return list(_graphs)


def format_report() -> str:
    lines = [f"{'graph':>5}  {'kind':<18} {'nodes':>5} {'compile s':>9}  fallback ops / why"]
    for g in _graphs:
        extra = ", ".join(g.fallback_ops) if g.fallback_ops else g.why
        lines.append(f"{g.index:>5}  {g.kind:<18} {g.nodes:>5} {g.seconds:>9.2f}  {extra}")
    return "\n".join(lines)


def clear() -> None:
    _graphs.clear()
