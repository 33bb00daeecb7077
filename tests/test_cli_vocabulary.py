"""Issue 27 item 3-4: messages name the option as the user typed it (an alias such as --seq-len or --attn,
not the canonical name they did not type), and every sweepable option is a comma list wherever the
command can sweep it."""

from __future__ import annotations

import pytest

from test_cli_safety import one_line


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
    (["bench", "e2e", "--seq-len", "abc"], "error: Invalid value for '--seq-len': 'abc' is not a valid int"),
    (["bench", "e2e", "--context-length", "abc"], "error: Invalid value for '--context-length': 'abc' is not a valid int"),
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
