"""The GPT, split across the tensor-parallel group: the column and row split (parallel_linear), the
vocabulary split (parallel_embedding, parallel_cross_entropy), attention split by heads, the MLP, the
experts (moe), and the pieces the model is composed of: embedding (pre-process), block, head
(post-process); gpt composes them into the whole model or one pipeline chunk, chunks builds a stage's."""
