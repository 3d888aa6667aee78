"""The `mpi-tp` command and its subcommands (train, eval, generate, inspect, export, bench, plan,
calibrate, explain)."""
