"""A seeded fuzz of every command's options, valid and invalid values mixed: the exit code is 0, 1 or 2
and nothing prints a traceback. In-process (CliRunner-like, through main()), tiny sizes, one step;
commands that would start torchrun only get option mixes that fail before it starts or run 1 rank.
`plan train` gets no --gpu (so most draws stop at "give the GPU"); `plan validate` no --profile."""

from __future__ import annotations

import random

import pytest

VALUES = {
    "--format": ["table", "md", "csv", "json", "bogus", ""],
    "--device": ["cpu", "auto", "cuda", "tpu", "cuda:9"],
    "--dtype": ["fp32", "bf16", "fp16", "fp8", "int"],
    "--steps": ["1", "0", "-3", "x", "99999999999999999999"],
    "--warmup": ["0", "1", "-1", "nan"],
    "--batch-size": ["1", "0", "-2", "abc"],
    "--context-length": ["16", "0", "-1", "1e3"],
    "--size": ["tiny", "bogus", "tiny,bogus", "nope.yaml", ""],
    "--seed": ["0", "-1", "99999999999999999999", "1.5"],
    "--cases": ["1", "0", "-1"],
    "--max-len": ["8", "0", "-4"],
    "--world-size": ["1", "0", "a,b", "-2", "1,x"],
    "--sizes": ["4KB", "3", "0", "1XB", "-4", ""],
    "--backend": ["gloo", "mpi", "nccl"],
    "--impl": ["naive", "bogus", "flash-torch", "sdpa-math"],
    "--d-head": ["16", "0", "3", "x"],
    "--mode": ["fwd", "train", "bogus"],
    "--attn": ["naive", "sdpa", "bogus"],
    "--strategy": ["naive", "bogus"],
    "--top": ["1", "0", "-1"],
    "--engine": ["torch", "nsys", "bogus"],
    "-o": ["/proc/x.md", "/etc/hostname/o.md", "/", "out.json", "out.csv"],
    "--gpus": ["1", "8", "0", "-1", "x"],
    "--gpu": ["H100", "A100 80GB SXM", "V100", ""],
    "--mesh": ["dp=1", "tp=3", "dp=x", "pp=0", "zero=9", ""],
    "--global-batch": ["1", "0", "-2"],
    "--peak-tflops": ["100", "0", "-5", "nan", "inf"],
    "--profile": ["p.yaml", "/etc/hostname/p.yaml", "nope.json"],
    "--checkpoint": ["none", "block", "bogus", ""],
}

COMMANDS = {
    ("bench", "e2e"): ["--format", "--device", "--dtype", "--steps", "--warmup", "--batch-size", "--context-length",
                       "--size", "--mode", "--attn", "-o"],
    ("bench", "attention"): ["--format", "--device", "--dtype", "--steps", "--warmup", "--batch-size",
                             "--context-length", "--impl", "--d-head", "-o"],
    ("flash", "check"): ["--format", "--device", "--seed", "--cases", "--max-len", "-o"],
    ("precision",): ["--format", "--device", "--steps", "-o"],
    ("profile", "nsys"): ["--format", "--device", "--dtype", "--steps", "--warmup", "--batch-size", "--size",
                          "--mode", "--top", "--engine", "-o"],
    ("comm", "allreduce"): ["--format", "--device", "--dtype", "--steps", "--warmup", "--world-size", "--sizes",
                            "--backend", "-o"],
    ("ddp", "train"): ["--format", "--device", "--dtype", "--steps", "--warmup", "--batch-size", "--world-size",
                       "--backend", "--strategy", "--size", "-o"],
    ("parallel", "train"): ["--format", "--dtype", "--steps", "--warmup", "--batch-size", "--size", "--backend", "-o"],
    ("plan", "train"): ["--format", "--dtype", "--size", "--gpus", "--gpu", "--mesh", "--global-batch", "--top",
                        "--context-length", "--peak-tflops", "-o"],
    # no --steps / --warmup: a huge count would time forever (as in every benchmark); their defaults are small
    ("plan", "calibrate"): ["--format", "--device", "--dtype", "--batch-size", "--size", "--profile", "-o"],
    ("plan", "validate"): ["--format", "--device", "--dtype", "--batch-size", "--size", "--profile", "--checkpoint",
                           "-o"],
    ("plan", "breakdown"): ["--format", "--device", "--dtype", "--batch-size", "--size", "--profile",
                            "--context-length", "-o"],
    ("list",): ["--format", "-o"],
}
# Values that keep a valid run tiny: one step, small shapes.
SMALL = {"--steps": "1", "--warmup": "0", "--batch-size": "1", "--context-length": "16", "--size": "tiny",
         "--cases": "1", "--max-len": "8", "--d-head": "16", "--sizes": "4KB", "--device": "cpu", "--gpu": "H100",
         "--profile": "p.yaml", "--checkpoint": "none"}
DISTRIBUTED = {("comm", "allreduce"), ("ddp", "train"), ("parallel", "train")}


def draws(seed: int, n: int):
    rng = random.Random(seed)
    for _ in range(n):
        cmd = rng.choice(sorted(COMMANDS))
        opts = rng.sample(COMMANDS[cmd], k=rng.randint(1, min(4, len(COMMANDS[cmd]))))
        args = {opt: SMALL.get(opt) for opt in COMMANDS[cmd] if opt in SMALL}
        for opt in opts:
            args[opt] = rng.choice(VALUES[opt])
        if cmd in DISTRIBUTED:  # at least one invalid value, so no torchrun job starts (those are tested elsewhere)
            bad = rng.choice([o for o in COMMANDS[cmd] if o not in ("--backend",)])
            args[bad] = {"--format": "bogus", "--device": "tpu", "--dtype": "fp8", "--steps": "0", "--warmup": "-1",
                         "--batch-size": "0", "--world-size": "0", "--sizes": "3", "--strategy": "bogus",
                         "--size": "bogus", "-o": "/etc/hostname/o.md"}[bad]
        argv = list(cmd)
        for opt, value in args.items():
            if value is not None:
                argv += [opt, value]
        yield argv


@pytest.mark.parametrize("seed", range(4))
def test_fuzzed_options_exit_0_1_or_2_without_a_traceback(lmsys, monkeypatch, seed, tmp_path):
    monkeypatch.chdir(tmp_path)  # profile output folders land here
    for name in ("RANK", "WORLD_SIZE", "LMSYS_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    for argv in draws(seed, 12):
        r = lmsys(*argv)
        assert r.code in (0, 1, 2), (argv, r.code, r.err[-2000:])
        assert "Traceback" not in r.out + r.err, (argv, r.err[-2000:])
        if r.code:
            assert r.err.strip(), argv
