"""Pipeline schedules as data: for each stage, the ordered actions it runs in one training step.

An action is (kind, micro-batch, chunk): kind "F" (forward) or "B" (backward)
of one micro-batch through one model chunk that the stage holds. With v
virtual stages per rank (the interleaved schedule), P ranks hold P*v chunks,
and rank s holds chunks s, s + P, s + 2P, ... (Megatron's placement): local
chunk c of rank s is global chunk c*P + s. With v = 1 the chunk is always 0.

    schedule("1f1b", stages=4, micro_batches=8)       # [[Action, ...] per stage]

The same lists drive the engine, the tests (every forward before its
backward, dependencies between stages, in-flight bounds), the cost model and
the pictures: `simulate` plays them with given times per action and returns
each action's start and end, from which the bubble follows.

Legend (docs/notation.md): P = pipeline stages (ranks), M = micro-batches, v = chunks per rank.
    none         no pipeline (P = 1): each micro-batch's forward, then its backward (Megatron's
                 forward_backward_no_pipelining); the step of every model that is not cut into stages
    gpipe        all M forwards, then all M backwards (GPipe, Huang et al. 2019); M in flight
    1f1b         P - s - 1 warm-up forwards, then one forward and one backward in turn, then the
                 remaining backwards (PipeDream-Flush, Narayanan et al. 2021); at most P - s in flight
    interleaved  1f1b over v chunks per rank, micro-batches in groups of P (Narayanan et al. 2021,
                 sec. 2.2); the bubble shrinks by v, M must be a multiple of P
"""
from __future__ import annotations

from dataclasses import dataclass

from mpi_tp.core.errors import UserError

SCHEDULES = ("gpipe", "1f1b", "interleaved")       # the pipelined ones (--schedule); "none" is P = 1's


@dataclass(frozen=True)
class Action:
    kind: str           # "F" or "B"
    micro: int          # micro-batch index, 0 .. M - 1
    chunk: int = 0      # this rank's model chunk, 0 .. v - 1

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def no_pipelining(micro_batches: int) -> list[list[Action]]:
    """One stage: F0 B0 F1 B1 ... (gradient accumulation; 1F1B at P = 1, nothing in flight)."""
    return [[Action(kind, m) for m in range(micro_batches) for kind in "FB"]]


def gpipe(stages: int, micro_batches: int) -> list[list[Action]]:
    """Every stage: all forwards, then all backwards."""
    one = [Action("F", m) for m in range(micro_batches)] + [Action("B", m) for m in range(micro_batches)]
    return [list(one) for _ in range(stages)]


