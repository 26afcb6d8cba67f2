"""Triton kernels: tree attention and fused divergences."""
