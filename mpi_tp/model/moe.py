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

Communication: dispatch (all-to-all over ep), f on the rows received, each local expert's
column/row split, one g (all-reduce over tp) for all of them, then combine (all-to-all back).
The router and the gates are computed alike on every tp rank (replicated, like a LayerNorm).
The experts hold the dense MLP's shards but not its ColumnParallelLinear/RowParallelLinear,
which would communicate once per expert: here f and g happen once for all local experts.

Backward: the gates are differentiated (the top-k selection and the admissions are piecewise
constant), then the softmax; the aux loss reaches p through P, the z-loss through lse, both
times the loss scale; the experts' gradient comes back by the inverse all-to-alls.

16-bit models (bf16, fp16): the router in fp32, as Megatron's --moe-router-dtype fp32 and every
MoE recipe run it: z = x W_r from the widened x and W_r, not rounded (a rounded logit moves a
near tie between two experts), then the softmax, the top-k, the gates, both losses and the
combine's weighted sum in fp32, y rounded once. What travels and what the experts compute stays
16-bit: the rows of the all-to-alls, the experts' GEMMs (mpi_tp.core.kernels_half), g's all-reduce.
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
from mpi_tp.parallel.sequence_parallel import (
    gather_positions,
    gather_positions_backward,
    keep_positions,
    keep_positions_backward,
)
from mpi_tp.parallel.tensor_parallel import copy_to_tp_backward, reduce_from_tp

# ---------------------------------------------------------------- layers

