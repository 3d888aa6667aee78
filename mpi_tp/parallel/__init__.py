"""How ranks cooperate: the process grid (topology), every collective, counted (collectives, on the
buffers of buffers), the tensor-parallel regions f and g (tensor_parallel), their sequence-parallel forms
(sequence_parallel), gradient buckets over replicas (data_parallel), the node-by-node all-reduce
(hierarchical), expert parallelism's exchanges (expert_parallel), the gradients made final once per step
(finalize), pipelines (pipeline/) and traces (trace)."""
