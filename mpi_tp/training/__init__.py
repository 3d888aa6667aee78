"""Training: the run configuration, the data, the optimizers, pre-emption, and the loop."""
