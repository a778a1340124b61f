"""Tensor arithmetic shared by ops and fusions: linear layers (GEMMs, FP8, their saved
state), activations, norms, and parallelism (process groups and collectives)."""
