"""A cost model of a training step: alpha-beta collectives, a GEMM roofline, the pipeline's bubble.

Everything is per rank and per training step, for a GPT of L layers, C channels,
H heads, vocabulary V, sequence S, on a layout of T x P x D ranks (tp x pp x dp)
with micro-batches of B sequences, M = global batch / (D B) of them per step
(docs/costmodel.md derives each term and works one layout by hand).

    compute      GEMM FLOPs at the GEMM rate for B S rows (the machine's curve, or a constant)
                 + elementwise work: (ew_rep S B C + ew_par S B C / T + ew_att H S^2 B / T) per layer
                   and micro-batch, in elements, over elem_rate (elements per second)
                 + layer_overhead per layer and micro-batch (launches, the interpreter)
    tensor par.  4 all-reduces of B S C values per layer and micro-batch (2 forward, 2 backward;
                 6 with recomputation), ring: 2 (T-1) alpha + 2 (T-1)/T n beta, beta = 1 / bw;
                 sequence parallelism: each all-reduce an all-gather + a reduce-scatter (the same
                 bytes), plus the column layers' inputs gathered again in the backward pass (2
                 all-gathers of B S C per layer: what keeps their activations at 1/T); a run that
                 overlaps them with the GEMMs (Plan.overlap_tp: Transformer Engine's userbuffers,
                 inside a node) pays 1 / TP_OVERLAP_SPLITS of them
    pipeline     bubble (P - 1) / (v M) of the compute (zb-h1: (P - 1)(1 - 2w) / M, zb-v: (P - 1)(1 - 3w)
                 / (2M), w the weights' gradients' share: mpi_tp.planning.bubble), plus the activation
                 messages (receives are posted ahead: pp_overlap of a transfer hides behind compute,
                 but in the fill and the drain; the V sends twice 1F1B's)
    experts      (E experts, top-k, every moe_every-th block, n shared) each token's MLP runs k a + n
                 times (a: the share a capacity admits); the dispatch (all-to-all or all-gather) over ep
                 of each rank's own positions' rows, the etp group's rows gathered and reduce-scattered,
                 the output gathered back over tp; an expert shard's gradients reduced over edp, on the
                 link that group crosses (mpi_tp.planning.experts)
    context par. (cp = Z > 1) each rank computes S / Z positions (the GEMMs, the attention's
                 S^2 / Z score entries, the elementwise work and the tensor-parallel messages all
                 shrink by Z) and its ring passes 3Z - 2 messages of K and V per layer and micro-
                 batch, 2 B (S / Z) C / T values each (mpi_tp.parallel.ring_attention): the forward's
                 and the backward's Z - 1 K/V messages hide behind the block computed meanwhile
                 (pp_overlap of them), the backward's Z dK/dV messages do not; the gradient
                 reduction runs over Z D ranks (the cp and dp ranks hold the same weights)
    data par.    one all-reduce of the rank's gradients (params / (T P) values) over D; the
                 engine starts it during the last micro-batch's backward pass, which hides
                 dp_overlap of that pass's time (the embeddings' bucket, ready last, never hides).
                 ZeRO-1 (the distributed optimizer): a reduce-scatter of the gradients (hidden
                 alike) and, after the update, an all-gather of the parameters: the same bytes.
                 ZeRO-2: the same, but the gradients are reduce-scattered after every micro-batch
                 (then freed), each behind its own backward pass. ZeRO-3: no gather after the
                 update; instead each micro-batch gathers the parameters before its forward and
                 again before its backward, a layer ahead (hidden but the first layer's): at M = 1,
                 1.5x ZeRO-1's bytes; a piece (block) at a time, each gather and reduce-scatter a
                 ring of its own: (L / P + 1) (D - 1) alpha of latency a pass besides the bytes
    optimizer    opt_traffic_per_param x params per rank / mem_bw (ZeRO: / D, its share)

Each group is priced on the slowest link its members cross, under the engine's rank order
(tp fastest, then cp, pp, dp: mpi_tp.parallel.topology) and the machine's ranks per node:
a group whose members all share a node uses the node's links, one that straddles two nodes
anywhere (tp 6 on 8-GPU nodes: ranks 6-11) waits on the network (`placement`, mpi_tp.planning.links).
The machine's constants: mpi_tp.planning.machines; memory per rank:
mpi_tp.planning.memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mpi_tp.parallel.layout import Layout
from mpi_tp.planning import attention_cost as attn
from mpi_tp.planning.bubble import ZERO_BUBBLE, blocks_by_stage, bubble_fraction, forward_hops
from mpi_tp.planning.experts import (
    DISPATCHERS,
    expert_grid_links,
    expert_params_rank,
    mlp_passes,
    moe_step_terms,
)
from mpi_tp.planning.links import link, placement, ring_all_gather, ring_all_reduce
from mpi_tp.planning.machines import Machine, curve_rate, state_bytes
from mpi_tp.planning.workload import Workload


# Transformer Engine's userbuffer overlap, as NeMo's H100 configurations set it (userbuffers_bf16_h100_*: the forward's
# reduce-scatters pipelined in num_splits=4 chunks against the row GEMM, the last one exposed; the all-gathers ring-
# exchanged and the backward's bulk-overlapped against GEMMs, hidden but for the SMs they take): a quarter exposed
TP_OVERLAP_SPLITS = 4


@dataclass(frozen=True)
class Plan(Layout):
    """A layout to price: the parallel sizes (mpi_tp.parallel.layout.Layout) and how a step runs on them."""

    micro_batch: int = 1
    recompute: bool = False      # full activation recomputation
    overlap_dp: bool = True      # data-parallel all-reduce during the last backward pass (--no-overlap-dp)
    schedule: str | None = None  # "zb-h1" (v = 1) or "zb-v" (v = 2); None: 1F1B, or interleaved at v > 1
    dispatcher: str = "alltoall"  # how an MoE block's rows reach their experts: "alltoall" or "allgather"
    overlap_tp: bool = False     # tensor-parallel collectives cut and run against the GEMMs' chunks, as Transformer
    #                              Engine's userbuffers do (Megatron --tp-comm-overlap; not this engine)
    first_stage_layers: int = 0  # blocks of the first / last pipeline stage set by hand (0: the engine's split;
    last_stage_layers: int = 0   # mpi_tp.parallel.pipeline.stages, `train --first-stage-layers`)

    @property
    def schedule_name(self) -> str:
        """The pipeline schedule as `mpi-tp train --schedule` names it."""
        return self.schedule or ("interleaved" if self.virtual > 1 else "1f1b")

    def problems(self, world: int | None = None) -> list[str]:
        out = super().problems(world)
        if self.dispatcher not in DISPATCHERS:
            out.append(f"dispatcher {self.dispatcher!r}: one of {', '.join(DISPATCHERS)}")
        if self.schedule is not None and (self.schedule not in ZERO_BUBBLE or self.pp < 2 or
                                          self.virtual != (2 if self.schedule == "zb-v" else 1)):
            out.append(f"schedule {self.schedule!r} needs pp > 1 and is one of {', '.join(ZERO_BUBBLE)} "
                       "(zb-h1: one chunk per stage; zb-v: two, v = 2)")
        return out

    def describe(self) -> str:
        """'tp4 pp12 dp8 b2 v2 +sp +zero1 +recompute': the layout's words, the micro-batch after the grid
        (a zero-bubble schedule's name where v would stand: 'tp4 pp12 dp8 b2 zb-v +zero3')."""
        extra = (["+recompute"] if self.recompute else []) + ([] if self.overlap_dp or self.dp == 1 else ["-overlap"])
        extra += ["+tp-overlap"] if self.overlap_tp else []
        if self.first_stage_layers or self.last_stage_layers:
            extra.append(f"ends{self.first_stage_layers}/{self.last_stage_layers}")
        flags = self.flags()
        if self.schedule:
            flags = [self.schedule] + [f for f in flags if f != f"v{self.virtual}"]
        return " ".join(self.words() + [f"b{self.micro_batch}"] + flags + extra)


def hierarchical_all_reduce(n_bytes: float, p: int, per_node: int, m: Machine) -> float:
    """Reduce inside the node, all-reduce among one rank per node, broadcast back (trees inside)."""
    local = min(p, per_node)
    nodes = max(1, p // local)
    inside = 2 * (math.ceil(math.log2(local)) * m.intra_alpha + n_bytes / m.intra_bw) if local > 1 else 0.0
    return inside + ring_all_reduce(n_bytes, nodes, m.inter_alpha, m.inter_bw)


def gemm_rate(m: Machine, rows: float) -> float:
    """FLOP/s of GEMMs with `rows` rows (the B S tokens of a micro-batch): the machine's measured
    curve, interpolated in log(rows) and flat beyond its ends, or gemm_flops without one."""
    return curve_rate(m.gemm_curve, rows, m.gemm_flops)


def step_time(m: Machine, w: Workload, lay: Layout, hierarchical_dp: bool = False,
              per_node: int | None = None) -> dict:
    """Seconds per training step and their parts, per rank (dp_hidden: the part of the data-parallel
    all-reduce that the backward pass hides; not in the total), and `links`: where each group's traffic
    goes (placement; per_node: the machine's ranks per node unless given)."""
    links = placement(lay, per_node or m.ranks_per_node)
    if w.moe_layers:                 # the experts' groups, placed by their own grid: "etp", "ep", "edp"
        links.update(expert_grid_links(lay, per_node or m.ranks_per_node))
    L, h, a, V = w.n_layer, w.n_embd, w.n_head, w.vocab
    t, p, d, b, c = lay.tp, lay.pp, lay.dp, lay.micro_batch, lay.cp
    s = w.seq / c                                              # positions per rank (context parallelism)
    micro = w.global_batch / (d * b)                           # micro-batches per replica and step
    chunks = blocks_by_stage(L, lay)
    layers = max(sum(c) for c in chunks)                       # the largest stage sets the pace
    fwd_bwd = 4 if lay.recompute else 3                        # forward counted again when recomputing
    # the rank with the most heads (and MLP columns) sets the pace when they do not divide by t
    att_share, mlp_share = math.ceil(a / t) / a, math.ceil(w.ffn / t) / w.ffn
    gemm = fwd_bwd * 2 * b * s * w.layer_macs(t) * layers       # 2 FLOPs per MAC (q/k/v, projection, MLP)
    gemm += 3 * 2 * b * s * h * V / t / p                      # the output layer (tied or not), one stage's share
    scores = attn.score_flops(m, w, b, s, att_share, layers, lay.recompute)              # QK^T and AV
    score_rate = attn.score_rate(m, w, s, gemm_rate(m, b * s))
    elem = layers * (m.ew_rep * s * b * h / (t if lay.sp else 1) + m.ew_par * s * b * h / t) * (fwd_bwd / 3)
    elem += attn.score_elements(m, w, b, s, t, layers, lay.recompute)
    overhead = layers * m.layer_overhead * fwd_bwd / 3
    compute = micro * (gemm / gemm_rate(m, b * s) + scores / score_rate + elem / m.elem_rate + overhead)
    alpha, bw = link(links["tp"], m)
    n = b * s * h * m.bytes_per_value
    per_layer = (6 if lay.recompute else 4) * ring_all_reduce(n, t, alpha, bw)   # SP: same bytes (RS + AG)
    if lay.sp:
        per_layer += 2 * ring_all_gather(n, t, alpha, bw)         # the column layers' inputs, again
    tp_comm = micro * layers * per_layer
    if lay.overlap_tp and links["tp"] == "node":   # userbuffers (they need the node's NVLink): one of each
        tp_comm /= TP_OVERLAP_SPLITS               # collective's chunks exposed
    moe = math.ceil(w.moe_layers / p)                          # this stage's MoE blocks (at most)
    ep_comm = 0.0
    if moe:                          # the experts' GEMMs, dispatch, etp and tp traffic (mpi_tp.planning.experts)
        terms = moe_step_terms(m, w, lay, links, micro, b, s, fwd_bwd, mlp_share, moe, gemm_rate)
        compute += terms["compute"]
        tp_comm += terms["tp"] + terms["etp"]
        ep_comm = terms["ep"]
    cp_comm = 0.0
    if c > 1:                       # the ring: its messages against the blocks computed meanwhile (attention_cost)
        ca, cbw = link(links["cp"], m)
        kv_width = h / a * max(w.kv_heads, t)          # hs H_kv (/ T a rank; one whole head each when H_kv < T)
        cp_comm = micro * layers * attn.ring_exposed(m, w, ca, cbw, c, b, s, kv_width, t,
                                                     attn.step_score_flops(w, b, s, att_share), score_rate,
                                                     lay.recompute)
    # W, the weights' gradients (the dW GEMMs: one pass of the layers' and the head's weight GEMMs), as a share
    # of a stage's work: what the zero-bubble schedules move into the bubble (mpi_tp.planning.bubble)
    wgrad = 2 * b * s * w.layer_macs(t) * layers + 2 * b * s * h * V / t / p
    wgrad += (mlp_passes(w) - 1) * 2 * b * s * w.mlp_macs * mlp_share * moe if moe else 0.0
    work = compute + tp_comm + cp_comm + ep_comm
    w_share = micro * wgrad / gemm_rate(m, b * s) / work if work else 0.0
    pp_comm, bubble = 0.0, 0.0
    if p > 1:
        pa, pbw = link(links["pp"], m)
        v = lay.virtual                                        # v chunks: more messages, 1/v the bubble
        # each message is 1/T of B S C (scatter/gather: all-gathered on arrival unless under sp); per step a
        # stage sends, on average, 2 hops / P messages per micro-batch (hops: P v - 1, the V's 2 (P - 1))
        hops = forward_hops(lay.schedule, p, v)
        messages = micro * 2 * hops / p                        # per stage and step, on average
        transfer = n / t / pbw
        # posted ahead, a transfer overlaps the receiver's compute (pp_overlap of it), except the fill's
        # and the drain's: 2 hops / P of them, nothing computing yet (or any more) to hide behind
        exposed = messages * (1 - m.pp_overlap) + m.pp_overlap * min(messages, 2 * hops / p)
        pp_comm = messages * (pa + (0.0 if lay.sp else ring_all_gather(n, t, alpha, bw))) + exposed * transfer
        bubble = bubble_fraction(lay.schedule, p, v, micro, w_share, chunks) * work
    params_rank = w.params / (t * p)
    experts_rank = 0.0               # the rank's E / ep experts' etp shards: reduced over edp
    if w.moe_layers:
        experts_rank = expert_params_rank(w, lay, w.moe_layers) / p
        params_rank += experts_rank - w.moe_layers * w.experts * w.expert_params / (t * p)
    overlaps = lay.overlap_dp and not hierarchical_dp
    dense_link = link(links["dp"], m)                          # the experts' edp group crosses its own
    expert_link = link(expert_grid_links(lay, m.ranks_per_node)["edp"], m) if w.moe_layers else dense_link
    d = d * c                                                  # the reducer's group: cp x dp
    de = lay.edp                                               # the experts' (mpi_tp.parallel.expert_grid)
    per_node = max(1, m.ranks_per_node // (t * p))             # the dp group's ranks on one node
    zero = int(lay.zero)
    pieces = layers + 1              # ZeRO-3's units on a stage: its blocks, and the embedding or the head
    gather, gathers, dp_comm = 0.0, 0.0, 0.0     # the parameters' all-gathers: after the update; ZeRO-3's per pass
    state = state_bytes(m)           # the gradients' and the weights' bytes per parameter
    for n, g, g_node, (da, dbw) in ((params_rank - experts_rank, d, per_node, dense_link),
                                    (experts_rank, de, max(1, per_node // lay.ep), expert_link)):
        n_bytes = n * state["grads"]
        if g < 2 or n_bytes == 0:
            continue
        weights = ring_all_gather(n * state["weights"], g, da, dbw)
        if zero == 3:                # before each micro-batch's forward and again before its backward, a piece (a
            weights += pieces * (g - 1) * da         # block, the embedding or the head) at a time: each its ring's
            gathers += 2 * micro * weights           # latency (mpi_tp.parallel.fsdp)
        elif zero:                   # ZeRO-1 and 2: after the update (not hidden)
            gather += weights
        if hierarchical_dp and zero < 2:
            dp_comm += hierarchical_all_reduce(n_bytes, g, g_node, m)
        elif zero:                   # the reduce-scatter of the gradients: ZeRO-2 and 3 free them, so every
            scatter = ring_all_gather(n_bytes, g, da, dbw) + (pieces * (g - 1) * da if zero == 3 else 0.0)
            dp_comm += (micro if zero >= 2 else 1) * scatter                                  # micro-batch's
        else:
            dp_comm += ring_all_reduce(n_bytes, g, da, dbw)
    dp_hidden = 0.0
    if overlaps and dp_comm + gathers > 0:
        # the last micro-batch's backward pass (2 of its 3 passes, 3 of 4 when recomputing) hides
        # dp_overlap of its time; the last bucket (the embeddings, ready when the pass ends) never hides;
        # ZeRO-2 and 3 reduce-scatter after every micro-batch's backward, each hidden alike; ZeRO-3's gathers
        # are issued a layer ahead, so every pass hides them but for its first layer's
        backward = (compute + tp_comm) / micro * (fwd_bwd - 1) / fwd_bwd
        last_bucket = min(1.0, (V * h / t + w.position_params + w.final_norm_params) / params_rank)
        hideable, window = dp_comm * (1 - last_bucket), backward * (micro if zero >= 2 else 1)
        if zero == 3:
            hideable, window = hideable + gathers * (1 - 1 / layers), compute + tp_comm
        dp_hidden = min(hideable, m.dp_overlap * window)
    shards = ((params_rank - experts_rank) / d + experts_rank / de) if lay.zero else params_rank   # ZeRO-1: a share
    opt = shards * m.opt_traffic_per_param / m.mem_bw
    dp_comm += gather + gathers
    total = compute + tp_comm + cp_comm + ep_comm + pp_comm + bubble + dp_comm - dp_hidden + opt
    return {"total": total, "compute": compute, "tp_comm": tp_comm, "cp_comm": cp_comm, "ep_comm": ep_comm,
            "pp_comm": pp_comm,
            "bubble": bubble, "links": links,
            "dp_comm": dp_comm - dp_hidden, "dp_hidden": dp_hidden, "optimizer": opt, "micro_batches": micro,
            "w_share": w_share}


def model_flops_per_step(w: Workload) -> float:
    """The model's FLOPs per training step, forward and backward, recomputation not counted (model
    FLOPs): 72 (D M B) S L C^2 (1 + S / (6 C)) + 6 (D M B) S C V for the global batch of D M B
    sequences (Narayanan et al. 2021, eq. 3 without its recomputed forward); an MoE block's MLP (48 of the
    72) counted mlp_passes times, its active experts'. Other shapes (Llama's: grouped-query attention, a
    SwiGLU MLP, F) add 6 (D M B) S L (P - 12 C^2), P = layer_macs(), a block's multiply-adds per position."""
    DMB, S, L, C, V = w.global_batch, w.seq, w.n_layer, w.n_embd, w.vocab     # the global batch, D M B sequences
    moe = 6 * DMB * S * w.moe_layers * w.mlp_macs * (mlp_passes(w) - 1) if w.moe_layers else 0.0
    return 72 * DMB * S * L * C * C * (1 + S / (6 * C)) + 6 * DMB * S * C * V + moe + 6 * shape_macs(w)


def hardware_flops_per_step(w: Workload, recompute: bool) -> float:
    """FLOPs executed per step, the recomputed forward included: Narayanan et al. 2021, eq. 3,
    96 (D M B) S L C^2 (1 + S / (6 C) + V / (16 L C)) with full recomputation (how their Table 1
    counts), the model FLOPs without it (other shapes: + 8 (D M B) S L (P - 12 C^2))."""
    if not recompute:
        return model_flops_per_step(w)
    DMB, S, L, C, V = w.global_batch, w.seq, w.n_layer, w.n_embd, w.vocab     # the global batch, D M B sequences
    moe = 8 * DMB * S * w.moe_layers * w.mlp_macs * (mlp_passes(w) - 1) if w.moe_layers else 0.0
    return 96 * DMB * S * L * C * C * (1 + S / (6 * C) + V / (16 * L * C)) + moe + 8 * shape_macs(w)


def shape_macs(w: Workload) -> float:
    """(D M B) S L (P - 12 C^2): the multiply-adds per step of the blocks' GEMMs beyond GPT-2's 12 C^2 per
    position (P = layer_macs(), whole; 0 for GPT-2's shape)."""
    return w.global_batch * w.seq * w.n_layer * (w.layer_macs() - 12 * w.n_embd ** 2)


def achieved(m: Machine, w: Workload, lay: Layout, seconds: float) -> dict:
    """FLOP/s per rank at this step time (model FLOPs, and the FLOPs executed: hardware), and the
    model FLOPs' fraction of the machine's peak."""
    per_rank = model_flops_per_step(w) / seconds / lay.ranks
    return {"flops_per_rank": per_rank, "fraction_of_peak": per_rank / (m.peak_flops or m.gemm_flops),
            "hardware_flops_per_rank": hardware_flops_per_step(w, lay.recompute) / seconds / lay.ranks}
