"""Multi-process work, by kind: launching, data parallelism, model parallelism (the runners of `ddp train`
and `parallel train` are lmsys.bench.ddp and lmsys.bench.parallel; the `comm` benchmarks lmsys.bench.comm).

At the top, what every kind uses:
- `launch`: run a job on every rank (re-executing through `torchrun --standalone` or joining a torchrun
  group), bring rank 0's result back to the parent process.
- `memory`: will a run fit on a rank, and the one-line error a rank reports when it does not.
- `primitives`: the flat collectives DDP, ZeRO, FSDP and the comm benchmarks are built from (all-gather,
  reduce-scatter, all-reduce of a flattened list, broadcast of a module's state), on an optional group.
- `mesh`: a `dp×tp×pp` mesh from the command line, the process group of each dimension.
- `parallelize`: TP -> PP -> activation checkpointing -> FSDP/DDP, applied to a model from outside.

`data_parallel/`: every rank holds the whole model and trains on its slice of the batch.
- `ddp`: NaiveDDP, FlatDDP, OverlapDDP, BucketedDDP; `copy_engine`: the all-reduce on the copy engines.
- `zero1`: ShardedOptimizer (ZeRO stage 1); `fsdp`: FSDP (parameters sharded along dim 0, gathered per layer).
- `strategies`: the registry `ddp train` and `parallel train` pick a wrapper from (torch-free).

`model_parallel/`: the model itself is split over ranks.
- `tensor_parallel`: Megatron's column/row split of attention, MLP, embedding and head (sequence parallel).
- `pipeline`: stages, schedules (GPipe, 1F1B, interleaved) and their matched send/recv batches.
- `torch_parallel`: the same plan with torch's DTensor, pipelining and FSDP2.

The modules' old paths (`lmsys.distributed.ddp`, `.sharded_optimizer`, `.train`, ...: `MOVED` below) still
import, as the module at the new path itself (the same objects): a finder on `sys.meta_path` answers for
the old names only, importing the new module when, and only when, the old name is imported, so
`import lmsys.distributed` stays torch-free.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

# old path -> new path (issue 40: distributed/ by kind, the runners beside bench e2e)
MOVED = {
    "lmsys.distributed.ddp": "lmsys.distributed.data_parallel.ddp",
    "lmsys.distributed.copy_engine": "lmsys.distributed.data_parallel.copy_engine",
    "lmsys.distributed.fsdp": "lmsys.distributed.data_parallel.fsdp",
    "lmsys.distributed.sharded_optimizer": "lmsys.distributed.data_parallel.zero1",
    "lmsys.distributed.strategies": "lmsys.distributed.data_parallel.strategies",
    "lmsys.distributed.tensor_parallel": "lmsys.distributed.model_parallel.tensor_parallel",
    "lmsys.distributed.pipeline": "lmsys.distributed.model_parallel.pipeline",
    "lmsys.distributed.torch_parallel": "lmsys.distributed.model_parallel.torch_parallel",
    "lmsys.distributed.train": "lmsys.bench.ddp",
    "lmsys.distributed.runs": "lmsys.bench.ddp_runs",
    "lmsys.distributed.parallel_train": "lmsys.bench.parallel",
}


class _MovedModules:
    """Finder and loader of `MOVED`'s old names: the module object is the new one (not a copy), so
    `isinstance`, monkeypatching and pickling see one class; its `__spec__` stays the new module's."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedModules)

    @staticmethod
    def create_module(spec):
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system sets __spec__ to the alias's; put it back
        return module

    @staticmethod
    def exec_module(module):
        spec = module.__spec__
        if spec is not None and spec.loader_state is not None:
            module.__spec__ = spec.loader_state


if not any(isinstance(f, type) and f.__name__ == "_MovedModules" for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules)
