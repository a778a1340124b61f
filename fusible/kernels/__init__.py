"""Kernels: Triton versions for CUDA, each with a plain-PyTorch fallback used elsewhere."""
