"""The `mpi-tp` command and its subcommands, a module per family: cli (the parser, and train),
checkpoints (eval, generate, inspect, export), hf (import-hf, export --format hf), serve, tokenize,
bench, plan, explain and exercise (calibrate's is mpi_tp.planning.calibrate); common holds the options
and helpers several of them share. The library they call never imports them."""