def _warmup_steady_cooldown(warmup: int, total: int, action) -> list[Action]:
    """`warmup` forwards, then one forward and one backward in turn, then the backwards left;
    action(kind, k) is the k-th forward or backward of the stage."""
    acts = [action("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        acts += [action("F", warmup + i), action("B", i)]
    return acts + [action("B", k) for k in range(total - warmup, total)]


def one_f_one_b(stages: int, micro_batches: int) -> list[list[Action]]:
    """PipeDream-Flush: warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    return [_warmup_steady_cooldown(min(stages - s - 1, micro_batches), micro_batches, Action)
            for s in range(stages)]


def interleaved(stages: int, micro_batches: int, virtual: int) -> list[list[Action]]:
    """1F1B over `virtual` chunks per rank. The k-th forward of a rank is micro-batch
    (k // (P v)) P + k % P through chunk (k // P) % v; backwards run the chunks in reverse."""
    P, M, v = stages, micro_batches, virtual
    if M % P:
        raise UserError(f"the interleaved schedule needs a multiple of the {P} pipeline stages as micro-batches, "
                        f"got {M}: use --micro-batches {M + (-M) % P}")

    def action(kind, k):
        chunk = (k // P) % v
        return Action(kind, (k // (P * v)) * P + k % P, chunk if kind == "F" else v - 1 - chunk)
    total = M * v
    return [_warmup_steady_cooldown(min((P - s - 1) * 2 + (v - 1) * P, total), total, action) for s in range(P)]


def schedule(name: str, stages: int, micro_batches: int, virtual: int = 1) -> list[list[Action]]:
    """The action lists of schedule `name` (one of SCHEDULES), one list per stage."""
    if stages < 1 or micro_batches < 1 or virtual < 1:
        raise UserError(f"a schedule needs at least one stage, micro-batch and chunk, got P={stages} "
                        f"M={micro_batches} v={virtual}")
    if name == "none":
        if stages != 1 or virtual != 1:
            raise UserError(f"schedule 'none' runs one stage of one chunk, got P={stages} v={virtual}")
        return no_pipelining(micro_batches)
    if name == "interleaved":
        return interleaved(stages, micro_batches, virtual)
    if virtual != 1:
        raise UserError(f"--virtual-stages {virtual} needs --schedule interleaved (got {name})")
    if name == "gpipe":
        return gpipe(stages, micro_batches)
    if name == "1f1b":
        return one_f_one_b(stages, micro_batches)
    raise UserError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}")


def global_chunk(stage: int, chunk: int, stages: int) -> int:
    """The position in the model of rank `stage`'s local chunk (Megatron's placement)."""
    return chunk * stages + stage


def simulate(plan: list[list[Action]], t_forward: float = 1.0, t_backward: float = 2.0) -> dict:
    """Play the schedule: each stage runs its actions in order, each as soon as its inputs exist.

    F(m, g) needs F(m, g - 1) (the previous chunk's output, from the stage before);
    B(m, g) needs F(m, g) and B(m, g + 1). Times are per action of one chunk
    (divide by v for the interleaved schedule's smaller chunks yourself).
    Returns {"events": [(stage, action, start, end)], "time", "busy", "bubble"}: busy is each
    stage's working time, and bubble Narayanan et al.'s bubble time fraction, the idle time of the
    step over the ideal (no-bubble) time: (time - busy) / busy, (P - 1) / M for GPipe and 1F1B.
    Raises ValueError when the lists deadlock or break a dependency.
    """
    P = len(plan)
    v = 1 + max((a.chunk for acts in plan for a in acts), default=0)
    last = P * v - 1
    done, events = {}, []
    clock, nxt = [0.0] * P, [0] * P
    while any(nxt[s] < len(plan[s]) for s in range(P)):
        progressed = False
        for s in range(P):
            while nxt[s] < len(plan[s]):
                a = plan[s][nxt[s]]
                g = global_chunk(s, a.chunk, P)
                needs = [("F", a.micro, g - 1)] if a.kind == "F" and g > 0 else []
                if a.kind == "B":
                    needs = [("F", a.micro, g)] + ([("B", a.micro, g + 1)] if g < last else [])
                if any(n not in done for n in needs):
                    break
                start = max([clock[s]] + [done[n] for n in needs])
                end = start + (t_forward if a.kind == "F" else t_backward)
                done[(a.kind, a.micro, g)] = end
                events.append((s, a, start, end))
                clock[s], nxt[s], progressed = end, nxt[s] + 1, True
        if not progressed:
            stuck = {s: str(plan[s][nxt[s]]) for s in range(P) if nxt[s] < len(plan[s])}
            raise ValueError(f"the schedule deadlocks: each stage waits on its next action {stuck}")
    total = max(clock)
    busy = [sum(e - b for st, _, b, e in events if st == s) for s in range(P)]
    return {"events": events, "time": total, "busy": busy, "bubble": (total - max(busy)) / max(busy)}


def in_flight(actions: list[Action]) -> int:
    """The most micro-batch chunks whose forward ran on this stage and whose backward has not
    (the activations the stage holds at once)."""
    live, most = set(), 0
    for a in actions:
        if a.kind == "F":
            live.add((a.micro, a.chunk))
            most = max(most, len(live))
        else:
            live.discard((a.micro, a.chunk))
    return most


def check(plan: list[list[Action]], micro_batches: int) -> None:
    """Every stage runs each (micro-batch, chunk) forward exactly once, before its backward; the stages
    together respect the dependencies (simulate raises otherwise). Raises ValueError."""
    v = 1 + max((a.chunk for acts in plan for a in acts), default=0)
    want = {(m, c) for m in range(micro_batches) for c in range(v)}
    for s, acts in enumerate(plan):
        seen_f = [(a.micro, a.chunk) for a in acts if a.kind == "F"]
        seen_b = [(a.micro, a.chunk) for a in acts if a.kind == "B"]
        if sorted(seen_f) != sorted(want) or sorted(seen_b) != sorted(want):
            raise ValueError(f"stage {s} does not run every (micro-batch, chunk) forward and backward once")
        position = {(a.kind, a.micro, a.chunk): i for i, a in enumerate(acts)}
        late = [k for k in want if position[("B",) + k] < position[("F",) + k]]
        if late:
            raise ValueError(f"stage {s} runs backward before forward for {sorted(late)[:3]}")
    simulate(plan)


def draw(plan: list[list[Action]], t_forward: int = 1, t_backward: int = 2) -> str:
    """The simulated timeline as text, one row per stage, one column per time unit:
    F and B actions are written as the micro-batch number (forward) or its letter (backward: a, b, ...)."""
    sim = simulate(plan, t_forward, t_backward)
    width = int(round(sim["time"]))
    rows = [["."] * width for _ in plan]
    for s, a, start, end in sim["events"]:
        mark = str(a.micro % 10) if a.kind == "F" else "abcdefghijklmnopqrstuvwxyz"[a.micro % 26]
        for t in range(int(round(start)), int(round(end))):
            rows[s][t] = mark
    return "\n".join(f"stage {s}: " + "".join(r) for s, r in enumerate(rows))
