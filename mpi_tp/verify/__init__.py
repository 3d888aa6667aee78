"""`mpi-tp verify`: a layout's training steps against the serial model's, tensor by tensor, on the user's own
model and options; the first difference named (step, parameter, shard, layer).

    reference.py     the serial model and its optimizer, started as the run was (seed, checkpoint or a
                     Hugging Face folder), and its step on the whole global batch
    shards.py        a rank's shards against the serial tensors by name: gradients (the optimizer's own
                     view, so ZeRO-1's shares too) and parameters
    activations.py   each layer's output per micro-batch, this rank's rows and positions of the serial one
    run.py           the steps, the table, the verdict
"""
