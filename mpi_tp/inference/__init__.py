"""Using a trained (tensor-parallel) model: sampling and generating text, serving it, and its loss on a
text (evaluate)."""
