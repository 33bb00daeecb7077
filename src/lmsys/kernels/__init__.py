"""Attention kernels: the dispatch switch, the PyTorch tiled FlashAttention-2 and the Triton kernels."""
