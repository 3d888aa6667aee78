"""The mixture of experts in the cost model: the experts' grid, their traffic, their memory per rank.

Legend: b the micro-batch, s = S / cp a rank's positions, C channels, F an expert's width (gpt2: 4C), E experts,
k per token, n shared experts, t = tp, e = etp (Layout.expert_tp), ep, edp = t cp dp / (e ep) (Layout.edp);
N_o = b s / t the tokens a rank routes (each rank its own positions: mpi_tp.parallel.expert_tokens);
a the share of the k N_o assignments admitted (admitted_share: 1 dropless, min(1, c) under a capacity c,
mpi_tp.model.routing.admitted: an expert takes at most c S k / E of a sequence's rows, and balanced routing
sends it S k / E); k_a = a k; R = e k_a N_o the rows its etp group's experts compute on it (balanced
routing). Per MoE block and micro-batch, as mpi_tp.model.moe runs it:

    compute      the routed experts' GEMMs k_a times a token's MLP (spread over the e ep edp ranks: 1/t of the
                 stage's tokens' k_a MLPs per rank, balanced), the n shared experts n times, split over tp
    dispatch     alltoall: 4 all-to-alls (dispatch, combine; forward, backward) of k_a N_o C values x (ep-1)/ep
                 from a rank, ep - 1 steps of alpha; allgather: 4 ring collectives (all-gather, reduce-scatter)
                 of the ep group's ep k_a N_o C values, (ep - 1)/ep of them on the wire: ep times the bytes
                 (the counts' exchange, E or ep E integers, is not priced)
    etp          an all-gather and an all-reduce (each member keeps its rows: mpi_tp.parallel.expert_tensor)
                 of R C values over etp, forward and backward
    tp           the output gathered back over tp (no sequence parallelism), forward and backward (b s C);
                 the routing of whole sequences: 3 small collectives over tp (and cp), 1 alpha each; the
                 shared experts' f and g as the dense MLP's. The dense MLP's two all-reduces are not run.
    gradients    an expert shard's over edp (on the link the edp group crosses: expert_grid_links); the
                 router's and the shared experts' with the dense ones

Memory (moe_block_bytes): the activations one MoE block keeps on a rank in place of the dense MLP's (its own
tokens' input, router state in fp32, the k outputs per token, each expert's rows and hidden widths, the
shared experts' dense-MLP terms), and the parameters (expert_params_rank): E / ep experts' 1/e shards.
Checked against the memory a step measures: experiments/memory/moe_memory.py.
"""
from __future__ import annotations

import math

from mpi_tp.planning.links import link, ring_all_gather, ring_all_reduce

DISPATCHERS = ("alltoall", "allgather")


def admitted_share(w) -> float:
    """The share of the k assignments an expert admits under balanced routing: 1 dropless (capacity 0), else
    min(1, capacity) (each expert is sent S k / E of a sequence's rows and admits ceil(c S k / E))."""
    return min(1.0, w.capacity) if w.capacity > 0 else 1.0


def mlp_passes(w) -> float:
    """A token's MLP passes in an MoE block: k a routed (admitted) ones and the n shared experts'."""
    return w.top_k * admitted_share(w) + w.shared_experts


