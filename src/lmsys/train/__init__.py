"""The training step shared by bench, profiling and distributed (below all three, above model/kernels).

- `workload.py`: `Workload`, what one step is (model config, batch, numerics, fast path) and its checks.
- `step.py`: `TrainStep`, the one runner `run_step`, the loss and the random batch.
- `build.py`: `build_model`, the one place a model is built (a `factory` seam), and `build_train_step`.
- `optim.py`: the one AdamW, the learning rates, the optimizer run inside the backward.
- `checkpointing.py`: activation checkpointing applied from outside the model.
- `data.py`: `BatchSource`, the batches of the multi-process runs and of their one-process references.
- `loop.py`: `train_loop`, their timed loop over `run_step`, and `mfu_percent`.

Importing this package stays torch-free (the CLI reads MODES before torch loads): the names below are
imported from their modules on first use.
"""

MODES = ("fwd", "fwd-bwd", "train")  # what one step runs; here, torch-free, for the CLI-time importers

_HOMES = {
    "Workload": "workload",
    "TrainStep": "step", "run_step": "step", "lm_loss": "step", "random_batch": "step",
    "TIMER_NAMES": "step", "no_range": "step",
    "build_model": "build", "build_train_step": "build", "count_parameters": "build", "tf32_matmuls": "build",
    "make_optimizer": "optim", "OptimizerInBackward": "optim",
}
__all__ = ["MODES", *_HOMES]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
