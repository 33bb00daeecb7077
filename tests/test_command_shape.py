"""The command layer stays thin (issue 40, item 3): each function in src/lmsys/commands/ is at most 40 lines
of body (parse, one library resolve, one run, one emit), and every option flag is declared once: the flags
that several commands share in lmsys.commands.options, a command's own flags in its one signature."""

import ast
from collections import Counter
from pathlib import Path

import lmsys.commands as commands_pkg

COMMANDS = Path(commands_pkg.__file__).parent
MAX_BODY = 40


def _modules():
    return sorted(p for p in COMMANDS.glob("*.py") if p.name != "__init__.py")


def _body_lines(fn: ast.FunctionDef) -> int:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # the docstring is the command's --help, not its body
    return 0 if not body else body[-1].end_lineno - body[0].lineno + 1


def test_every_command_body_is_at_most_40_lines():
    long = {f"{path.name}:{node.name}": _body_lines(node) for path in _modules()
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef) and _body_lines(node) > MAX_BODY}
    assert not long, f"command bodies over {MAX_BODY} lines (move the checks into a library resolve): {long}"


def _is_call(node, name: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "typer")


def _declared_flags(path: Path) -> list[str]:
    """The first flag of every typer.Option declared in `path` (given, or the parameter's name)."""
    flags = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.arg) and node.annotation is not None:
            pairs = [(node.arg, call) for call in ast.walk(node.annotation) if _is_call(call, "Option")]
        elif isinstance(node, ast.Assign):
            pairs = [(None, call) for call in ast.walk(node.value) if _is_call(call, "Option")]
        else:
            continue
        for name, call in pairs:
            given = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            assert given or name, f"{path.name}: an Option alias without its flag: give it the flag"
            flags.append((given[0] if given else "--" + name.replace("_", "-")).split("/")[0])
    return flags


def test_every_flag_is_declared_once_and_shared_ones_in_options():
    from lmsys.commands.options import FLAGS

    shared = {flag.split("/")[0] for spellings in FLAGS.values() for flag in spellings}
    seen = Counter()
    for path in _modules():
        if path.name == "options.py":
            continue
        for flag in _declared_flags(path):
            assert flag not in shared, f"{path.name} declares {flag}: use lmsys.commands.options (opt or an alias)"
            seen[flag] += 1
    twice = {flag: n for flag, n in seen.items() if n > 1}
    assert not twice, f"flags declared in more than one place (move them to lmsys.commands.options): {twice}"
    primaries = Counter(spellings[0] for spellings in FLAGS.values())  # a switch and its on/off form differ
    assert all(n == 1 for n in primaries.values()), primaries


def test_every_command_takes_the_shared_spellings():
    """--context-length/--seq-len, --batch-size/--batch, --steps/--iters wherever the option exists."""
    from typer.main import get_command

    from lmsys.cli import app

    def walk(cmd, path=()):
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                yield from walk(sub, path + (name,))
        else:
            yield path, cmd

    pairs = (("--context-length", "--seq-len"), ("--batch-size", "--batch"), ("--steps", "--iters"))
    for path, cmd in walk(get_command(app)):
        for param in cmd.params:
            for a, b in pairs:
                if a in param.opts or b in param.opts:
                    assert {a, b} <= set(param.opts), (path, param.opts)
