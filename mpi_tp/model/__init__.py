"""The GPT, split across the tensor-parallel group: the column and row split (parallel_linear), the
vocabulary split (parallel_embedding, parallel_cross_entropy), attention split by heads, the MLP, the
block and the whole model (gpt)."""
