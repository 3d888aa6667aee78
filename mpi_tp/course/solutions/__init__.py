"""The reference solutions of the exercises: `mpi-tp exercise N --solution` checks them (and CI does)."""
