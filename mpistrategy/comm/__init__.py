"""Plain MPI plumbing for torch tensors (no autograd): buffers, communicators, headers and checks."""
