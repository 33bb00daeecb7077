"""Profiling: where time (nsys or torch.profiler) and memory (the CUDA allocator's history) go.

- `nvtx`: NVTX ranges (a no-op without CUDA) and the annotated attention (`attn_impl="annotated"`);
- `phases`: the phase names (FWD_STEP, BWD_STEP, OPTIM_STEP) and one step run with a caller's range;
- `nsys`: find nsys, run `nsys profile` + `nsys stats`, parse the CSV reports;
- `nsys_target`: the process nsys watches (`python -m lmsys.profiling.nsys_target SPEC`);
- `torch_engine`: the same workload under torch.profiler;
- `summary`: the tables both engines produce (ranges, top kernels/operators, attention split);
- `memory_capture`: the allocator's history around the phases of training steps (CUDA), the snapshot pickle;
- `memory_analysis`: the snapshot replayed offline: peak per phase, the largest allocations;
- `memory_plot`: the timeline PNG; `memory`: what `profile memory` runs and prints, from those three.
"""