def expert_grid_links(lay, per_node: int) -> dict:
    """{"etp", "ep", "edp"}: "node" or "network", for the experts' groups of the first stage (expert_grid:
    a stage's place d = (dp_r cp + cp_r) tp + tp_r read again as (edp_r ep + ep_r) etp + etp_r)."""
    t, c, d, p = lay.tp, lay.cp, lay.dp, lay.pp
    e, ep = lay.expert_tp, lay.ep
    D = t * c * d

    def world(x):                    # a stage place -> its world rank (stage 0): tp fastest, cp, then dp past pp
        return (x // (t * c)) * (t * c * p) + x % (t * c)

    def crosses(stride, size):
        if size <= 1:
            return False
        leaders = range(0, min(D, 4 * per_node + stride * size))
        return any(len({world(g + i * stride) // per_node for i in range(size)}) > 1
                   for g in leaders if (g // stride) % size == 0 and g + (size - 1) * stride < D)
    on = {"etp": crosses(1, e), "ep": crosses(e, ep), "edp": crosses(e * ep, lay.edp)}
    return {k: "network" if v else "node" for k, v in on.items()}


def moe_step_terms(m, w, lay, links: dict, micro: float, b: int, s: float, fwd_bwd: int, mlp_share: float,
                   moe_layers: int, gemm_rate) -> dict:
    """Seconds per step on a rank for this stage's MoE blocks: {"compute" (beyond one dense MLP pass, already
    counted), "tp" (their tp traffic minus the dense MLP's two all-reduces), "ep", "etp"}."""
    h, k, t, v = w.n_embd, w.top_k * admitted_share(w), lay.tp, m.bytes_per_value
    e, ep = lay.expert_tp, lay.ep
    extra = mlp_passes(w) - 1                                 # MLP passes beyond the one counted
    compute = micro * extra * fwd_bwd * 2 * b * s * w.mlp_macs * mlp_share * moe_layers / gemm_rate(m, b * s)
    ta, tbw = link(links["tp"], m)
    n = b * s * h * v                                         # one micro-batch's activation, whole
    n_o = n / t                                               # a rank's own positions
    dense_mlp = 2 * ring_all_reduce(n, t, ta, tbw)            # the dense MLP's f and g: not run
    shared = dense_mlp if w.shared_experts else 0.0           # the shared experts' f and g (or SP's AG, RS)
    gather_out = 0.0 if lay.sp else 2 * ring_all_gather(n, t, ta, tbw)
    routing = 3 * (t - 1) * ta if t > 1 else 0.0
    tp = micro * moe_layers * (shared + gather_out + routing - dense_mlp)
    xa, xbw = link(expert_grid_links(lay, m.ranks_per_node)["etp"] if e != t else links["tp"], m)
    rows = e * k * n_o                                        # the etp group's rows, in bytes
    etp = micro * moe_layers * 2 * (ring_all_gather(rows, e, xa, xbw) + ring_all_reduce(rows, e, xa, xbw))
    ep_comm = 0.0
    if ep > 1:
        ea, ebw = link(expert_grid_links(lay, m.ranks_per_node)["ep"], m)
        if lay.dispatcher == "allgather":
            ep_comm = micro * moe_layers * 4 * ring_all_gather(ep * k * n_o, ep, ea, ebw)
        else:
            ep_comm = micro * moe_layers * 4 * ((ep - 1) * ea + k * n_o * (ep - 1) / ep / ebw)
    return {"compute": compute, "tp": tp, "etp": etp, "ep": ep_comm}


def expert_params_rank(w, lay, moe_layers: int) -> float:
    """The routed experts' parameters on a rank of a stage of moe_layers MoE blocks: E / ep experts (the first
    E % ep ranks one more), each its 1/etp shard of fc (weight and bias) and proj's weight, proj's bias whole
    (llama: gate, up and down, no biases)."""
    return moe_layers * math.ceil(w.experts / lay.ep) * mlp_params_rank(w, lay, 1, lay.expert_tp)


def mlp_params_rank(w, lay, width: int = 1, split: int | None = None) -> float:
    """A dense MLP `width` expert widths wide on a rank: its matrices and fc's bias split over tp (or `split`
    ranks), proj's bias whole (the shared experts are one such MLP; 0 wide: none)."""
    if not width:
        return 0.0
    bias = w.n_embd * w.biases                                 # proj's, whole
    return (w.mlp_params(width) - bias) / (split or lay.tp) + bias


def moe_block_bytes(m, w, lay) -> float:
    """Activations one MoE block keeps on a rank for one micro-batch, in place of the dense MLP's (balanced
    routing, the admitted share of the assignments): the module docstring's list, at the value width (router
    state: fp32 or wider)."""
    C, k, E, t, e = w.n_embd, w.top_k, w.experts, lay.tp, lay.expert_tp
    k_a = k * admitted_share(w)                               # the admitted assignments per token
    v, f = m.bytes_per_value, max(m.bytes_per_value, 4)
    s_cp = w.seq / lay.cp
    n_o = lay.micro_batch * s_cp / t                          # own tokens
    rows = e * k_a * n_o                                      # the etp group's rows, on this rank
    F = w.ffn
    routed = (n_o * C * v                                     # the input rows it routes
              + n_o * E * f + 3 * n_o * f                     # probabilities; lse, its gradient, a spare
              + n_o * k * (2 * f + 1 + 8)                     # gates twice, admitted, choices
              + n_o * k_a * 2 * 8                             # the admitted rows' token and choice indices
              + n_o * k * C * v                               # each choice's output
              + lay.micro_batch * w.seq * k * 8               # the whole sequences' choices
              + rows * 8                                      # the etp order
              + rows * (C + w.mlp_kept * F / e) * v)          # the experts: input rows, mlp_kept F-wide arrays
    if w.shared_experts:                                      # the dense MLP's terms, n wide
        whole = lay.micro_batch * s_cp / (t if lay.sp else 1)
        routed += whole * C * v + w.mlp_kept * lay.micro_batch * s_cp * w.shared_experts * F / t * v
    return routed


def dense_mlp_bytes(m, w, lay) -> float:
    """What a dense block's MLP keeps (the fc input and Workload.mlp_kept F-wide arrays: gpt2 the GELU's input
    and tanh, the projection's input)."""
    s = lay.micro_batch * w.seq / lay.cp
    return (s * w.n_embd / (lay.tp if lay.sp else 1) + w.mlp_kept * s * w.ffn / lay.tp) * m.bytes_per_value
