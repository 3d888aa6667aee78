"""A mixture-of-experts MLP (Switch Transformer, Fedus et al. 2021; GShard, Lepikhin et al. 2020):
a router sends each token to k of E expert MLPs, divided among the expert-parallel group.

Legend (docs/notation.md): B = batch, S = sequence, N = B S tokens, C = channels, E = experts,
k = experts per token, F = cfg.ffn (4C) an expert's width, F_i rank i's columns of it (tensor parallelism,
as in the dense MLP), E_i rank i's experts (expert parallelism, mpi_tp.parallel.expert_parallel).

    z = x W_r                       (N, C) @ (C, E) -> (N, E)     router logits; W_r replicated
    prob = softmax(z)               (N, E)
    top = top-k(prob)               (N, k)   best first; ties to the lower expert index
    g = prob_top     (k = 1)        (N, k)   Switch: the gate is the probability, so the router
        prob_top / sum prob_top (k > 1)      learns from the loss (a renormalised top-1 is always 1)
    a = admitted(top)               (N, k)   0/1: the capacity (below); all 1 when dropless
    y_j = sum_q a_jq g_jq FFN_{top_jq}(x_j)  token j, its q-th choice; FFN_e: the block's MLP
          + FFN_shared(x_j)                  (mpi_tp.model.experts): fc C -> F, GELU, proj F -> C
                                             (gpt2), or gate/up C -> F, SwiGLU, down F -> C (llama);
                                             FFN_shared: moe_shared_experts of them side by side

That is the default router (moe_router "softmax"); Mixtral's top-k-then-softmax and DeepSeek-V3's
sigmoid, normalised and scaled gates are in mpi_tp.model.routing, with the capacity and the losses.

Capacity (moe_capacity > 0): each sequence may send at most cap = ceil(moe_capacity * S * k / E)
assignments to an expert; they are admitted in order of choice rank, then position (every first
choice in position order, then the second choices, ...; moe_drop_policy "probs": the highest gates
first), and those past cap are dropped: they add
nothing (a token with every assignment dropped passes through the residual alone). Capacity is
per sequence and a replica holds whole sequences, so the same assignments are dropped at every
layout (tp, dp, ep).

Losses added to the model's (summed over MoE blocks, times their weights):
    aux = mean_b  E sum_e frac_be prob_be   frac_be: the fraction of sequence b's k S assignments
                                       (before dropping) that chose e; prob_be: prob_e averaged over
                                       b's positions. Its gradient flows through prob_be only
                                       (frac is piecewise constant).
    zl  = mean_j (logsumexp_e z_je)^2  router z-loss (ST-MoE, Zoph et al. 2022)
The mean over sequences averages over data-parallel replicas like the cross-entropy does.

Who routes what: every rank its own positions (mpi_tp.parallel.expert_tokens: a cp rank's positions cut
again over tp as sequence parallelism would; without it the tp ranks keep their slice of the same x and
the output is all-gathered back), so each decision is made once; the capacity and the losses read the
whole sequences' routing, gathered (k integers a position). Then: dispatch (all-to-all over ep), the
etp group's rows gathered, each local expert's column/row split over etp, the partial sums reduce-
scattered back (mpi_tp.parallel.expert_tensor), combine (all-to-all back). The groups: a stage's ranks
laid out again as etp x ep x edp (mpi_tp.parallel.expert_grid). The experts hold the dense MLP's shards
but not its ColumnParallelLinear/RowParallelLinear, which would communicate once per expert: here the
gather and the scatter happen once for all local experts. The shared experts run as the dense MLP does
(every position, split over tp, sequence parallel or not).

Backward: the gates are differentiated (the top-k selection and the admissions are piecewise
constant), then the softmax; the aux loss reaches p through P, the z-loss through lse, both
times the loss scale; the experts' gradient comes back by the inverse all-to-alls.

16-bit models (bf16, fp16): the router in fp32, as Megatron's --moe-router-dtype fp32 and every
MoE recipe run it: z = x W_r from the widened x and W_r, not rounded (a rounded logit moves a
near tie between two experts), then the softmax, the top-k, the gates, both losses and the
combine's weighted sum in fp32, y rounded once. What travels and what the experts compute stays
16-bit: the rows of the all-to-alls, the experts' GEMMs (mpi_tp.core.kernels_half), the etp reduce-scatter.
The backward sums in fp32 too (dgate, dz, the k choices' dx with the router's), rounding once.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy

from mpi_tp.core import backend
from mpi_tp.core import kernels as kern
from mpi_tp.core.module import Module
from mpi_tp.core.params import Buffer, make_param
from mpi_tp.core.precision import computed, is_half, stored, sum_rows
from mpi_tp.core.weight_grads import weight_grad
from mpi_tp.model.experts import Expert, SwiGLUExpert
from mpi_tp.model.routing import admitted, balance_loss, route, route_backward, z_loss
from mpi_tp.parallel.expert_parallel import DISPATCHERS, mark_expert
from mpi_tp.parallel.expert_tensor import ExpertRows
from mpi_tp.parallel.expert_tokens import Owners
from mpi_tp.parallel.sequence_parallel import (
    enter_tp,
    enter_tp_backward,
    gather_positions,
    gather_positions_backward,
    keep_positions,
    keep_positions_backward,
    leave_tp,
    leave_tp_backward,
)

# ---------------------------------------------------------------- layers

class MoEMLP(Module):
    """The mixture-of-experts MLP of block i (see the module docstring): (B, S, C) -> (B, S, C), or this
    rank's positions (B, S_i, C) under sequence or context parallelism.

    Holds the router (every rank; its gradient from this rank's positions, summed over tp: Param.sp_partial)
    and this rank's experts E_i, each its etp shard (expert e keyed by its name, so it has the same values
    wherever it lives). After a forward, on this replica's batch: `stats` holds aux_loss and z_loss
    (unweighted), tokens_per_expert (E,): the assignments each expert computed (after the capacity), and
    dropped: the assignments dropped; `routing` holds the (choice, admitted) arrays (B, S, k) of whole
    sequences; `loss_term` = aux_weight aux + z_weight zl, what the block adds to the model's loss. The
    backward adds that term's gradient times `loss_scale` (GPT.backward sets it to its dout, e.g. 1 /
    micro-batches; under cp times cp, as the cross-entropy's: mpi_tp.parallel.context_parallel).

    dropless (default False): when set, no assignment is dropped whatever moe_capacity says. For
    inference (GPT.moe_dropless): cached decoding runs one position at a time, where the
    per-sequence capacity (of S = 1) would admit other assignments than the full forward's.
    """

    loss_scale = 1.0
    dropless = False

    def __init__(self, name, cfg, topo, dtype, seed):
        self.E, self.k, self.capacity = cfg.moe_experts, cfg.moe_top_k, cfg.moe_capacity
        self.aux_weight, self.z_weight, self.tp = cfg.moe_aux_weight, cfg.moe_z_weight, topo.tp
        self.router_kind, self.topk_norm, self.gate_scale = cfg.moe_router, cfg.moe_topk_norm, cfg.moe_gate_scale
        self.by_probs, self.bias_rate = cfg.moe_drop_policy == "probs", cfg.moe_bias_rate
        self.router = make_param(f"{name}/router/weight", (cfg.n_embd, self.E), dtype, seed=seed,
                                 decay=True, sp_partial=topo.tp.size > 1)             # W_r (C, E)
        # the aux-loss-free balance (mpi_tp.parallel.expert_balance): a bias on the choice, moved after each step
        # by the experts' loads, counted in the backward (once per micro-batch, recomputed or not)
        fp = numpy.float32 if is_half(self.router.data) else self.router.data.dtype      # the router's arithmetic
        self.expert_bias = Buffer(f"{name}/router/expert_bias", backend.xp().zeros(self.E, fp))
        self.load = backend.xp().zeros(self.E, dtype=numpy.int64)
        self.dispatcher = DISPATCHERS[cfg.moe_dispatcher](self.E, topo.ep)
        self.etp = ExpertRows(topo.etp)
        expert = SwiGLUExpert if cfg.llama else Expert
        self.experts = [expert(f"{name}/experts/{e}", cfg, topo.etp, dtype, seed) for e in self.dispatcher.local]
        for e, expert_e in zip(self.dispatcher.local, self.experts):
            mark_expert(expert_e.parameters(), e, topo)
        # shared experts: one MLP n_shared F wide (the n MLPs side by side), every token, every ep rank
        wide = replace(cfg, intermediate_size=cfg.moe_shared_experts * cfg.ffn)
        self.shared = expert(f"{name}/shared", wide, topo.tp, dtype, seed) if cfg.moe_shared_experts else None
        self.stats, self.routing, self.loss_term = {}, None, 0.0

    def forward(self, x, ps=None):
        """(B, S, C) -> (B, S, C); under sequence parallelism (ps.sp) (B, S_i, C) -> (B, S_i, C), and under
        context parallelism a cp rank's positions (module docstring: who routes what)."""
        sp = None if ps is None else ps.sp
        cp = None if ps is None else ps.cp
        self._owners = owners = Owners(self.tp, x.shape[1], None if sp is None else sp.sizes, cp)
        self._cp = 1 if cp is None else cp.group.size
        own = keep_positions(x, self.tp, owners.sizes) if owners.sliced else x
        y = self._forward(own)
        if owners.sliced:
            y = gather_positions(y, self.tp, owners.sizes)
        if self.shared is None:
            return y
        xs, self._enter = enter_tp(x, self.tp, sp)                    # the shared experts: as the dense MLP
        B, S, C = xs.shape
        part = self.shared.forward(xs.reshape(B * S, C)).reshape(B, S, C)
        ys, self._leave = leave_tp(part, self.tp, sp)
        ys = computed(ys)
        if self.shared.proj_bias is not None:
            ys += self.shared.proj_bias.data                          # once, after the reduction
        return stored(computed(y) + ys, x.dtype)

    def backward(self, dout):
        owners = self._owners
        dx = None
        if self.shared is not None:
            d = leave_tp_backward(dout, self.tp, self._leave)        # whole, the same on every tp rank
            B, S, C = d.shape
            if self.shared.proj_bias is not None:                    # complete here: no sum over tp
                weight_grad(lambda p, g: p.accumulate(sum_rows(g)), self.shared.proj_bias, d.reshape(B * S, C))
            dx = enter_tp_backward(self.shared.backward(d.reshape(B * S, C)).reshape(B, S, C), self.tp, self._enter)
        d_own = gather_positions_backward(dout, self.tp, owners.sizes) if owners.sliced else dout
        dx_routed = self._backward(d_own)
        if owners.sliced:
            dx_routed = keep_positions_backward(dx_routed, self.tp, owners.sizes)
        return dx_routed if dx is None else stored(computed(dx) + computed(dx_routed), dout.dtype)

    def _forward(self, x):
        """This rank's positions (B, S_o, C) -> their output (B, S_o, C)."""
        xp = backend.array_module(x)
        owners = self._owners
        B, S_o, C = x.shape
        N, E, k = B * S_o, self.E, self.k
        x2 = x.reshape(N, C)
        z, _ = kern.linear_forward(computed(x2), computed(self.router.data))  # (N, C) -> (N, E), fp32 for 16 bits
        r = route(z, k, self.router_kind, self.topk_norm, self.gate_scale, self.expert_bias.data)
        choice, gate = r.choice, r.gate
        # the whole sequences' routing (mpi_tp.parallel.expert_tokens): the capacity and the balance loss
        choices = owners.whole(choice.reshape(B, S_o, k))                     # (B, S, k)
        priority = owners.whole(gate.reshape(B, S_o, k)) if self.by_probs else None
        keeps = admitted(choices, E, 0.0 if self.dropless else self.capacity, priority)
        keep = owners.mine(keeps).reshape(N, k)
        aux, daux, zl, dlse = self._losses(r, choices, B)
        self.loss_term = self.aux_weight * aux + self.z_weight * zl
        # Admitted assignments (token n, choice j), sorted by expert (so by destination rank too), in
        # (n, j) order within an expert; dropped ones sort last (expert E). The only copy to the host is
        # where each expert's run starts (E + 1 numbers), one sync per layer: MPI needs host counts.
        queue = xp.where(keep, choice, E).reshape(N * k)
        by_expert = xp.argsort(queue, kind="stable")
        starts = backend.asnumpy(xp.searchsorted(queue[by_expert], xp.arange(E + 1)))
        kept, M = numpy.diff(starts), int(starts[E])
        n_idx, j_idx = by_expert[:M] // k, by_expert[:M] % k
        plan = self.dispatcher.plan(kept)
        x_recv = self.dispatcher.dispatch(x2[n_idx], plan)                   # (M, C) -> (R, C)
        eplan = self.etp.plan(plan.expert_rows)
        y_send = self.dispatcher.combine(self._experts_forward(x_recv, plan, eplan), plan)   # (M, C)
        out = xp.zeros((N, k, C), dtype=x.dtype)                             # FFN_{c_nj}(x_n), 0 if dropped
        out[n_idx, j_idx] = y_send
        w = gate * keep                                                      # a g (N, k)
        y = stored(xp.einsum("nk,nkc->nc", w, computed(out)), x.dtype)      # in fp32, rounded once (16 bits)
        self.save_cache(x2, r, keep, w, out, n_idx, j_idx, plan, eplan, daux, dlse, choices)
        whole_kept = owners.sum(kept.copy(), "expert_counts") if owners.others else kept     # host: no sync
        self.stats = {"aux_loss": aux, "z_loss": zl, "tokens_per_expert": whole_kept,
                      "dropped": int(keeps.size - int(whole_kept.sum()))}
        self.routing = (choices, keeps)
        return y.reshape(B, S_o, C)

    def _losses(self, r, choices, B):
        """The balance loss and the z-loss of whole sequences from this rank's positions, and their gradients
        there: the mean probabilities and the squared log-normalisers summed over the owners (one all-reduce)."""
        xp = backend.array_module(r.p)
        E, owners = self.E, self._owners
        S, N_o = choices.shape[1], r.p.shape[0]
        sums = xp.concatenate([r.p.reshape(B, -1, E).sum(axis=1).reshape(-1), (r.lse * r.lse).sum().reshape(1)])
        sums = owners.sum(sums) if owners.others else sums
        aux, daux = balance_loss(sums[:-1].reshape(B, E) / S, choices, E, N_o)
        zl, dlse = z_loss(r.lse, sums[-1], B * S)
        return aux, daux, zl, dlse

    def _backward(self, dout):
        xp = backend.array_module(dout)
        x2, r, keep, w, out, n_idx, j_idx, plan, eplan, daux, dlse, choices = self.take_cache()
        if self.bias_rate:
            self.load += xp.bincount(choices.reshape(-1), minlength=self.E)
        N, _, C = out.shape
        dy = dout.reshape(N, C)
        # y = sum_j w_j out_j
        dy_c = computed(dy)
        dgate = xp.einsum("nkc,nc->nk", computed(out), dy_c) * keep
        dy_send = stored(w[n_idx, j_idx, None] * dy_c[n_idx], dout.dtype)   # (M, C): admitted rows only
        dy_recv = self.dispatcher.combine_backward(dy_send, plan)
        dx_recv = self._experts_backward(dy_recv, plan, eplan)
        dx_send = self.dispatcher.dispatch_backward(dx_recv, plan)
        dfull = xp.zeros_like(out)
        dfull[n_idx, j_idx] = dx_send
        dx = computed(dfull).sum(axis=1)                                     # (N, k, C) -> (N, C)
        # The router: the gates, the aux loss through p, the z-loss through lse (mpi_tp.model.routing), times
        # the loss's scale (and cp: each cp rank's positions are its part of the sum, as the cross-entropy's).
        scale = self.loss_scale * self._cp
        dp = (scale * self.aux_weight) * daux if self.aux_weight else None
        dlse = (scale * self.z_weight) * dlse if self.z_weight else None
        dz = route_backward(dgate, r, self.router_kind, self.topk_norm, self.gate_scale, dp, dlse)
        dx += kern.linear_backward_input(dz, computed(self.router.data))                # fp32 for 16 bits
        weight_grad(self._router_grad, dz, x2)
        return stored(dx, dout.dtype).reshape(dout.shape)

    def _router_grad(self, dz, x2):
        """W of the router: X^T dz in fp32, rounded once into a 16-bit gradient (this rank's positions)."""
        self.router.accumulate(kern.linear_backward_weight(dz, computed(x2))[0])

    def _experts_forward(self, x_recv, plan, eplan):
        """x_recv (R, C), this rank's received rows expert by expert -> their outputs (R, C): the etp group's
        rows gathered, each expert's shard on them, the partial sums scattered back, the proj bias added."""
        xs = self.etp.gather(x_recv, eplan)
        y = backend.array_module(xs).empty_like(xs)
        at = 0
        for expert, n in zip(self.experts, eplan.expert_rows):
            y[at:at + n] = expert.forward(xs[at:at + n])
            at += n
        y = self.etp.scatter(y, eplan)
        at = 0
        for expert, n in zip(self.experts, plan.expert_rows):
            if expert.proj_bias is not None:
                y[at:at + n] += expert.proj_bias.data                         # once, after the reduction
            at += n
        return y

    def _experts_backward(self, dy, plan, eplan):
        """dy (R, C) -> dx (R, C): dy gathered over etp (the scatter's gradient), each shard's backward, the
        partial dx reduce-scattered back (the gather's)."""
        dys = self.etp.scatter_backward(dy, eplan)
        dx = backend.array_module(dys).empty_like(dys)
        at = 0
        for expert, n in zip(self.experts, eplan.expert_rows):
            if expert.proj_bias is not None:                    # every etp member's rows: complete (W)
                weight_grad(lambda p, d: p.accumulate(sum_rows(d)), expert.proj_bias, dys[at:at + n])
            dx[at:at + n] = expert.backward(dys[at:at + n])
            at += n
        return self.etp.gather_backward(dx, eplan)

    def num_params(self) -> int:
        """Parameters of the whole layer: the router, all E experts (wherever they live), the shared ones."""
        def count(module):
            return sum(int(math.prod(p.global_shape)) for p in module.parameters())
        shared = 0 if self.shared is None else count(self.shared)
        return int(math.prod(self.router.global_shape)) + self.E * count(self.experts[0]) + shared
