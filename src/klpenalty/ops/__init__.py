"""Implementations of the exact-KL math: the float64 reference and the fast backends."""