class MoEMLP(Module):
    """The mixture-of-experts MLP of block i (see the module docstring): (B, S, C) -> (B, S, C).

    Holds the router (every rank) and this rank's experts E_i (expert e keyed by its name, so it
    has the same values wherever it lives). After a forward, on this replica's batch: `stats` holds
    aux_loss and z_loss (unweighted), tokens_per_expert (E,): the assignments each expert computed
    (after the capacity), and dropped: the assignments dropped; `routing` holds the (choice,
    admitted) arrays (B, S, k); `loss_term` = aux_weight aux + z_weight zl, what the block adds to
    the model's loss. The backward adds that term's gradient times `loss_scale` (GPT.backward
    sets it to its dout, e.g. 1 / micro-batches).

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
                                 decay=True)                                          # W_r (C, E)
        # the aux-loss-free balance (mpi_tp.parallel.expert_balance): a bias on the choice, moved after each step
        # by the experts' loads, counted in the backward (once per micro-batch, recomputed or not)
        fp = numpy.float32 if is_half(self.router.data) else self.router.data.dtype      # the router's arithmetic
        self.expert_bias = Buffer(f"{name}/router/expert_bias", backend.xp().zeros(self.E, fp))
        self.load = backend.xp().zeros(self.E, dtype=numpy.int64)
        self.dispatcher = DISPATCHERS[cfg.moe_dispatcher](self.E, topo.ep)
        expert = SwiGLUExpert if cfg.llama else Expert
        self.experts = [expert(f"{name}/experts/{e}", cfg, topo.tp, dtype, seed) for e in self.dispatcher.local]
        for e, expert_e in zip(self.dispatcher.local, self.experts):
            mark_expert(expert_e.parameters(), e, topo)
        # shared experts: one MLP n_shared F wide (the n MLPs side by side), every token, every ep rank
        wide = replace(cfg, intermediate_size=cfg.moe_shared_experts * cfg.ffn)
        self.shared = expert(f"{name}/shared", wide, topo.tp, dtype, seed) if cfg.moe_shared_experts else None
        self.stats, self.routing, self.loss_term = {}, None, 0.0

    def forward(self, x, ps=None):
        """(B, S, C) -> (B, S, C); under sequence parallelism (ps.sp) (B, S_i, C) -> (B, S_i, C): the positions are
        gathered first (the router and the per-sequence capacity need whole sequences) and the output,
        the same on every tp rank, is cut back to this rank's positions."""
        if ps is None or ps.sp is None or self.tp.size == 1:
            self._sizes = None
            return self._forward(x)
        self._sizes = list(ps.sp.sizes)
        return keep_positions(self._forward(gather_positions(x, self.tp, self._sizes)), self.tp, self._sizes)

    def backward(self, dout):
        if self._sizes is None:
            return self._backward(dout)
        dout = keep_positions_backward(dout, self.tp, self._sizes)
        return gather_positions_backward(self._backward(dout), self.tp, self._sizes)

    def _forward(self, x):
        xp = backend.array_module(x)
        B, S, C = x.shape
        N, E, k = B * S, self.E, self.k
        x2 = x.reshape(N, C)
        z, _ = kern.linear_forward(computed(x2), computed(self.router.data))  # (N, C) -> (N, E), fp32 for 16 bits
        router = x2                                                          # the cache: x, not W_r (read again)
        r = route(z, k, self.router_kind, self.topk_norm, self.gate_scale, self.expert_bias.data)
        choice, gate = r.choice, r.gate
        priority = gate.reshape(B, S, k) if self.by_probs else None
        keep = admitted(choice.reshape(B, S, k), E, 0.0 if self.dropless else self.capacity, priority)
        aux, daux = balance_loss(r.p.reshape(B, S, E), choice.reshape(B, S, k), E)
        zl, dlse = z_loss(r.lse)
        self.loss_term = self.aux_weight * aux + self.z_weight * zl
        keep = keep.reshape(N, k)
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
        y_send = self.dispatcher.combine(self._experts_forward(x_recv, plan.expert_rows), plan)   # (M, C)
        out = xp.zeros((N, k, C), dtype=x.dtype)                             # FFN_{c_nj}(x_n), 0 if dropped
        out[n_idx, j_idx] = y_send
        w = gate * keep                                                      # a g (N, k)
        y = xp.einsum("nk,nkc->nc", w, computed(out))                       # in fp32, rounded once (16 bits)
        if self.shared is not None:
            y += computed(self._experts_forward(x2, [N], [self.shared]))
        y = stored(y, x.dtype)
        self.save_cache(router, r, keep, w, out, n_idx, j_idx, plan, daux, dlse)
        self.stats = {"aux_loss": aux, "z_loss": zl, "tokens_per_expert": kept,
                      "dropped": int(N * k - int(kept.sum()))}
        self.routing = (choice.reshape(B, S, k), keep.reshape(B, S, k))
        return y.reshape(B, S, C)

    def _backward(self, dout):
        xp = backend.array_module(dout)
        router, r, keep, w, out, n_idx, j_idx, plan, daux, dlse = self.take_cache()
        if self.bias_rate:
            self.load += xp.bincount(r.choice.reshape(-1), minlength=self.E)
        N, _, C = out.shape
        dy = dout.reshape(N, C)
        # y = sum_j w_j out_j (+ the shared experts' output)
        dy_c = computed(dy)
        dgate = xp.einsum("nkc,nc->nk", computed(out), dy_c) * keep
        dy_send = stored(w[n_idx, j_idx, None] * dy_c[n_idx], dout.dtype)   # (M, C): admitted rows only
        dy_recv = self.dispatcher.combine_backward(dy_send, plan)
        dx_send = self.dispatcher.dispatch_backward(self._experts_backward(dy_recv, plan.expert_rows), plan)
        dfull = xp.zeros_like(out)
        dfull[n_idx, j_idx] = dx_send
        dx = computed(dfull).sum(axis=1)                                     # (N, k, C) -> (N, C)
        if self.shared is not None:
            dx += computed(self._experts_backward(dy, [N], [self.shared]))
        # The router: the gates, the aux loss through p, the z-loss through lse (mpi_tp.model.routing).
        dp = (self.loss_scale * self.aux_weight) * daux if self.aux_weight else None
        dlse = (self.loss_scale * self.z_weight) * dlse if self.z_weight else None
        dz = route_backward(dgate, r, self.router_kind, self.topk_norm, self.gate_scale, dp, dlse)
        x2 = router
        dx += kern.linear_backward_input(dz, computed(self.router.data))                # fp32 for 16 bits
        weight_grad(self._router_grad, dz, x2)
        return stored(dx, dout.dtype).reshape(dout.shape)

    def _router_grad(self, dz, x2):
        """W of the router: X^T dz in fp32, rounded once into a 16-bit gradient."""
        self.router.accumulate(kern.linear_backward_weight(dz, computed(x2))[0])

    def _experts_forward(self, x_recv, rows, experts=None):
        """x_recv (R, C), whole on every tp rank (f), expert by expert (rows[i] rows each; experts: this
        rank's routed ones, or [self.shared]) -> outputs (R, C) after one g."""
        experts = self.experts if experts is None else experts
        y = backend.array_module(x_recv).empty_like(x_recv)
        at = 0
        for expert, n in zip(experts, rows):
            y[at:at + n] = expert.forward(x_recv[at:at + n])
            at += n
        y = reduce_from_tp(y, self.tp)                                       # g: the partial sums
        at = 0
        for expert, n in zip(experts, rows):
            if expert.proj_bias is not None:
                y[at:at + n] += expert.proj_bias.data                         # once, after the reduce
            at += n
        return y

    def _experts_backward(self, dy, rows, experts=None):
        """dy (R, C), the same on every tp rank (g's gradient) -> dx (R, C) after one all-reduce (f's)."""
        experts = self.experts if experts is None else experts
        dx = backend.array_module(dy).empty_like(dy)
        at = 0
        for expert, n in zip(experts, rows):
            if expert.proj_bias is not None:                                # an fp32 sum at 16 bits (W)
                weight_grad(lambda p, d: p.accumulate(sum_rows(d)), expert.proj_bias, dy[at:at + n])
            dx[at:at + n] = expert.backward(dy[at:at + n])
            at += n
        return copy_to_tp_backward(dx, self.tp)

    def num_params(self) -> int:
        """Parameters of the whole layer: the router, all E experts (wherever they live), the shared ones."""
        def count(module):
            return sum(int(math.prod(p.global_shape)) for p in module.parameters())
        shared = 0 if self.shared is None else count(self.shared)
        return int(math.prod(self.router.global_shape)) + self.E * count(self.experts[0]) + shared
