"""What a schedule plans: its per-rank action table, played with unit costs (ideal bubbles).

``plan`` plays PyTorch's own per-rank table with ``COSTS`` (messages free, stages equal), each
action as soon as its rank is free and its inputs exist. Ideal bubble = 1 - busy / makespan:
(p - 1) / (m + p - 1) for GPipe and 1F1B.
"""
from __future__ import annotations

from dataclasses import dataclass

# Private in torch 2.14.1 (pinned: re-check on upgrade): it returns PyTorch's own table
# (``pipeline_order``), which we would otherwise have to re-derive per schedule.
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from distkit.schedules import SCHEDULES, num_stages_for, stage_indices_for
from stagetrace import Span

# in units of one stage's forward of one micro-batch; I: input gradients, W: weight gradients
COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
# A planned action's span kind: I (input gradients only) is a backward, as stagetrace records it
KIND = {"F": "F", "B": "B", "I": "B", "W": "W"}


def action_table(schedule: str, world_size: int, n_microbatches: int
                 ) -> list[list[tuple[str, int, int]]]:
    """Each rank's actions, (type, stage, micro-batch): PyTorch's table, DualPipeV's F+B pairs split."""
    ops = get_schedule_ops(SCHEDULES[schedule], world_size, n_microbatches)
    table = []
    for rank_ops in ops:
        actions = []
        for a in rank_ops:
            for sub in (a.sub_actions or (a,)) if a is not None else ():
                kind = sub.computation_type.value
                if kind in COSTS:  # not REDUCE_GRAD, UNSHARD, ...
                    actions.append((kind, sub.stage_index, sub.microbatch_index))
        table.append(actions)
    if schedule == "1F1B" and _table_problem(table, schedule, world_size, n_microbatches):
        # torch 2.14.1's 1F1B table is off by one (its last rank has no F0); what runs,
        # _step_microbatches, ignores it: min(m, p - s) warm-up forwards, then B, F alternately
        table = [_one_f_one_b(rank, world_size, n_microbatches) for rank in range(world_size)]
    problem = _table_problem(table, schedule, world_size, n_microbatches)
    if problem:
        raise ValueError(f"PyTorch's {schedule} table on {world_size} ranks, m = "
                         f"{n_microbatches}: {problem}")
    return table


def _one_f_one_b(stage: int, num_stages: int, m: int) -> list[tuple[str, int, int]]:
    warmup = min(m, num_stages - stage)
    actions = [("F", stage, i) for i in range(warmup)]
    for i in range(m):
        actions.append(("B", stage, i))
        if warmup + i < m:
            actions.append(("F", stage, warmup + i))
    return actions


def _table_problem(table: list[list[tuple[str, int, int]]], schedule: str, world_size: int,
                   m: int) -> str | None:
    """Why ``table`` is not one F and one backward (B, or I and W) per stage and micro-batch."""
    for rank, actions in enumerate(table):
        for stage in stage_indices_for(schedule, rank, world_size):
            for i in range(m):
                kinds = sorted(k for k, s, mb in actions if (s, mb) == (stage, i))
                if kinds not in (["B", "F"], ["F", "I", "W"]):
                    return f"rank {rank} has {kinds or 'nothing'} for stage {stage}, micro-batch {i}"
        if len(actions) != len(set(actions)):
            return f"rank {rank} repeats an action"
    return None


@dataclass
class Plan:
    """A schedule's table played with unit costs: spans in cost units, per rank."""

    world_size: int
    spans: list[Span]
    makespan: float

    @property
    def idle(self) -> list[float]:
        """Each rank's ideal idle fraction of the makespan (its ideal bubble)."""
        return [1 - sum(s.end - s.start for s in self.spans if s.rank == r) / self.makespan
                for r in range(self.world_size)]

    @property
    def bubble(self) -> float:
        """The mean over ranks: what the benchmark's measured bubble is compared with."""
        return sum(self.idle) / self.world_size


def plan(schedule: str, world_size: int, n_microbatches: int) -> Plan:
    """Play ``schedule``'s own action table with ``COSTS`` (see the module docstring)."""
    table = action_table(schedule, world_size, n_microbatches)
    last = num_stages_for(schedule, world_size) - 1
    done: dict[tuple[str, int, int], float] = {}  # (type, stage, mb) -> end time
    free = [0.0] * world_size
    heads = [0] * world_size
    spans: list[Span] = []

    def ready(kind: str, stage: int, mb: int) -> float | None:
        if kind == "F":
            deps = [("F", stage - 1, mb)] if stage > 0 else []
        elif kind in ("B", "I"):
            deps = [("F", stage, mb)] if stage == last else [("B", stage + 1, mb), ("I", stage + 1, mb)]
            deps = [d for d in deps if d in done] or deps[:1]  # B or I of the next stage
        else:  # W
            deps = [("I", stage, mb)]
        if any(d not in done for d in deps):
            return None
        return max((done[d] for d in deps), default=0.0)

    while any(h < len(t) for h, t in zip(heads, table)):
        progress = False
        for rank, actions in enumerate(table):
            while heads[rank] < len(actions):
                kind, stage, mb = actions[heads[rank]]
                t = ready(kind, stage, mb)
                if t is None:
                    break
                start = max(free[rank], t)
                free[rank] = done[kind, stage, mb] = start + COSTS[kind]
                spans.append(Span(rank, KIND[kind], start, free[rank], stage, mb))
                heads[rank] += 1
                progress = True
        if not progress:
            stuck = {r: t[h] for r, (h, t) in enumerate(zip(heads, table)) if h < len(t)}
            raise RuntimeError(f"{schedule}'s table deadlocks: next actions {stuck}")
    return Plan(world_size, spans, max(free))
