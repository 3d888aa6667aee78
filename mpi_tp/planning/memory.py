"""Memory per rank in the cost model: model state, activations held for the backward pass, logits.

Weights, gradients and optimizer state of the rank's layers, by the bytes per parameter
machines.state_bytes reads off the machine (or `mpi-tp plan --precision`: machines.with_precision):

    precision          weights  grads  fp32 masters  AdamW m, v   total   ZeRO-1 over D
    fp32               4        4      -             4 + 4        16      4 + 4 + 8/D (+ 4/D)
    bf16, fp16         2        2      4             4 + 4        16      2 + 2 + 12/D (+ 2/D)
    presets (Megatron) 2        4      4             4 + 4        18      (fp32 gradients: Megatron's main_grad)

(the distributed optimizer, ZeRO-1, divides the masters and moments by D and keeps a 1/D share
of the gradients besides them, the bracket). Rajbhandari et al. 2020's stages at the run's precision,
Psi the rank's parameters, D the replicas sharing them (dp x cp), w g k the bytes per parameter of
weights, gradients and optimizer state (2, 2, 12 at 16 bits; 4, 4, 8 in fp32), U one unit's
parameters (the largest block, or the embedding table, whichever holds more):

    zero 0    (w + g + k) Psi
    zero 1    (w + g) Psi + (k + g) Psi / D         the whole gradient buffer and the averaged share (on the
                                                    presets, Megatron's: the share a view of the buffer, k Psi / D)
    zero 2    w Psi + (g + k) Psi / D + g U         only the share, and one unit's gradients before its
                                                    reduce-scatter
    zero 3    (w + g + k) Psi / D + (w + g) U       one unit's parameters gathered at a time, and its
                                                    gradients

plus activations: per layer, term by term, this
code's count (values at the bytes per value, statistics fp32, 1-byte dropout masks) or Korthikanti
et al.'s for Megatron-style training (mpi_tp.planning.activations), times the micro-batches a stage
holds, on the stage that holds the most (stage_activations: with a pipeline the larger of the first
stage, P micro-batches under 1F1B, and the last, one micro-batch and the logits; the zero-bubble
schedules keep each deferred W's inputs too); selective recomputation drops the attention core
(activations.py); full recomputation keeps each layer's input and, during one layer's backward, that
layer's activations again, never at the same time as the logits (the larger of the two). Plan.recompute:
False / "none", "selective", True / "full". Attention that keeps no scores (FlashAttention, the online
softmax, ring attention: mpi_tp.planning.attention_cost.keeps_scores) keeps its output and log-sum-exp
instead (activations' online terms, in the paper's count too). Context parallelism (cp = Z) leaves S / Z
positions on a rank; the optimizer state is shared over Z D.
"""
from __future__ import annotations

import math

from mpi_tp.planning import activations, attention_cost
from mpi_tp.planning.bubble import blocks_by_stage
from mpi_tp.planning.costmodel import Plan, Workload
from mpi_tp.planning.experts import (
    dense_mlp_bytes,
    expert_params_rank,
    mlp_params_rank,
    moe_block_bytes,
)
from mpi_tp.planning.machines import Machine, state_bytes


def activation_bytes_per_layer(m: Machine, w: Workload, lay: Plan, recompute: str = "none") -> float:
    """One layer's activations on the rank that keeps the most (mpi_tp.planning.activations: this code's
    count, or Korthikanti et al.'s for 16-bit Megatron-style training), without recomputation or with
    selective recomputation."""
    S, B, C, H, T = w.seq / lay.cp, lay.micro_batch, w.n_embd, w.n_head, lay.tp
    online = not attention_cost.keeps_scores(m, w, S, lay.cp)   # flash, the online softmax, ring attention
    shape = activations.Shape.of(w)
    if m.activations == "korthikanti":
        return activations.activation_bytes_per_layer(S, B, C, H, T, lay.sp, w.dropout, recompute=recompute,
                                                      paper=True, value_bytes=m.bytes_per_value, online=online,
                                                      shape=shape)
    return activations.activation_bytes_per_layer(S, B, C, H, T, lay.sp, w.dropout, recompute=recompute,
                                                  value_bytes=m.bytes_per_value, online=online, shape=shape)


