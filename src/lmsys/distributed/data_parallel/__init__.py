"""Data parallelism: every rank holds the whole model (or its shard of it, FSDP) and trains on its slice
of the batch; the gradients are averaged over ranks.

- `ddp`: NaiveDDP, FlatDDP, OverlapDDP, BucketedDDP (the course's ladder, one class per rung).
- `copy_engine`: CopyEngineAllReduce, the bucketed all-reduce on the GPUs' copy engines.
- `zero1`: ShardedOptimizer (ZeRO stage 1: each rank steps its shard of the optimizer state).
- `fsdp`: FSDP (parameters sharded along dim 0, gathered per layer, gradients reduce-scattered).
- `strategies`: the torch-free registry `ddp train` and `parallel train` choose a wrapper from.
"""
