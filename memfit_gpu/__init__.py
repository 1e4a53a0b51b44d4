"""memfit_gpu: MemFit long-term conversational memory, batched on GPUs (arXiv 2610.00872)."""

__version__ = "0.1.0"
