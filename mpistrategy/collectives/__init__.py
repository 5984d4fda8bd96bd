"""Differentiable MPI collectives and point-to-point ops on torch tensors, one family per module."""
