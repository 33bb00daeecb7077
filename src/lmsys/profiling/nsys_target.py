"""The process `lmsys profile nsys` runs under nsys: `python -m lmsys.profiling.nsys_target SPEC.json`.

SPEC.json (written by `lmsys.profiling.nsys.profile_e2e`) names the workload. This process builds the model,
runs the warm-up steps, then brackets the measured steps with cudaProfilerStart/Stop (nsys records only
that window, `--capture-range=cudaProfilerApi`), each phase in an NVTX range that synchronises before it
closes. It writes SPEC's `result` file ({"status": "ok"} or the error) for the parent to read: nsys's own
exit status does not always carry the application's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run(spec: dict) -> None:
    import torch

    from lmsys.core import progress
    from lmsys.train import Workload, build_train_step, random_batch, run_step
    from lmsys.core.devices import resolve_device
    from lmsys.core.timing import synchronize
    from lmsys.model.config import ModelConfig
    from lmsys.profiling import nvtx
    from lmsys.profiling.phases import PROFILER_NAMES, WARMUP

    device = resolve_device(spec["device"])
    workload = Workload(ModelConfig(**spec["config"]), batch_size=spec["batch_size"], dtype=spec["dtype"])
    step = build_train_step(workload, device)
    inputs, targets = random_batch(workload, device)
    mode = spec["mode"]

    cuda = device.type == "cuda"  # (a CPU run does the same steps with no capture: for tests)
    progress.plan_steps(spec["warmup"] + spec["steps"])  # to LMSYS_PROGRESS_FILE: the parent's display shows it
    for _ in range(spec["warmup"]):  # before the capture window; marked WARMUP for whole-run captures
        run_step(step, inputs, targets, mode=mode, range_fn=lambda _phase: nvtx.nvtx_range(WARMUP),
                 names=PROFILER_NAMES)
        progress.step()
    synchronize(device)
    if cuda:
        torch.cuda.profiler.start()  # cudaProfilerStart: nsys starts recording here
    for _ in range(spec["steps"]):
        run_step(step, inputs, targets, mode=mode, range_fn=lambda name: nvtx.nvtx_range(name, synchronize=True),
                 names=PROFILER_NAMES)
        progress.step()
    synchronize(device)
    if cuda:
        torch.cuda.profiler.stop()  # cudaProfilerStop: and stops here


def main(argv: list[str] | None = None) -> int:
    from lmsys.core.errors import LmsysError

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m lmsys.profiling.nsys_target SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    result = Path(spec["result"])
    try:
        run(spec)
    except LmsysError as exc:
        result.write_text(json.dumps({"status": "error", "error": exc.message}))
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported to the parent, then re-raised for the traceback
        from lmsys.core.imports import describe_user_failure

        yours = describe_user_failure(exc)  # the user's model failed or called sys.exit: one line, exit 1
        result.write_text(json.dumps({"status": "error", "error": yours or f"{type(exc).__name__}: {exc}",
                                      "yours": yours is not None}))
        if yours is not None:
            print(f"error: {yours}", file=sys.stderr)
            return 1
        raise
    result.write_text(json.dumps({"status": "ok"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
