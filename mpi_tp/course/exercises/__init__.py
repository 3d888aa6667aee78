"""The broken variants: `mpi-tp exercise N --copy DIR` writes one of these for the student to fix."""
