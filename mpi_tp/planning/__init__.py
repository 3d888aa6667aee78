"""Choosing a layout before running it: the cost model, this machine's constants (calibrate), the planner."""
