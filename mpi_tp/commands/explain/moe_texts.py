"""What `mpi-tp explain --layer moe` says (mpi_tp.commands.explain.moe runs the lesson and counts): the layer in
words, beside the dense MLP, each collective's role, and what the router options make of the logits."""
from __future__ import annotations

from mpi_tp.model.routing import normalises

LESSON = ("MoEMLP: a router (W_r, C x E, whole on every rank) scores each token; its k best experts take it, "
          "weighted by the gates, and each sequence may send at most cap = ceil(capacity x S x k / E) "
          "assignments to one expert (the rest are dropped: {drop}). The E "
          "experts are whole MLPs (C -> 4C -> C) divided among the ep ranks; each ep rank is a data-parallel "
          "replica with tokens of its own. Dispatch: one all-to-all of the row counts, then an Alltoallv "
          "carries every admitted row to its expert's rank; combine: the inverse Alltoallv brings the "
          "results back. Backward: the same two exchanges in reverse (combine's gradient is a dispatch). "
          "With --tp > 1 each tp rank routes its own slice of the positions (each decision is made once; the "
          "capacity and the losses read the whole sequences' choices, all-gathered), and each expert is split "
          "column/row over the tp ranks (its etp group): the group's dispatched rows are all-gathered, every "
          "rank computes its columns of every local expert on all of them, an all-reduce sums the partial "
          "outputs (each rank keeps its own rows), and the output is all-gathered back over tp. With --moe-dispatcher allgather an all-gather carries every rank's "
          "rows to every rank instead, each keeps its experts' rows, and a reduce-scatter sums the results "
          "(zeros but the owner's) back to their senders: more bytes, no count exchange, the same numbers.")
DENSE = ("Beside the dense MLP (mpi-tp explain --layer mlp): there every rank holds every token and a slice "
         "of every weight, and the activations are all-reduced (g forward, f backward), whatever the routing. "
         "Here every rank holds whole experts and only its own tokens, and the tokens travel: an all-to-all "
         "of the rows that leave the rank (k per token, fewer when dropped) instead of an all-reduce of "
         "every activation.")
ROLES = {
    ("forward", "ep/all_to_all"): "the row counts per expert, before the rows",
    ("forward", "ep/all_to_allv"): "dispatch the rows to the experts' ranks, combine the results back",
    ("backward", "ep/all_to_allv"): "output gradients to the experts, input gradients back",
    ("forward", "ep/all_gather_counts"): "every rank's row counts per expert (all-gather dispatcher)",
    ("forward", "ep/all_gather"): "every rank's rows to every rank; each keeps its experts' (dispatch)",
    ("forward", "ep/reduce_scatter"): "the results, zeros but the owner's, summed back to each sender (combine)",
    ("backward", "ep/all_gather"): "every output gradient row to every rank (combine's gradient)",
    ("backward", "ep/reduce_scatter"): "the input gradients summed back to each sender (dispatch's gradient)",
    ("forward", "tp/routing"): "every position's k choices, for the capacity and the balance loss",
    ("forward", "tp/routing_sums"): "the mean probabilities and the z-loss's sum over the sequences' owners",
    ("forward", "tp/etp_counts"): "rows per local expert of every etp member",
    ("forward", "tp/expert_counts"): "each expert's admitted rows of the whole sequences (the metrics)",
    ("forward", "tp/etp_gather"): "the etp group's rows, to every member (each computes its columns)",
    ("forward", "tp/etp_reduce"): "the partial outputs summed (all-reduce), each member keeps its own rows",
    ("forward", "tp/all_gather"): "the output of every rank's positions, back to every tp rank",
    ("backward", "tp/etp_gather"): "the output gradients of the group's rows, to every member",
    ("backward", "tp/etp_reduce"): "the partial input gradients summed (all-reduce), each member keeps its rows",
    ("backward", "tp/all_gather"): "the input gradient of every rank's positions, back to every tp rank",
}


ROUTERS = {"softmax": "prob = softmax(z) over the E experts, the k most probable take the token, gates prob_top",
           "topk-softmax": "the k largest logits z take the token, gates a softmax over those k alone (Mixtral)",
           "sigmoid": "s = sigmoid(z) for each expert on its own, the k largest take the token, gates s_top "
                      "(DeepSeek-V3)"}
DROPS = {"position": "first choices first, then by position", "probs": "the highest gates first"}


def router_text(cfg) -> str:
    """What --moe-router, --moe-topk-norm and --moe-gate-scale make of the logits z = x W_r."""
    norm = ("divided by their sum" if normalises(cfg.moe_router, cfg.moe_topk_norm, cfg.moe_top_k)
            else "not normalised (they need not sum to 1)")
    scale = f", then times {cfg.moe_gate_scale:g}" if cfg.moe_gate_scale != 1.0 else ""
    return f"router {cfg.moe_router}: {ROUTERS[cfg.moe_router]}; the k gates {norm}{scale}"
