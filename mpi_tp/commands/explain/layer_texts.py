"""What `mpi-tp explain --layer <layer>` says about each layer before the counters: the split, where it
communicates, and (SP_LESSONS) how sequence parallelism changes that. The counters printed after each
text are the check that it is true (tests/test_explain.py holds the two together)."""

LESSONS = {
    "column": "ColumnParallelLinear, Y = X A + b: A (C, O) is cut by its O output columns, "
              "A = [A_0 | ... | A_{T-1}], "
              "and rank i computes its columns Y_i = X A_i + b_i with no communication. X must be whole on "
              "every rank, so it enters through f: identity forward, all-reduce of dX backward (each rank's "
              "columns give part of dX). Y_i stays split here (gather_output=True would all-gather it).",
    "row": "RowParallelLinear, Y = X A + b: A (K, C) is cut by its K input rows, A = [A_0; ...; A_{T-1}], and X by "
           "columns to match (a column layer's output already is). Rank i computes the partial sum X_i A_i, "
           "and g all-reduces the partials (identity backward). The bias is replicated and added once, "
           "after the reduce.",
    "mlp": "ParallelMLP: fc is column-parallel (C -> F, rank i keeps F_i columns), GELU works on each "
           "rank's columns, and proj is row-parallel over the same F_i rows (F -> C). The column layer's "
           "output is exactly the row layer's input, so the MLP needs one all-reduce forward (g after "
           "proj) and one backward (f before fc).",
    "attention": "ParallelAttention: the H heads are split, rank i keeps H_i whole heads. q, k and v are "
                 "column-parallel (rank i's columns are its heads; one GEMM behind one f), attention is "
                 "local to each head, and the output projection is row-parallel over the same columns, "
                 "followed by g: one all-reduce each way.",
    "block": "Block: x + attn(ln_1(x)), then + mlp(ln_2(x)), each half split as its layer is. The "
             "LayerNorms, residuals and row biases are replicated: every rank computes them on the same "
             "data. Two all-reduces forward (the two g's) and two backward (the two f's).",
}
# Under sequence parallelism the same layers communicate differently: the texts say what the counters show.
SP_LESSONS = {
    "column": "ColumnParallelLinear under sequence parallelism: X arrives split by positions (rank i holds "
              "S_i of them), so f becomes an all-gather of the positions (backward: a reduce-scatter that "
              "sums the partial dX and keeps rank i's positions). Then rank i computes its columns "
              "Y_i = X A_i + b_i over the whole sequence; Y_i stays split by columns. The layer keeps only "
              "its S_i positions of X for the backward pass and all-gathers them again there for dA_i = "
              "X^T dY_i (the regather: 1/T of X's memory for one more all-gather).",
    "row": "RowParallelLinear under sequence parallelism: rank i computes the partial sum X_i A_i over the "
           "whole sequence, and g becomes a reduce-scatter: sum the partials, keep rank i's S_i positions "
           "(backward: an all-gather of dY). The replicated bias is added to those positions only, so its "
           "gradient is a part of the whole: one all-reduce sums it over the group.",
    "mlp": "ParallelMLP under sequence parallelism: an all-gather of the positions before fc (f's place) "
           "and a reduce-scatter after proj (g's place); backward, the reverse. proj's replicated bias "
           "gradient is summed by one small all-reduce. No all-reduce of activations at all, and the same "
           "bytes on the wire as plain TP's two all-reduces, plus fc's regather of its kept input shard.",
    "attention": "ParallelAttention under sequence parallelism: an all-gather of the positions before the "
                 "q/k/v GEMM (each rank needs every position to attend over), attention on rank i's H_i "
                 "heads, and a reduce-scatter after the output projection; backward, the reverse, plus the "
                 "q/k/v layer's regather of its kept input shard and one small all-reduce of the "
                 "projection's replicated bias gradient.",
    "block": "Block under sequence parallelism: the LayerNorms, residuals and dropout work on rank i's S_i "
             "positions only. Two all-gathers and two reduce-scatters forward, two of each backward, the "
             "two column layers' regathers of their kept input shards, and one small all-reduce of the "
             "replicated parameters' gradients (LayerNorms, row biases), which each rank computed from "
             "its own positions. Every activation the block keeps is 1/T of the serial block's.",
}
# With --kv-heads K < H (grouped-query attention, a Llama attention: rotary q and k, no biases), after LESSONS'.
GQA_LESSON = ("Grouped-query attention: H_kv = {H_kv} key/value heads serve the H = {H} query heads, R = {R} "
              "each (query head h reads key/value head h // R), so k and v have H_kv hs columns, not H hs. The "
              "query heads go with the key/value heads they read: when H_kv >= T the key/value heads are divided "
              "among the ranks and rank i takes the R query heads of each of its own; when H_kv < T the ranks "
              "are divided among the key/value heads and every rank holds a replica of the one its query "
              "heads read. A replica's gradient is its own query heads' part: after the backward pass the "
              "replicas sum theirs (kv_grad_all_reduce, once per step), so they stay equal. The rotary "
              "embedding turns q and k inside each head: no communication.")
