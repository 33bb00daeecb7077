"""Every option that several commands take, declared once: its flag and aliases in FLAGS (`opt` builds the
typer.Option from it), and, where the help reads the same everywhere, an Annotated alias. A command's own
options (used by it alone) stay in its signature. tests/test_command_shape.py holds the line: a flag appears
in one declaration."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

FLAGS: dict[str, tuple[str, ...]] = {  # option key -> its flag and aliases (the first is the documented name)
    "adapters": ("--adapters",),
    "backend": ("--backend",),
    "baseline": ("--baseline",),
    "baseline_toggle": ("--baseline/--no-baseline",),
    "batch_size": ("--batch-size", "--batch"),
    "causal": ("--causal/--no-causal",),
    "checkpoint": ("--checkpoint",),
    "context_length": ("--context-length", "--seq-len"),
    "d_head": ("--d-head",),
    "device": ("--device",),
    "dp_strategy": ("--dp-strategy",),
    "dtype": ("--dtype",),
    "format": ("--format", "-f"),
    "heads": ("--heads",),
    "impl": ("--impl",),
    "master_weights": ("--master-weights",),
    "master_weights_toggle": ("--master-weights/--no-master-weights",),
    "mesh": ("--mesh",),
    "microbatches": ("--microbatches",),
    "mode": ("--mode",),
    "model": ("--model",),
    "model_kwargs": ("--model-kwargs",),
    "out_dir": ("--out-dir",),
    "output": ("--output", "-o"),
    "peak_tflops": ("--peak-tflops",),
    "plot": ("--plot",),
    "pp_schedule": ("--pp-schedule",),
    "profile": ("--profile",),
    "quiet": ("--quiet", "-q"),
    "seq_len": ("--seq-len", "--context-length"),  # flash check: --seq-len documented, the others' name too
    "sequence_parallel": ("--sequence-parallel",),
    "size": ("--size",),
    "sm_carveout": ("--sm-carveout",),
    "steps": ("--steps", "--iters"),
    "top": ("--top",),
    "virtual_stages": ("--virtual-stages",),
    "warmup": ("--warmup",),
    "world_size": ("--world-size",),
}
FLAG_KEYS = ("causal", "baseline", "baseline_toggle", "master_weights", "master_weights_toggle", "quiet",
             "sequence_parallel")  # on/off switches: no metavar in --help


def opt(key: str, help: str, *, aliases: tuple[str, ...] = (), **kwargs) -> typer.models.OptionInfo:
    """typer.Option for a shared option: FLAGS[key]'s spellings (plus a command's own former `aliases`),
    this command's help text."""
    if key in FLAG_KEYS:
        kwargs.setdefault("metavar", "")
    return typer.Option(*FLAGS[key], *aliases, help=help, **kwargs)


MODEL_KWARGS_HELP = "Extra keyword arguments for --model: YAML or JSON text, or a .yaml/.json file."
PEAK_HELP = ("Dense peak TFLOP/s per GPU that MFU divides by, for a GPU lmsys.core.hardware's table does not know "
             "(default: the table's for --dtype; unknown GPU: no MFU).")

DeviceOpt = Annotated[str, opt("device", "auto | cuda | cpu (auto: cuda when a GPU is visible).")]
DtypeOpt = Annotated[str, opt("dtype", "fp32 | bf16 | fp16 (one per run).")]
FormatOpt = Annotated[Optional[str], opt("format", (
    "table | md | csv | json. Default: a table on stdout; with --output, the file's extension picks its format "
    "(.json, .csv, else md)."))]
QuietOpt = Annotated[bool, opt("quiet", (
    "No progress on stderr: neither the display drawn when stderr is a terminal nor, where it is not (a CI log, "
    "nohup, | tee), the plain line per finished row and per 10 s of a long row that a run over 10 s writes "
    "(LMSYS_PROGRESS_EVERY sets the seconds). Never anything on stdout."))]
OutputOpt = Annotated[Optional[Path], opt(
    "output", "Also write the results to FILE (format from --format, else the extension).")]
PeakTflopsOpt = Annotated[Optional[float], opt("peak_tflops", PEAK_HELP)]
ModelKwargsOpt = Annotated[Optional[str], opt("model_kwargs", MODEL_KWARGS_HELP)]
