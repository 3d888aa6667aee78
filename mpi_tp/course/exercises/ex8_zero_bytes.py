"""Exercise 8: predict what ZeRO-1 sends and what it saves.

Data parallelism over D replicas (no tensor, pipeline or context parallelism):
each rank holds the whole model, num_params parameter values of param_bytes bytes each,
and their gradients, grad_bytes each (a bf16 model's gradients are bf16 unless
--fp32-grads makes them fp32). One training step with AdamW, two ways:

- zero False: the gradient buckets are all-reduced over the D replicas, and
  every rank runs the same AdamW update on all num_params values;
- zero True (--zero 1, the distributed optimizer): a reduce-scatter leaves each
  rank the summed gradients of its 1/D share of each bucket, it updates that
  share, and an all-gather brings every rank the updated parameters.

Predict, for one rank and one step:

- dp_wire_bytes: the wire bytes of the data-parallel gradient and parameter
  collectives (ring algorithm; the loss's and the gradient norm's 8-byte
  all-reduces are left out);
- state_bytes: the bytes of the optimizer's state (AdamW's m and v, and the fp32
  master copies it keeps of 16-bit parameters), not the parameters or gradients.

Write both as formulas of num_params, D, grad_bytes, param_bytes and zero, then check them
against real steps (fp32, bf16, bf16 with fp32 gradients) at D = the job's
world size:

    mpiexec -n 2 mpi-tp exercise 8 --file exercise8.py

Read docs/notation.md ("Bytes") and docs/course.md lesson 14's opening first.
"""

# ======== EXERCISE 8: fix these two predictions ========


def dp_wire_bytes(num_params, D, grad_bytes, param_bytes, zero):
    """Wire bytes one rank sends for the gradients (and, with ZeRO-1, the parameters) in one step."""
    all_reduce = 2 * (D - 1) / D * num_params * grad_bytes
    if zero:
        return all_reduce * 2          # the same all-reduce, and an all-gather of the parameters besides
    return all_reduce


def state_bytes(num_params, D, grad_bytes, param_bytes, zero):
    """Bytes of optimizer state one rank keeps."""
    return 2 * num_params * param_bytes         # m and v, one value each per parameter

# ======== end of EXERCISE 8 ========
