"""The training step shared by bench, profiling and distributed (below all three, above model/kernels)."""

MODES = ("fwd", "fwd-bwd", "train")  # what one step runs; here, torch-free, for the CLI-time importers
