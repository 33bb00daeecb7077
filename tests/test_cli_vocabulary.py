"""Issue 27 item 3-4: messages name the option as the user typed it (an alias such as --seq-len or --attn,
not the canonical name they did not type), and every sweepable option is a comma list wherever the
command can sweep it."""

from __future__ import annotations

import pytest

import test_cli_safety
from test_cli_safety import one_line

no_torchrun = test_cli_safety.no_torchrun  # a fixture: torchrun must not start


@pytest.mark.parametrize("args,message", [
    (["bench", "e2e", "--seq-len", "0"], "error: --seq-len must be >= 1, got 0"),
    (["bench", "e2e", "--context-length", "0"], "error: --context-length must be >= 1, got 0"),
    (["bench", "e2e", "--batch", "0"], "error: --batch must be >= 1, got 0"),
    (["bench", "e2e", "--iters=0"], "error: --iters must be >= 1, got 0"),
    (["bench", "attention", "--seq-len", "64,64"], "error: --seq-len: 64 given twice; each value runs once, so give it once"),
    (["comm", "allreduce", "--iters", "0"], "error: --iters must be >= 1, got 0"),
    (["bench", "e2e", "--attn", "bogus"], "error: --attn must be one of"),
    (["bench", "e2e", "--impl", "bogus"], "error: --impl must be one of"),
    (["bench", "e2e", "--attn", "sdpa", "--model", "hf:gpt2"], "error: --attn picks the attention inside lmsys's model"),
    (["bench", "e2e", "--impl", "sdpa", "--model", "hf:gpt2"], "error: --impl picks the attention inside lmsys's model"),
    (["bench", "e2e", "-f", "xml"], "error: -f must be one of table, md, csv, json, not 'xml'"),
    (["bench", "e2e", "--seq-len", "abc"], "error: --seq-len: cannot parse 'abc'"),
    (["profile", "nsys", "--seq-len", "abc"], "error: Invalid value for '--seq-len': 'abc' is not a valid int"),
    (["profile", "nsys", "--context-length", "abc"], "error: Invalid value for '--context-length': 'abc' is not a valid int"),
    (["bench", "e2e", "--iters", "abc"], "error: Invalid value for '--iters': 'abc' is not a valid int"),
])
def test_messages_name_the_option_as_the_user_typed_it(lmsys, args, message):
    line = one_line(lmsys(*args))
    assert line.startswith(message), line
    other = {"--seq-len": "--context-length", "--batch": "--batch-size", "--iters": "--steps", "--attn": "--impl",
             "-f": "--format"}
    for typed, canonical in other.items():
        if typed in args:  # the name the user did not type is not in the message
            assert canonical not in line, line


def test_spelling_only_rewrites_whole_option_names():
    from lmsys.cli import as_given

    spelled = {"--batch-size": (("--batch-size", "--batch"), "--batch")}
    assert as_given("--batch-size 0 and --batch-sizes", spelled) == "--batch 0 and --batch-sizes"
    assert as_given(None, spelled) is None


# ------------------------------------------------------------------------ every sweepable option a comma list


E2E = ("bench", "e2e", "--device", "cpu", "--size", "tiny", "--layers", "1", "--mode", "fwd", "--warmup", "0",
       "--steps", "1", "-f", "json")


def test_bench_e2e_sweeps_batch_context_and_heads(lmsys):
    import json

    r = lmsys(*E2E, "--batch-size", "1,2", "--seq-len", "16,32", "--heads", "2,4")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    got = [(row["heads"], row["context"], row["batch"]) for row in doc["rows"]]
    assert got == [(h, c, b) for h in (2, 4) for c in (16, 32) for b in (1, 2)]  # one row each, in that order
    for row in doc["rows"]:
        assert row["status"] == "ok" and "dtype" not in row  # one dtype: no column
        assert row["tokens/s"] == pytest.approx(row["batch"] * row["context"] / (row["ms/step"]["mean"] / 1e3))
    assert doc["meta"]["tiny"] == "d_model 128, d_ff 512, 1 layers, 2,4 heads, vocab 10000, context 16,32"
    assert doc["meta"]["run"].startswith("batch 1,2, fp32, ")


def test_bench_e2e_sweeps_dtype_and_a_single_value_adds_no_column(lmsys):
    import json

    r = lmsys(*E2E, "--dtype", "fp32,bf16", "--context-length", "16", "--batch-size", "2")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert [row["dtype"] for row in doc["rows"]] == ["fp32", "bf16"]
    assert not {"batch", "context", "heads"} & set(doc["rows"][0])
    assert doc["meta"]["run"].startswith("batch 2, fp32 | bf16 autocast, fp32 weights, ")


@pytest.mark.parametrize("args,message", [
    (["--batch-size", "2,2"], "error: --batch-size: 2 given twice"),
    (["--seq-len", "16,0"], "error: --seq-len must be >= 1, got 0"),
    (["--heads", "4,"], "error: --heads: empty item in '4,'"),
    (["--heads", "3"], "not divisible"),
    (["--dtype", "fp32,fp8"], "error: --dtype must be one of fp32, bf16, fp16, not 'fp8'"),
    (["--sm-carveout", "8,-1"], "error: --sm-carveout must be >= 0, got -1"),
])
def test_bench_e2e_sweep_lists_are_checked_before_any_work(lmsys, args, message):
    assert message in one_line(lmsys(*E2E, *args))


