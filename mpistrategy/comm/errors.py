"""Exceptions raised by the MPI layer."""


class CommunicationError(RuntimeError):
    """Ranks disagree about a collective (shape, dtype, op or root), or an MPI call failed."""
