"""Triton kernels for the retrieval hot path, each with a torch reference (packaged as memfit_gpu.kernels)."""
