"""Compile the flash-triton kernels for an H100/H200 (sm_90) on a machine without a GPU.

Triton's compiler needs no GPU: this builds each kernel with the constants its launcher would pass, for
each config, through Triton's whole pipeline to a cubin (ptxas included), and prints whether it compiled
and the shared memory it asks for. It answers "does this compile on Hopper" (the warp-specialisation pass,
tensor descriptors, a refactor of a @triton.jit helper) before any device time is spent. Run it with the
triton the GPU machines have (3.6: ../shared/DEVICE.md), e.g. in a venv with that wheel:

    PYTHONPATH=src python scripts/compile_sm90.py --kernels fwd --d 64,128 --warp-specialize

Its compile_gluon, ptxas_notes and report do the same for Gluon kernels, imported from Python. With
--dump DIR it writes each kernel's PTX, source lines stripped, to DIR: two dumps diffed show whether a
refactor of the kernels changed what the GPU runs.

Not checked here: that a config fits at launch (shared memory is printed, the limit is 227 KiB) and that
it computes the right thing (the tests do that, under the interpreter and on a GPU).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # the compiler, not the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lmsys.kernels import flash_triton as ft  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "helpers"))
import hopper_compile  # noqa: E402  (ptxas's reading, shared with the tests)

HOPPER = GPUTarget("cuda", 90, 32)
SMEM = 232448  # bytes of shared memory one block may use on an H100/H200
FLOAT = {"bf16": 2, "fp16": 2, "fp32": 4}


def signature(fn, dtype: str, consts: dict) -> dict:
    """Triton's signature of `fn`'s arguments as the launchers pass them."""
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("L", "Delta") or (name == "DQ" and consts.get("ATOMIC_DQ")):
            sig[name] = "*fp32"
        elif name in ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ"):
            sig[name] = f"*{dtype}"
        elif name == "sm_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_one(kernel: str, dtype: str, consts: dict, config: triton.Config):
    fn = ft._kernels()[kernel]
    consts = {**consts, **config.kwargs}
    sig = signature(fn, dtype, consts)
    pointers = [i for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")]
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in pointers})
    return triton.compile(src, target=HOPPER, options={"num_warps": config.num_warps,
                                                       "num_stages": config.num_stages})


def compile_gluon(fn, example_args: list, consts: dict, *, num_warps: int, maxnreg: int | None = None):
    """Compile a Gluon kernel for sm_90: its signature from example values of its runtime arguments (in
    order) and the constexprs in `consts`."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    values = dict(zip([n for n in fn.arg_names if n not in consts], example_args))
    sig = {n: "constexpr" if n in consts else mangle_type(values[n]) for n in fn.arg_names}
    # the JIT's specialisation: pointers (tensors: CPU allocations are 16-byte aligned too) and integers
    # divisible by 16 are marked so, which decides vectorised loads and address registers
    aligned = [i for i, n in enumerate(fn.arg_names) if n not in consts and (
        hasattr(values[n], "data_ptr") or isinstance(values[n], int) and not isinstance(values[n], bool)
        and values[n] % 16 == 0)]
    src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()},
                         attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=HOPPER, options={"num_warps": num_warps, "maxnreg": maxnreg})


def ptxas_notes(kernel) -> str:
    """What ptxas says of a compiled kernel that matters for wgmma kernels: registers, bytes spilled, its
    performance advisories (C7514: wgmma serialised, ...); tests/helpers/hopper_compile.py's reading."""
    registers, spilled, advisories = hopper_compile.ptxas_notes(kernel)
    return f"{registers} registers, {spilled} bytes spilled" + "".join(f", {a}" for a in advisories)


def report(name: str, build) -> bool:
    """One line for one compile (`build()` returns the compiled kernel): its shared memory and what ptxas
    says, or why it failed."""
    try:
        kernel = build()
    except Exception as e:  # noqa: BLE001 - the line says what failed
        print(f"{name}: FAILED {type(e).__name__}: {e}"[:3000], flush=True)
        return False
    print(f"{name}: compiled, shared {kernel.metadata.shared / 1024:.0f} KiB; ptxas: {ptxas_notes(kernel)}",
          flush=True)
    return True


