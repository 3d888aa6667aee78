"""The ground floor: the array backend (NumPy or CuPy) and GPU staging, the pure forward/backward kernels,
parameter shards and the layer base class, and running under MPI without hangs (runtime, failpoints)."""
