"""Multi-process work: launching under torchrun, collectives benchmarks, hand-written data parallelism.

- `launch`: run a job on every rank (re-executing through `torchrun --standalone` or joining a torchrun
  group), bring rank 0's result back to the parent process.
- `collectives`: the collective benchmarks behind `lmsys comm` (all-reduce, all-gather, reduce-scatter,
  broadcast) and the flat all-gather / reduce-scatter calls ZeRO and FSDP use.
- `ddp`: NaiveDDP, FlatDDP, OverlapDDP, BucketedDDP.
- `sharded_optimizer`: ShardedOptimizer (ZeRO stage 1).
- `fsdp`: FSDP (parameters sharded along dim 0, gathered per layer).
- `train`: the training run behind `lmsys ddp train` (rows per strategy, parity against one process).
"""