def params_per_rank(w: Workload, lay: Plan) -> float:
    """Parameters a rank of the first pipeline stage holds: its shards of the split matrices (q/k/v, the
    projections, fc, the vocabulary rows of wte: 12 C^2 + 7 C per layer / T) and, whole, what every
    tensor-parallel rank replicates (LayerNorms and row biases: 6 C per layer, wpe S C, ln_f 2 C); Llama
    shapes: Workload.layer_split (k and v whole, a replica, when H_kv < T; no biases, no wpe), and an
    untied lm_head's rows when one stage holds the whole model."""
    T, C = lay.tp, w.n_embd
    layers = sum(blocks_by_stage(w.n_layer, lay)[0])
    split, whole = w.layer_split(T)
    tables = 1 if w.tied or lay.pp > 1 else 2               # wte, and lm_head on the same (only) stage
    sharded = layers * split / T + tables * math.ceil(w.vocab / T) * C
    replicated = layers * whole + w.position_params + (w.final_norm_params if lay.pp == 1 else 0)
    moe = math.ceil(w.moe_layers / lay.pp)            # an MoE block: E / ep experts' etp shards, the shared
    if moe:                                           # ones over tp, a router, instead of one MLP
        sharded += moe * (mlp_params_rank(w, lay, w.shared_experts) - mlp_params_rank(w, lay)) + \
            expert_params_rank(w, lay, moe)
        replicated += moe * C * w.experts
    return sharded + replicated


def expert_share(w: Workload, lay: Plan) -> float:
    """The part of params_per_rank that is routed experts' (reduced and shared out over edp, not dp x cp)."""
    return expert_params_rank(w, lay, math.ceil(w.moe_layers / lay.pp)) if w.experts else 0.0


def recompute_mode(lay: Plan) -> str:
    """Plan.recompute as activations.RECOMPUTE names it: False "none", True "full", or the name itself."""
    mode = lay.recompute if isinstance(lay.recompute, str) else ("full" if lay.recompute else "none")
    if mode not in activations.RECOMPUTE:
        raise ValueError(f"recompute {mode!r}: one of {activations.RECOMPUTE}")
    return mode


def unit_params(w: Workload, lay: Plan) -> float:
    """The parameters ZeRO-3 gathers at once on a rank (one block, or the embedding table with the
    positions, whichever holds more), and ZeRO-2/3 hold one unit's whole gradients of before its
    reduce-scatter."""
    C = w.n_embd
    split, whole = w.layer_split(lay.tp)
    block = split / lay.tp + whole
    if w.experts:
        block += expert_params_rank(w, lay, 1) + mlp_params_rank(w, lay, w.shared_experts) - mlp_params_rank(w, lay) \
            + C * w.experts
    return max(block, math.ceil(w.vocab / lay.tp) * C + w.position_params)


def state_per_rank(m: Machine, w: Workload, lay: Plan) -> dict:
    """{"parameters", "gradients", "optimizer"}: bytes of model state on a rank at lay.zero (the table above)."""
    psi, state = params_per_rank(w, lay), state_bytes(m)
    wb, gb, kb = state["weights"], state["grads"], state["master"] + state["moments"]
    D = lay.dp * lay.cp              # the ranks holding the same weights (the reducer's group)
    zero = lay.zero if D > 1 else 0
    unit = unit_params(w, lay) if zero >= 2 else 0.0
    experts = expert_share(w, lay)
    share = (psi - experts) / D + experts / lay.edp          # a rank's share: experts' over edp
    # ZeRO-1 here keeps the averaged share beside the whole buffer; Megatron's distributed optimizer (the presets'
    # 16-bit Megatron-style training) reduce-scatters into the buffer itself, its share a view
    kept = 0.0 if m.activations == "korthikanti" else gb * share
    return {"parameters": wb * share + wb * unit if zero >= 3 else wb * psi,
            "gradients": {0: gb * psi, 1: gb * psi + kept}.get(zero, gb * share + gb * unit),
            "optimizer": kb * share if zero else kb * psi}