def dump(folder: str, name: str, compiled) -> None:
    """The PTX code: without .loc/.file records, comments and the DWARF sections (they change with the
    source's lines, paths and inlining, not with what runs)."""
    os.makedirs(folder, exist_ok=True)
    code = re.split(r"^\s*\.section\s+\.debug", compiled.asm["ptx"], maxsplit=1, flags=re.M)[0]
    lines = [ln for ln in code.splitlines()
             if not ln.lstrip().startswith((".loc", ".file", "//", "$L__")) and ln.strip()]
    with open(os.path.join(folder, re.sub(r"[^\w.-]+", "_", name) + ".ptx"), "w") as f:
        f.write("\n".join(lines) + "\n")


def constants(kernel: str, d: int, dtype: str, causal: bool, args) -> dict:
    common = dict(HEAD_DIM=d, HEAD_DIM_PAD=ft.head_dim_pad(d), IS_CAUSAL=causal, HEADS_FAST=causal,
                  DOT_PRECISION="tf32x3" if dtype == "fp32" else "tf32")
    if kernel == "fwd":
        return {**common, "USE_TMA": args.tma, "WARP_SPEC": args.warp_specialize, "PERSISTENT": args.persistent}
    if kernel == "dkdv":
        return {**common, "ATOMIC_DQ": args.atomic, "USE_TMA": args.tma, "WITH_DQ": args.fused and not args.atomic,
                "TMA_DQ": args.atomic and args.tma and not args.element_atomics}
    return {**common, "USE_TMA": args.tma}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default="fwd,dkdv,dq")
    p.add_argument("--d", default="64,128", help="head dims")
    p.add_argument("--dtype", default="bf16", help="bf16, fp16, fp32 (comma-separated)")
    p.add_argument("--causal", default="1", help="1, 0 or 1,0")
    p.add_argument("--wide", action="store_true", help="also WIDE_CONFIGS")
    p.add_argument("--tma", action="store_true")
    p.add_argument("--element-atomics", action="store_true",
                   help="with --atomic --tma: dQ by element-wise atomics instead of TMA reduce-adds (the default)")
    p.add_argument("--warp-specialize", action="store_true")
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--atomic", action="store_true", help="the one-launch backward (deterministic=False)")
    p.add_argument("--fused", action="store_true", help="dkdv with the dQ programs (Policy.fused_backward)")
    p.add_argument("--dump", help="a folder for each kernel's PTX without its source-line records")
    args = p.parse_args(argv)
    print(f"triton {triton.__version__}, target sm_90; flags: "
          + (", ".join(f for f in ("tma", "warp_specialize", "persistent", "atomic", "fused") if getattr(args, f)) or "none"))
    print("| kernel | d | dtype | causal | config | fits (estimate) | compiled | shared KiB |")
    print("|---|---|---|---|---|---|---|---|")
    failed = 0
    for kernel in args.kernels.split(","):
        configs = ft.GPU_CONFIGS[kernel] + (ft.WIDE_CONFIGS[kernel] if args.wide else [])
        for dtype in args.dtype.split(","):
            for d in (int(x) for x in args.d.split(",")):
                for causal in (c == "1" for c in args.causal.split(",")):
                    consts = constants(kernel, d, dtype, causal, args)
                    for config in configs:
                        kw = config.kwargs
                        name = f"{kw['BLOCK_M']}×{kw['BLOCK_N']}, {config.num_warps} warps, {config.num_stages} st"
                        fits = ft._fits(kernel, config, ft.head_dim_pad(d), FLOAT[dtype], SMEM)
                        try:
                            compiled = compile_one(kernel, dtype, consts, config)
                            shared, result = f"{compiled.metadata.shared / 1024:.0f}", "yes"
                            if args.dump:
                                dump(args.dump, f"{kernel}-d{d}-{dtype}-c{int(causal)}-{name}", compiled)
                        except Exception as e:  # noqa: BLE001 - the table says what failed
                            failed += 1
                            shared, result = "", f"no: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
                        print(f"| {kernel} | {d} | {dtype} | {causal} | {name} | {fits} | {result} | {shared} |",
                              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
