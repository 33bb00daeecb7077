"""Multi-process work: launching under torchrun, hand-written data parallelism (the `comm` benchmarks
are lmsys.bench.comm).

- `launch`: run a job on every rank (re-executing through `torchrun --standalone` or joining a torchrun
  group), bring rank 0's result back to the parent process.
- `primitives`: the flat collectives DDP, ZeRO and FSDP are built from (all-gather, reduce-scatter,
  all-reduce of a flattened list, broadcast of a module's state), each on an optional process group.
- `ddp`: NaiveDDP, FlatDDP, OverlapDDP, BucketedDDP.
- `sharded_optimizer`: ShardedOptimizer (ZeRO stage 1).
- `fsdp`: FSDP (parameters sharded along dim 0, gathered per layer).
- `train`: the training run behind `lmsys ddp train` (rows per strategy, parity against one process).
"""
