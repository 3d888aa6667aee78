"""The mutation check: one-line breaks of the mechanisms mpi_tp teaches, and the tests that must catch
them (tests/mutation/check.py runs them; docs/testing.md says when)."""
