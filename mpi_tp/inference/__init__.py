"""Using a trained (tensor-parallel) model: sampling text."""
