"""Zero-bubble schedules (Qi et al. 2024): each backward cut in two, B (the input's gradient, which the
stage before waits for) and W (the weights' gradients, which nothing waits for), W placed in the bubble.

    zb_h1(stages=4, micro_batches=8)      # 1F1B's shape, W delayed: bubble (P - 1) / (3 M) at T_F = T_B = T_W
    zb_v(stages=4, micro_batches=8)       # two chunks per rank in a V: little more than the last rank's start

ZB-H1. Stage s runs 1F1B's warm-up (P - s - 1 forwards), then one forward and one B in turn, but keeps
its last s W's waiting: a W runs after a B only once more than s wait, and the W's still waiting fill
the cool-down, where 1F1B idles for the gradients of the stages after it. The B's travel back one
T_B per stage instead of T_B + T_W, so the pipeline drains faster. With equal times the step takes
3M + P - 1 units: a bubble of (P - 1) / (3M), a third of 1F1B's (P - 1) / M. A stage holds at most
1F1B's P - s micro-batches from forward to B, and at most s more whose W inputs wait.

ZB-V. Rank s holds chunks s and 2P - 1 - s (actions.global_chunk's V). Its action list is found by
playing the step (as Qi et al.'s own scheduler does, with a simpler rule): whenever a stage is free
it starts the first of its ready actions in the order B (first chunk first), F (second chunk first,
and only while fewer than v_bound(P) = 2P + 2 chunk micro-batches wait between their F and their W), W
(oldest first). The order so found is the list; the engine runs it whatever the real times are. The
play assumes T_F : T_B : T_W = 1 : 1.25 : 0.85 (PLAY_TIMES), the split measured here (W about 28%
of a step's work, B a quarter longer than F: attention's backward): a list played at equal times
idles at once when B outlasts F, this one stays ahead of ZB-H1 from equal times to B 60% over F
(tests/test_schedules_zero_bubble.py), at the price of 2 chunk micro-batches more than 1F1B's 2P
(one whole micro-batch of a stage's activations). Played at equal times (zb_v(P, M, (1, 1, 1)))
the step takes 6M + P - 1 chunk units: the P - 1 is the last rank's start, which Qi et al. hide by
starting the next step early (their post-validation of the optimizer step); mpi_tp keeps the
synchronous step (docs/parallelism.md).
"""
from __future__ import annotations

from mpi_tp.parallel.pipeline.actions import Action, global_chunk


def zb_h1(stages: int, micro_batches: int) -> list[list[Action]]:
    """Each stage's list: 1F1B's forwards and B's, with s W's kept waiting on stage s."""
    P, M, plan = stages, micro_batches, []
    for s in range(P):
        warmup = min(P - s - 1, M)
        acts, waiting = [Action("F", m) for m in range(warmup)], []
        for i in range(M):
            if warmup + i < M:
                acts.append(Action("F", warmup + i))
            acts.append(Action("B", i))
            waiting.append(i)
            if len(waiting) > s or warmup + i >= M:          # steady: past the delay; cool-down: one W per B
                acts.append(Action("W", waiting.pop(0)))
        plan.append(acts + [Action("W", m) for m in waiting])
    return plan


PLAY_TIMES = (1.0, 1.25, 0.85)     # T_F : T_B : T_W that zb_v's play assumes (see the module's docstring)


def zb_v(stages: int, micro_batches: int, times: tuple = PLAY_TIMES) -> list[list[Action]]:
    """Each rank's list for two chunks in a V, by the play described above at `times` (T_F, T_B, T_W)."""
    P, M = stages, micro_batches
    last, took = 2 * P - 1, dict(zip("FBW", times))
    local = [{global_chunk(s, c, P, True): c for c in (0, 1)} for s in range(P)]
    done: dict = {}                              # (kind, micro, global chunk) -> the time it ends
    nxt = {(k, g): 0 for k in "FB" for g in range(last + 1)}      # the next micro-batch of each F and B
    waiting = [[] for _ in range(P)]             # (micro, g) whose B ran, W not yet
    held, free, plan, t = [0] * P, [0.0] * P, [[] for _ in range(P)], 0.0

    def ready(kind, m, g):
        needs = [("F", m, g - 1)] if kind == "F" and g > 0 else []
        if kind == "B":
            needs = [("F", m, g)] + ([("B", m, g + 1)] if g < last else [])
        return m < M and all(done.get(n, t + 1) <= t for n in needs)

    while any(nxt["B", g] < M for g in range(last + 1)) or any(waiting):
        for s in range(P):
            if free[s] > t:
                continue                                             # still busy
            first, second = sorted(local[s])
            act = next((("B", nxt["B", g], g) for g in (first, second) if ready("B", nxt["B", g], g)), None)
            if act is None and held[s] < v_bound(P):
                act = next((("F", nxt["F", g], g) for g in (second, first) if ready("F", nxt["F", g], g)), None)
            if act is None and waiting[s] and done["B", waiting[s][0][0], waiting[s][0][1]] <= t:
                act = ("W",) + waiting[s].pop(0)
            if act is None:
                continue
            kind, m, g = act
            done[act] = free[s] = t + took[kind]
            plan[s].append(Action(kind, m, local[s][g]))
            if kind in "FB":
                nxt[kind, g] += 1
            held[s] += {"F": 1, "B": 0, "W": -1}[kind]
            if kind == "B":
                waiting[s].append((m, g))
        later = [f for f in free if f > t]
        if not later:                            # every stage free and none could start: cannot happen
            raise RuntimeError(f"zb-v's play is stuck for P={P} M={M}")     # (a bug here, not user input)
        t = min(later)
    return plan


def v_bound(stages: int) -> int:
    """The most chunk micro-batches a zb-v rank keeps between their F and their W: 2P + 2."""
    return 2 * stages + 2


def _key(a: Action, stage: int, stages: int) -> tuple:
    return a.kind, a.micro, global_chunk(stage, a.chunk, stages, True)
