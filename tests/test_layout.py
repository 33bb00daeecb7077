"""Issue 40's rooms, held: the sizes it set for the files that had grown, so that they do not grow back
unnoticed (the command bodies are held by tests/test_command_shape.py, scripts/ by tests/test_scripts.py)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _lines(rel: str) -> int:
    return len((ROOT / rel).read_text().splitlines())


def test_the_kernel_file_holds_kernels_configs_and_launchers_only():
    """kernels/flash_triton.py: the tl kernels, their configs and launchers in 940 lines at most (900 until
    the fused backward's dQ programs moved into a function both entry kernels call); what callers run
    (Policy, the dispatch, autograd, the custom ops) lives in kernels/flash.py."""
    assert _lines("src/lmsys/kernels/flash_triton.py") <= 940
    flash = (ROOT / "src/lmsys/kernels/flash.py").read_text()
    assert "class Policy" in flash and "class FlashAttentionTriton" in flash


def test_the_attention_page_is_tables_not_a_log():
    """docs/benchmarks/attention.md keeps today's tables with their commands, 600 lines at most; the log
    is in git at the commit it names."""
    page = (ROOT / "docs/benchmarks/attention.md").read_text()
    assert len(page.splitlines()) <= 600 and "git show 23712ca:docs/benchmarks/attention.md" in page


def test_distributed_is_split_by_kind():
    """Launching and the mesh at the top, data and model parallelism in rooms of their own."""
    top = {p.stem for p in (ROOT / "src/lmsys/distributed").glob("*.py")}
    assert {"launch", "mesh", "primitives", "parallelize"} <= top
    for room, files in {"data_parallel": {"ddp", "copy_engine", "fsdp", "zero1", "strategies"},
                        "model_parallel": {"tensor_parallel", "pipeline", "torch_parallel"}}.items():
        assert files <= {p.stem for p in (ROOT / "src/lmsys/distributed" / room).glob("*.py")}, room
