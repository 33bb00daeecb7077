"""issue 40: distributed/ by kind, the runners in bench/. Every module's old path still imports, as the
module at its new path (the same objects), and every public name it defined before the move is there;
`import lmsys.distributed` and the torch-free modules' old paths stay torch-free."""

import importlib
import subprocess
import sys

import pytest

# the names each old module defined (`def`, `class`, assignments) before the move, as of 23712ca
OLD_NAMES = {
    "ddp": ("presence_flags", "GradPresence", "NaiveDDP", "FlatDDP", "OverlapDDP", "BUCKET_ORDERS", "StepInFinish",
            "BucketedDDP", "all_reduce_flat", "broadcast_module_state"),  # the last two: re-exported there
    "copy_engine": ("ALIGN_ELEMS", "CopyEngineAllReduce"),
    "fsdp": ("FSDP",),
    "sharded_optimizer": ("DEFAULT_BUCKET_MB", "ShardedOptimizer", "optimizer_state_bytes"),
    "strategies": ("Strategy", "STRATEGIES", "register", "listing", "check_name", "get", "adapters_module",
                   "torch_fully_shard", "make_strategy_optimizer", "optimizer_label", "wrap_model", "step_hooks",
                   "inner_module", "final_parameters", "gradients"),
    "tensor_parallel": ("timed_collectives", "copy_to_tp", "reduce_from_tp", "gather_seq", "scatter_seq",
                        "TPAttention", "TPSwiGLU", "SPNorm", "VocabParallelEmbedding", "VocabParallelHead",
                        "vocab_parallel_cross_entropy", "apply_tensor_parallel", "tp_loss", "seq_shard"),
    "pipeline": ("unit_costs", "partition", "PipelineModule", "schedule", "ideal_bubble", "Transfer", "Step", "needs",
                 "produces", "p2p_plan", "StepResult", "run_schedule"),
    "torch_parallel": ("SCHEDULES", "QKV", "not_composable", "TorchAttention", "torch_model", "full_name",
                       "StageModule", "apply_torch_tp", "TorchParallelModel", "local_numel"),
    "train": ("resolve_model_size", "BatchSource", "train_job", "baseline_runs", "train_loop", "single_process_run",
              "parity_tolerance", "strategy_run", "compare_with_reference", "ROW_KEYS", "mfu_percent"),
    "runs": ("STRATEGIES", "ADAPTER_STRATEGIES", "SHARDABLE", "COMM_DTYPES", "BUCKET_LEVERS", "RunSpec", "shardable",
             "expand_runs", "parse_runs", "check_levers_for_backend", "set_nccl_ctas", "run_line", "train_notes"),
    "parallel_train": ("ROW_KEYS", "COMM_DIMS", "parallel_job", "one_process_run", "mesh_run", "timed_steps"),
}
NEW_PATHS = {
    "ddp": "lmsys.distributed.data_parallel.ddp",
    "copy_engine": "lmsys.distributed.data_parallel.copy_engine",
    "fsdp": "lmsys.distributed.data_parallel.fsdp",
    "sharded_optimizer": "lmsys.distributed.data_parallel.zero1",
    "strategies": "lmsys.distributed.data_parallel.strategies",
    "tensor_parallel": "lmsys.distributed.model_parallel.tensor_parallel",
    "pipeline": "lmsys.distributed.model_parallel.pipeline",
    "torch_parallel": "lmsys.distributed.model_parallel.torch_parallel",
    "train": "lmsys.bench.ddp",
    "runs": "lmsys.bench.ddp_runs",
    "parallel_train": "lmsys.bench.parallel",
}
# names whose definition moved below both runners (where the two now share it)
SHARED = {"BatchSource": "lmsys.train.data", "train_loop": "lmsys.train.loop", "mfu_percent": "lmsys.train.loop",
          "optimizer_state_bytes": "lmsys.train.optim"}


def test_the_table_is_the_packages():
    from lmsys.distributed import MOVED

    assert MOVED == {f"lmsys.distributed.{old}": new for old, new in NEW_PATHS.items()}


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_old_path_is_the_new_module_with_every_old_name(old):
    module = importlib.import_module(f"lmsys.distributed.{old}")
    new = importlib.import_module(NEW_PATHS[old])
    assert module is new
    assert module.__name__ == module.__spec__.name == NEW_PATHS[old]  # the alias leaves the module's own spec
    for name in OLD_NAMES[old]:
        assert hasattr(module, name), f"lmsys.distributed.{old}.{name} is gone"
        if name in SHARED:
            assert getattr(module, name) is getattr(importlib.import_module(SHARED[name]), name)
    # `from lmsys.distributed import <old>` too (the form tests and user code use)
    exec(f"from lmsys.distributed import {old} as m", scope := {})
    assert scope["m"] is new


def test_old_paths_in_a_fresh_process_first():
    """Imported before the new path (a fresh interpreter), each old path gives the module that the new path
    then gives; `import lmsys.distributed` and the torch-free modules' old paths import no torch; a
    `pkg.module:Class` strategy on an old path loads."""
    code = """
import importlib, sys
import lmsys.distributed
assert 'torch' not in sys.modules, 'import lmsys.distributed imported torch'
import lmsys.distributed.runs, lmsys.distributed.strategies
assert 'torch' not in sys.modules, 'a torch-free module through its old path imported torch'
from lmsys.distributed.sharded_optimizer import ShardedOptimizer
from lmsys.distributed.data_parallel.zero1 import ShardedOptimizer as again
assert ShardedOptimizer is again
from lmsys.distributed.train import train_job
assert train_job is importlib.import_module('lmsys.bench.ddp').train_job
from lmsys.core.imports import load_object
assert load_object('lmsys.distributed.ddp:BucketedDDP', what='--strategy').__module__ == \
    'lmsys.distributed.data_parallel.ddp'
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_old_name_still_fails():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("lmsys.distributed.no_such_module")


def test_parallel_command_does_not_import_the_ddp_runner():
    import ast
    from pathlib import Path

    import lmsys.commands.parallel as command
    import lmsys.bench.parallel as runner

    for module in (command, runner):
        imported = {node.module for node in ast.walk(ast.parse(Path(module.__file__).read_text()))
                    if isinstance(node, ast.ImportFrom)}
        assert not imported & {"lmsys.bench.ddp", "lmsys.distributed.train"}, module.__name__