SWEEPABLE = ("--batch-size", "--context-length", "--heads", "--size", "--dtype", "--sm-carveout")


def test_every_sweepable_option_says_whether_it_takes_a_comma_list():
    """Help either says the option is a comma list (it sweeps) or that it is one value (the command looks at
    one configuration), for every command and every option naming a sweepable quantity."""
    import re

    from test_cli_safety import _commands

    seen = {}
    for path, cmd in _commands():
        if cmd.hidden:
            continue
        for param in cmd.params:
            if param.opts and param.opts[0] in SWEEPABLE:
                text = " ".join((param.help or "").split())
                sweeps = "comma" in text.lower() and "not a comma" not in text.lower()
                assert sweeps or re.search(r"\bone\b", text, re.I), (path, param.opts[0], text)
                seen[(" ".join(path), param.opts[0])] = sweeps
    for option in ("--batch-size", "--context-length", "--heads", "--size", "--dtype", "--sm-carveout"):
        assert seen[("bench e2e", option)], option
    for option in ("--batch-size", "--context-length", "--heads", "--dtype"):
        assert seen[("bench attention", option)], option
    assert seen[("profile memory", "--context-length")] and seen[("plan validate", "--size")]
    assert all(seen[(f"comm {name}", "--dtype")] for name in ("allreduce", "all-gather", "send-recv"))
    assert not seen[("profile nsys", "--context-length")] and not seen[("ddp train", "--size")]


def test_bench_attention_sweeps_dtype(lmsys):
    import json

    r = lmsys("bench", "attention", "--device", "cpu", "--impl", "naive", "--d-head", "16", "--seq-len", "16",
              "--warmup", "0", "--steps", "1", "--dtype", "fp32,bf16", "-f", "json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert [(row["dtype"], row["status"]) for row in doc["rows"]] == [("fp32", "ok"), ("bf16", "ok")]
    assert doc["meta"]["run"].startswith("fp32,bf16, not causal, batch 8")
    assert "--dtype: fp32 given twice" in one_line(lmsys("bench", "attention", "--device", "cpu", "--dtype", "fp32,fp32"))
    r = lmsys("bench", "attention", "--device", "cpu", "--impl", "naive", "--d-head", "16", "--seq-len", "16",
              "--warmup", "0", "--steps", "1", "--dtype", "bf16", "-f", "json")
    assert r.code == 0 and "dtype" not in json.loads(r.out)["rows"][0]  # one dtype: no column


@pytest.mark.parametrize("args,message,hint", [
    (["bench", "e2e", "--dtype"], "error: Option '--dtype' requires an argument", "hint: lmsys bench e2e --help lists the options"),
    (["comm", "allreduce", "--iters"], "error: Option '--iters' requires an argument", "hint: lmsys comm allreduce --help lists the options"),
    (["bench", "e2e", "--fast=3"], "error: Option '--fast' does not take a value", "hint: lmsys bench e2e --help lists the options"),
    (["bogus"], "error: No such command 'bogus'", "hint: lmsys --help lists the commands"),
    (["bench", "bogus"], "error: No such command 'bogus'", "hint: lmsys bench --help lists the commands"),
    (["plan", "validate"], "error: plan validate needs --profile FILE (from `lmsys plan calibrate` on this "
     "machine), or --published [FILE] to predict published runs", "hint: lmsys plan validate --help lists the options"),
])
def test_a_usage_error_hints_at_the_help_of_what_was_typed(lmsys, args, message, hint):
    """Commands list options and groups list commands; an option missing its value (no Click context yet)
    still names the command it was given to, not the root."""
    r = lmsys(*args)
    assert one_line(r) == message
    assert r.err.splitlines()[1] == hint


@pytest.mark.parametrize("args,message", [
    (["bench", "e2e", "--seq-len", "1.5"], "error: --seq-len: cannot parse '1.5' (not a whole number)"),
    (["comm", "allreduce", "--world-size", "two"], "error: --world-size: cannot parse 'two' (not a whole number)"),
    (["ddp", "train", "--bucket-mb", "x"], "error: --bucket-mb: cannot parse 'x' (not a number)"),
])
def test_a_list_item_that_is_not_a_number_says_so_in_words(lmsys, args, message):
    assert one_line(lmsys(*args)) == message


def test_comm_sweeps_dtype_in_one_job(lmsys):
    import json

    r = lmsys("comm", "allreduce", "--backend", "gloo", "--world-size", "2", "--sizes", "4KB", "--dtype", "fp32,bf16",
              "--warmup", "0", "--iters", "1", "-f", "json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert [(row["dtype"], row["correct"]) for row in doc["rows"]] == [("fp32", True), ("bf16", True)]
    assert doc["meta"]["run"].startswith("gloo, fp32,bf16, ")


@pytest.mark.parametrize("args,message", [
    (["--dtype", "fp32,fp32"], "error: --dtype: fp32 given twice"),
    (["--dtype", "fp32,int8"], "error: --dtype must be one of fp32, bf16, fp16, not 'int8'"),
    (["--dtype", "fp32,bf16", "--sizes", "6"], "error: --sizes 6: 6 bytes is not a whole number of fp32 elements"),
])
def test_comm_dtype_lists_are_checked_before_torchrun(lmsys, no_torchrun, args, message):
    assert message in one_line(lmsys("comm", "allreduce", "--backend", "gloo", *args))
