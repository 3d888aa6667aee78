"""Pipeline schedules as data: for each stage, the ordered actions it runs in one training step.

An action is (kind, micro-batch, chunk): kind "F" (forward), "B" (backward)
or, in the zero-bubble schedules, "W" (the weights' gradients of a backward
that ran earlier), of one micro-batch through one model chunk that the stage
holds (mpi_tp.parallel.pipeline.actions: the actions, and where the chunks
sit). With v chunks per rank, rank s holds chunks s, s + P, s + 2P, ...
(Megatron's placement), or under zb-v chunks s and 2P - 1 - s (a V).

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
    zb-h1        1f1b with each backward cut into B and W, stage s keeping s W's waiting for the
                 cool-down (Qi et al. 2024): a third of 1f1b's bubble at its activation memory
    zb-v         two chunks per rank in a V, B and W cut, W's in the gaps (Qi et al. 2024): no bubble
                 but the start's, at 1f1b's activation memory (mpi_tp.parallel.pipeline.zero_bubble)
"""
from __future__ import annotations

from mpi_tp.core.errors import UserError
from mpi_tp.parallel.pipeline.actions import Action, global_chunk
from mpi_tp.parallel.pipeline.zero_bubble import zb_h1, zb_v

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")   # the pipelined ones (--schedule); "none": P = 1
SPLIT = ("zb-h1", "zb-v")           # backward cut into B and W actions
V_SHAPED = ("zb-v",)                # chunks placed in a V (actions.global_chunk)


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
    if name == "zb-v":
        if virtual != 2:
            raise UserError(f"zb-v runs two chunks per rank (a V): use --virtual-stages 2 (got {virtual})")
        return zb_v(stages, micro_batches)
    if virtual != 1:
        raise UserError(f"--virtual-stages {virtual} needs --schedule interleaved (got {name})")
    if name == "gpipe":
        return gpipe(stages, micro_batches)
    if name == "1f1b":
        return one_f_one_b(stages, micro_batches)
    if name == "zb-h1":
        return zb_h1(stages, micro_batches)
    raise UserError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}")


def simulate(plan: list[list[Action]], t_forward: float = 1.0, t_backward: float = 2.0,
             t_weight: float | None = None, v_shape: bool = False, sizes: list | None = None) -> dict:
    """Play the schedule: each stage runs its actions in order, each as soon as its inputs exist.

    F(m, g) needs F(m, g - 1) (the previous chunk's output); B(m, g) needs F(m, g) and B(m, g + 1);
    W(m, g) needs B(m, g). Times are per action of one chunk (divide by v yourself for smaller
    chunks): t_backward is a whole backward's; where the plan has W actions, B takes t_backward -
    t_weight and W t_weight (default half of it). v_shape: the chunks sit in a V (zb-v). sizes: each
    global chunk's time as a multiple of those (its blocks, where the chunks differ: stages.layer_ranges).
    Returns {"events": [(stage, action, start, end)], "time", "busy", "bubble"}: busy is each
    stage's working time, and bubble Narayanan et al.'s bubble time fraction, the idle time of the
    step over the ideal (no-bubble) time: (time - busy) / busy, (P - 1) / M for GPipe and 1F1B.
    Raises ValueError when the lists deadlock or break a dependency.
    """
    P = len(plan)
    v = 1 + max((a.chunk for acts in plan for a in acts), default=0)
    last = P * v - 1
    split = any(a.kind == "W" for acts in plan for a in acts)
    t_weight = (t_backward / 2 if t_weight is None else t_weight) if split else 0.0
    took = {"F": t_forward, "B": t_backward - t_weight, "W": t_weight}
    done, events = {}, []
    clock, nxt = [0.0] * P, [0] * P
    while any(nxt[s] < len(plan[s]) for s in range(P)):
        progressed = False
        for s in range(P):
            while nxt[s] < len(plan[s]):
                a = plan[s][nxt[s]]
                g = global_chunk(s, a.chunk, P, v_shape)
                needs = [("F", a.micro, g - 1)] if a.kind == "F" and g > 0 else []
                if a.kind == "B":
                    needs = [("F", a.micro, g)] + ([("B", a.micro, g + 1)] if g < last else [])
                if a.kind == "W":
                    needs = [("B", a.micro, g)]
                if any(n not in done for n in needs):
                    break
                start = max([clock[s]] + [done[n] for n in needs])
                end = start + took[a.kind] * (sizes[g] if sizes else 1)
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
    """The most micro-batch chunks whose forward ran on this stage and whose backward (B) has not
    (the activations the stage holds at once)."""
    return _most(actions, "F", "B")


def waiting_weights(actions: list[Action]) -> int:
    """The most micro-batch chunks whose B ran and whose W has not (W's inputs kept; 0 without W)."""
    return _most(actions, "B", "W")


def held(actions: list[Action]) -> int:
    """The most micro-batch chunks between their forward and their last backward action (W where the
    backward is cut, else B): what a stage keeps something of, counted whole (a bound on its memory)."""
    return _most(actions, "F", "W" if any(a.kind == "W" for a in actions) else "B")


def _most(actions: list[Action], opens: str, closes: str) -> int:
    live, most = set(), 0
    for a in actions:
        if a.kind == opens:
            live.add((a.micro, a.chunk))
            most = max(most, len(live))
        elif a.kind == closes:
            live.discard((a.micro, a.chunk))
    return most


def check(plan: list[list[Action]], micro_batches: int, v_shape: bool = False) -> None:
    """Every stage runs each (micro-batch, chunk) forward and backward exactly once, the forward first,
    and, where the plan cuts backwards (W actions), each W once after its B; the stages together respect
    the dependencies (simulate raises otherwise). Raises ValueError."""
    v = 1 + max((a.chunk for acts in plan for a in acts), default=0)
    want = {(m, c) for m in range(micro_batches) for c in range(v)}
    split = any(a.kind == "W" for acts in plan for a in acts)
    for s, acts in enumerate(plan):
        for kind in "FBW" if split else "FB":
            if sorted((a.micro, a.chunk) for a in acts if a.kind == kind) != sorted(want):
                raise ValueError(f"stage {s} does not run every (micro-batch, chunk) {kind} once")
        position = {(a.kind, a.micro, a.chunk): i for i, a in enumerate(acts)}
        for first, then in (("F", "B"), ("B", "W")) if split else (("F", "B"),):
            late = [k for k in want if position[(then,) + k] < position[(first,) + k]]
            if late:
                name = {"B": "backward", "W": "W"}[then]
                raise ValueError(f"stage {s} runs {name} before {'forward' if first == 'F' else 'B'} for "
                                 f"{sorted(late)[:3]}")
    simulate(plan, v_shape=v_shape)


def draw(plan: list[list[Action]], t_forward: int = 1, t_backward: int = 2, v_shape: bool = False) -> str:
    """The simulated timeline as text, one row per stage, one column per time unit: the micro-batch
    number for a forward, its letter for a backward (a, b, ...; B where the backward is cut) and its
    capital for a W (A, B, ...)."""
    sim = simulate(plan, t_forward, t_backward, v_shape=v_shape)
    width = int(round(sim["time"]))
    rows = [["."] * width for _ in plan]
    for s, a, start, end in sim["events"]:
        letter = "abcdefghijklmnopqrstuvwxyz"[a.micro % 26]
        mark = {"F": str(a.micro % 10), "B": letter, "W": letter.upper()}[a.kind]
        for t in range(int(round(start)), int(round(end))):
            rows[s][t] = mark
    return "\n".join(f"stage {s}: " + "".join(r) for s, r in enumerate(rows))