def memory_per_rank(m: Machine, w: Workload, lay: Plan) -> dict:
    """Bytes per rank: model state and the activations of the stage that holds the most (with a pipeline,
    the larger of the first stage's and the last's; stage_activations)."""
    state = state_per_rank(m, w, lay)
    weights_grads, optimizer = state["parameters"] + state["gradients"], state["optimizer"]
    acts, logits = stage_activations(m, w, lay)
    total = weights_grads + optimizer + acts + logits
    return {"total": total, "weights_grads": weights_grads, "optimizer": optimizer, "activations": acts,
            "logits": logits, **state}


def logits_bytes(m: Machine, w: Workload, lay: Plan) -> float:
    """What the output layer keeps for one micro-batch: its logits at the value width and the cross-entropy's
    softmax in fp32 (or wider), and the final norm's normalised input and the output layer's input, 2 S B C
    values (1/T under sp)."""
    rows = lay.micro_batch * w.seq / lay.cp
    head = 2 * rows * w.n_embd / (lay.tp if lay.sp else 1) * m.bytes_per_value
    return rows * w.vocab / lay.tp * (m.bytes_per_value + max(m.bytes_per_value, 4)) + head


def weight_input_bytes(m: Machine, w: Workload, lay: Plan) -> tuple[float, float]:
    """(one block's, the tied output layer's) arrays that a deferred W keeps for one micro-batch, S = seq / cp
    positions (the zero-bubble schedules; mpi_tp.core.weight_grads):

        the two LayerNorms     normalised input and output gradient     4 S B C   (1/T under sp)
        q/k/v, fc (column)     input X                                  2 S B C   (sp: the shard, 1/T)
                               output gradient dY                       7 S B C / T
        projections (row)      input X                                  5 S B C / T
                               output gradient dY, whole                2 S B C
        output layer           input X: S B C (1/T under sp); dY, the logits' gradient: S B V / T

    a block: S B C (6 / T_sp + 2 + 12 / T) values, T_sp = T under sequence parallelism, else 1 (other
    shapes: 12 C is the column layers' output widths and the row layers' input widths, Q + g F + C + F,
    Q = C + 2 C H_kv / H, g = 2 for SwiGLU's gate and up). MoE blocks are counted as dense ones here (what
    a deferred W of their experts keeps is not priced apart)."""
    S, B, C, T = w.seq / lay.cp, lay.micro_batch, w.n_embd, lay.tp
    t_sp, v = (T if lay.sp else 1), m.bytes_per_value
    widths = w.qkv_width + (2 if w.llama else 1) * w.ffn + C + w.ffn      # 12 C for gpt2
    block = S * B * C * (6 / t_sp + 2 + widths / (C * T)) * v
    head = S * B * (C / t_sp + w.vocab / T) * v
    return block, head


