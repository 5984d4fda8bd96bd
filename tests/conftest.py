"""Shared test configuration: registers the multi-rank MPI harness (see mpi_harness.py)."""

pytest_plugins = ["tests.mpi_harness"]
