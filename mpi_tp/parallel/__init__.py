"""How ranks cooperate: the process grid (topology), every collective, counted (collectives), the
tensor-parallel regions f and g (tensor_parallel), their sequence-parallel forms (sequence_parallel),
gradient buckets over replicas (data_parallel) and the node-by-node all-reduce (hierarchical)."""
