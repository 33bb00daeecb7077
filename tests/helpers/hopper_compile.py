"""Compile lmsys's attention kernels for Hopper (sm_90) on a machine without a GPU: a stand-in active driver
names the target, `warmup` compiles to a cubin and nothing launches. Run as a script (the driver swap is
process-wide) by tests/test_flash_triton.py; prints one line per kernel compiled: its name, what it was
compiled for, its grid, shared memory bytes, and what ptxas says of it (`ptxas_notes`: registers, bytes
spilled, its performance advisories, such as C7514 "wgmma serialized", which make every wgmma wait for
the previous one). The interpreter runs the tl kernels' arithmetic; this is what
checks that they, and the Gluon kernels (no interpreter at all), compile for the GPU, through the
launchers' own grids and constants (scripts/compile_sm90.py sweeps every config of a kernel instead, from
signatures it builds, for a person asking what fits).

    python tests/helpers/hopper_compile.py tl       # the tl kernels through their launchers (any triton)
    python tests/helpers/hopper_compile.py gluon    # flash_gluon's (the triton it was written for)
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for real

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402


class HopperWithoutGPU:
    """What `JITFunction.warmup` asks the active driver: the target, a device, a stream."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def ptxas_notes(kernel) -> tuple[int, int, tuple]:
    """(registers, bytes spilled, advisories): ptxas -v, the one Triton compiles sm_90 with, run again on
    the kernel's PTX (Triton keeps its log only under TRITON_DUMP_PTXAS_LOG). Advisories are its
    "Potential Performance Loss" codes (C7510-C7519: wgmma serialized for want of registers, for a
    non-wgmma instruction touching an accumulator in flight, ...)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", path + ".o"],
                             capture_output=True, text=True, check=True).stderr
    registers = max(int(x) for x in re.findall(r"Used (\d+) registers", log))
    spilled = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))
    return registers, spilled, tuple(sorted(set(re.findall(r"\((C75\d\d)\) Potential Performance Loss", log))))


def report(kernel, what: str, grid) -> None:
    assert kernel.asm["cubin"], kernel.name
    registers, spilled, advisories = ptxas_notes(kernel)
    print(kernel.name, what, "grid=" + ",".join(map(str, grid)), kernel.metadata.shared, f"regs={registers}",
          f"spill={spilled}", "ptxas=" + (",".join(advisories) or "-"), flush=True)


def tl_kernels() -> None:
    """Every tl kernel the launchers run, bf16 and fp32, causal or not: the forward, the backward's pair,
    its one launch with atomics (deterministic=False) and its fused launch (host-bound calls: no
    descriptors); the backward with tensor descriptors as the default policy runs it on Hopper, and its pair
    without them too ("pointers": other GPUs, misaligned strides). Each launch compiled instead of run, the
    tuner's first candidate taken untimed."""
    from dataclasses import replace

    from lmsys.kernels import flash, flash_triton, plans

    def compile_instead(fn, grid, args, consts, names=None):
        grid = grid(dict(consts)) if callable(grid) else grid
        report(fn.warmup(*args, grid=grid, **consts), what, grid)

    plans.launch = compile_instead
    flash_triton.TUNER.choose = lambda key, shortlist, run, compile_one: shortlist[0]
    # descriptors where the policy asks for them, as on a Hopper GPU (CPU tensors would get pointers only);
    # the atomic launch's TMA reduce-add of dQ needs CUDA tensors, so here it adds with element-wise atomics
    flash_triton._tma_usable = lambda policy, *tensors, backward=False: bool(
        policy.tma_backward if backward else policy.tma)
    policy = flash.default_policy()
    for dtype in (torch.bfloat16, torch.float32):
        for causal in (True, False):
            for name, p in (("pair", policy), ("atomic", replace(policy, deterministic=False)),
                            ("fused", flash._host_bound(replace(policy, fused_backward=True))),
                            ("head-by-head", replace(policy, heads_fast=False)),
                            ("pointers", replace(policy, tma_backward=False))):
                what = f"{str(dtype)[6:]}/causal={causal}/{name}"
                q = torch.empty(2, 2, 384, 64, dtype=dtype)
                o, lse, _ = flash_triton._tl_forward(q, q, q, causal, p)
                flash_triton._tl_backward(q, q, q, o, lse, q, causal, p)


def gluon_kernels() -> None:
    """flash_gluon's forward and backward at d 64 and 128: causal in both grid orders, and not causal."""
    from lmsys.kernels import flash_gluon as gluon

    Z, H, n = 2, 2, 1024
    for d in (64, 128):
        for causal, heads_fast in ((True, True), (True, False), (False, True)):
            what = f"d{d}/causal={causal}/heads_fast={heads_fast}"
            q, k, v, do, o = (torch.empty(Z, H, n, d, dtype=torch.bfloat16) for _ in range(5))
            lse, delta = torch.empty(Z, H, n), torch.empty(Z, H, n)
            c = gluon.CONFIGS[d]
            fast = causal and heads_fast
            q_desc, k_desc, v_desc = gluon.descriptors(q, k, v, c.block_m // c.consumers, c.block_n)
            grid = gluon.grid_order(n // c.block_m, Z * H, fast)
            report(gluon._attn_fwd_ws.warmup(
                q_desc, k_desc, v_desc, o, lse, gluon.LOG2E / math.sqrt(d), n, H, 1, grid=grid,
                BLOCK_M=c.block_m, BLOCK_N=c.block_n, HEAD_DIM=d, STAGES=c.stages, CAUSAL=causal,
                PIPELINE=c.pipeline, CONSUMERS=c.consumers, HEADS_FAST=fast, num_warps=c.warps // c.consumers,
                maxnreg=c.maxnreg), what, grid)
            prepare: list = []
            gluon.backward(q, k, v, do, lse, delta, torch.zeros(Z, H, n, d), torch.empty_like(q), torch.empty_like(k),
                           torch.empty_like(v), causal, prepare=prepare, heads_fast=heads_fast)
            for compile_ in prepare:
                report(compile_(), what, compile_.keywords["grid"])


if __name__ == "__main__":
    driver.set_active(HopperWithoutGPU())
    {"tl": tl_kernels, "gluon": gluon_kernels}[sys.argv[1]]()
