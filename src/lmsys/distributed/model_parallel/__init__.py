"""Model parallelism: the model itself is split over ranks.

- `tensor_parallel`: Megatron's column/row split of attention and MLP, the vocabulary-parallel embedding,
  head and cross-entropy, sequence parallelism.
- `pipeline`: the stages (`partition`, `PipelineModule`), the schedules (GPipe, 1F1B, interleaved 1F1B)
  and the send/recv order every rank posts in matched batches (`p2p_plan`).
- `torch_parallel`: the same plan with torch's own DTensor tensor parallelism, pipelining and FSDP2.
"""