def stage_activations(m: Machine, w: Workload, lay: Plan) -> tuple[float, float]:
    """(activations, logits) of the pipeline stage that holds the most, in bytes.

    A stage of n blocks keeps per micro-batch A = n a (a one block's activations; full recomputation:
    its input) from its forward to its backward (B), and, where W is deferred (the zero-bubble
    schedules), W = n w + h from B to its W (w one block's weight_input_bytes, h the output layer's,
    on the last stage). Holding h_ micro-batches of which k wait for W, a stage peaks at
    (h_ - k - 1) A + k W + the one micro-batch whose B runs, at the largest of

        A + g              its forward done, with the logits g (last stage)
        A + h + r          B's start: the output layer's W inputs, the first block rebuilt (r: full
                           recomputation's one block of activations, else 0)
        W - w + a + r      B's last block: the others cut to their W inputs, this one rebuilt
        W                  B done, all of it waiting for W

    (B and W together, as 1F1B runs them: A + max(g, r), the logits and the rebuilt block never at the
    same time). Per schedule, P stages, M micro-batches:

        1f1b                stage 0: h_ = min(P, M), k = 0; the last stage: h_ = 1, with the logits
        interleaved         chunks of about L / (P v) blocks: stage s holds min(2 (P - s - 1) + (v - 1) P + 1,
                            M v) of them (its warm-up forwards and the one in flight: interleaved_activations),
                            stage 0 the most, P + (P - 1) / v stages' worth; the last, with the logits
        zb-h1               stage s: h_ = min(P, M), k = min(s, M - 1) (s W's kept back: the last
                            stage's P - 1 with the output layer's); stage 0 or the last holds the most
        zb-v                rank 0 (chunks 0 and 2P - 1, the logits): min(2P + 2, 2M) chunk
                            micro-batches of L / (2P) blocks between F and W (mpi_tp.parallel.
                            pipeline.zero_bubble.v_bound), each at max(A, W) (how many wait varies
                            along the play), the output layer's W inputs of up to min(M, P) of them,
                            and the larger of the logits and a rebuilt block"""
    mode = recompute_mode(lay)
    P, M = lay.pp, max(1, w.global_batch // (lay.dp * lay.micro_batch))
    # an MoE block keeps its experts' state in place of the dense MLP's (mpi_tp.planning.experts): spread over
    # the stage's blocks as an average
    n_blocks, n_moe = math.ceil(w.n_layer / P), min(math.ceil(w.n_layer / P), math.ceil(w.moe_layers / P))
    moe = (moe_block_bytes(m, w, lay) - dense_mlp_bytes(m, w, lay)) if n_moe else 0.0
    if mode == "full":
        a = w.seq / lay.cp * lay.micro_batch * w.n_embd * m.bytes_per_value / (lay.tp if lay.sp else 1)
        r = activation_bytes_per_layer(m, w, lay) + moe
    else:
        a, r = activation_bytes_per_layer(m, w, lay, mode if mode == "selective" else "none"), 0.0
        a += moe * n_moe / n_blocks
    w_block, w_head = weight_input_bytes(m, w, lay)
    g = logits_bytes(m, w, lay)
    chunks = blocks_by_stage(w.n_layer, lay)
    if lay.schedule == "zb-v":
        n, held = max(chunks[0]), min(2 * P + 2, 2 * M)
        kept = held * n * max(a, w_block) + min(M, P) * w_head
        return (kept + r, 0.0) if r > g else (kept, g)
    if lay.virtual > 1 and lay.schedule is None:          # interleaved: chunks of about 1 / v of a stage
        return interleaved_activations(chunks, M, a, r, g)
    split = lay.schedule == "zb-h1"

    def stage(n, held, waiting, h, g):
        """(activations, logits) at the peak of a stage of n blocks."""
        A, W = n * a, n * w_block + h
        if split:
            now = max((A + g, g), (A + h + r, 0.0), (W - w_block + a + r, 0.0), (W, 0.0))
        else:
            now = (A + max(g, r), g if g >= r else 0.0)
        return (held - waiting - 1) * A + waiting * W + now[0] - now[1], now[1]

    held, first_n, last_n = min(P, M), sum(chunks[0]), sum(chunks[-1])
    first = stage(first_n, held, 0, 0.0, 0.0)
    last = stage(last_n, held, min(P - 1, M - 1), w_head, g) if split else stage(last_n, 1, 0, w_head, g)
    return last if P == 1 or sum(last) >= sum(first) else first


def interleaved_activations(chunks: list, M: int, a: float, r: float, g: float) -> tuple[float, float]:
    """(activations, logits) at the peak of the interleaved schedule's fullest stage, `a` bytes a block, `chunks`
    each stage's chunks' blocks (bubble.blocks_by_stage): stage s runs 2 (P - s - 1) + (v - 1) P warm-up forwards
    (mpi_tp.parallel.pipeline.schedules: the k-th through its chunk (k // P) mod v) and keeps them with the one in
    flight; besides, the rebuilt block r (full recomputation) or, on the last stage, the logits g, whichever is
    larger."""
    P, v = len(chunks), len(chunks[0])

    def held(s):                     # the blocks of the stage's first forwards, chunk by chunk
        h = min(2 * (P - s - 1) + (v - 1) * P + 1, M * v)
        return sum(min(P, h - k) * chunks[s][(k // P) % v] for k in range(0, h, P)) * a
    first = held(0) + r
    last = held(P - 1) + max(g, r)
    return (first, 0.0) if first >= last else (last - (g if g >= r else 0.0), g if g >= r else 0.0)
