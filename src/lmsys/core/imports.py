"""Import what a user names on the command line (torch-free): `pkg.module:Name` or `path/to/file.py:Name`
for one object, `pkg.module` or `path/to/file.py` for a whole module (a CS336 adapters file).

A file is imported by path (importlib.util.spec_from_file_location) under a name of its own, with its
folder on sys.path so that it can import its neighbours, and the repository it lives in (the nearest folder
one or two levels above holding a pyproject.toml, and its src/) so that it can import the package there:
CS336's tests/adapters.py imports the student's package from the repository root. A module that does not
import is one LmsysError naming the file, the line and the error.

Every module loaded here is remembered with the option that named it (`--model mine.py:Net`), so that a
failure of the user's code, wherever lmsys calls it (a row, a rank, a constructor), is told in one way
(`describe_user_failure`): `sys.exit` inside it is "your code (--impl exit0.py:f) called sys.exit(0)", any
other exception is prefixed with the option that supplied the code ("--model mine.py:Net: IndexError: ...").
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType

from lmsys.core.errors import LmsysError


# file (resolved) or module name -> (option, spec as given), in the order loaded
_USER_CODE: dict[str, tuple[str, str]] = {}


def _remember(module: ModuleType, *, what: str, spec: str) -> None:
    origin = getattr(module, "__file__", None)
    key = str(Path(origin).resolve()) if origin else module.__name__
    _USER_CODE.setdefault(key, (what, spec))


def forget_user_code() -> None:
    """A new command starts (tests run several in one process): no user code loaded yet."""
    _USER_CODE.clear()


def user_code_for(exc: BaseException, *, sole: bool = True) -> tuple[str, str] | None:
    """(option, spec) of the user's code `exc` belongs to: the deepest frame of its traceback in a file loaded
    here; else (`sole`), when a single piece of user code was loaded, that one (a model's wrong output fails
    in lmsys's or torch's code, after the user's own returned). None when no user code was loaded."""
    files = {}
    for f in traceback.extract_tb(exc.__traceback__):
        try:
            files[str(Path(f.filename).resolve())] = True
        except (OSError, ValueError):
            continue
    mine = [_USER_CODE[name] for name in reversed(list(files)) if name in _USER_CODE]
    if mine:
        return mine[0]
    distinct = set(_USER_CODE.values())
    return distinct.pop() if sole and len(distinct) == 1 else None


def describe_user_failure(exc: BaseException) -> str | None:
    """One line for a failure of the user's code, or None when it is not one (no user code loaded, or
    lmsys's own LmsysError, which already says what is wrong). `sys.exit(N)` inside the user's code is a
    failed run whatever N is: lmsys was not done."""
    if isinstance(exc, LmsysError) or isinstance(exc, (KeyboardInterrupt, GeneratorExit)):
        return None
    who = user_code_for(exc, sole=not isinstance(exc, SystemExit))  # sys.exit: the user's frame raised it
    if who is None:
        return None
    what, spec = who
    if isinstance(exc, SystemExit):
        code = "" if exc.code is None else repr(exc.code)
        return f"your code ({what} {spec}) called sys.exit({code})"
    if not isinstance(exc, Exception):
        return None
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{what} {spec}: {type(exc).__name__}: {text}" if text else f"{what} {spec}: {type(exc).__name__}"


def is_import_path(name: str) -> bool:
    """`pkg.module:Name` or `file.py:Name` (a registry name never has a colon)."""
    return isinstance(name, str) and ":" in name


def split_import_path(spec: str, *, what: str) -> tuple[str, str]:
    """'pkg.mod:Name' -> ('pkg.mod', 'Name'); a Windows drive letter's colon is not the separator."""
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr or not all(part.isidentifier() for part in attr.split(".")):
        raise LmsysError(f"{what} {spec!r}: expected pkg.module:Name or path/to/file.py:Name")
    return module, attr


def load_module(spec: str, *, what: str) -> ModuleType:
    """A module by import name or by .py path (imported once per process), remembered as the user's code
    that `what` supplied."""
    module = _load_module(spec, what=what)
    _remember(module, what=what, spec=spec)
    return module


def _load_module(spec: str, *, what: str) -> ModuleType:
    if spec.endswith(".py") or "/" in spec or "\\" in spec:
        return _load_file(Path(spec).expanduser(), what=what)
    if not all(part.isidentifier() for part in spec.split(".")):
        raise LmsysError(f"{what} {spec!r}: neither a .py file nor an importable module name")
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as exc:
        if exc.name and (spec == exc.name or spec.startswith(exc.name + ".")):
            raise LmsysError(f"{what} {spec!r}: no module named {exc.name!r} (not installed, or not on "
                             "PYTHONPATH)") from None
        raise LmsysError(f"{what} {spec}: {_where(exc, None)}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed to import: one line, where and why
        raise LmsysError(f"{what} {spec}: {_where(exc, None)}") from None


def load_object(spec: str, *, what: str):
    """The object `Name` (dotted names allowed: Outer.Inner) of `pkg.module:Name` or `file.py:Name`."""
    module_name, attr = split_import_path(spec, what=what)
    module = _load_module(module_name, what=what)
    _remember(module, what=what, spec=spec)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise LmsysError(f"{what} {spec!r}: {module_name} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def _load_file(path: Path, *, what: str) -> ModuleType:
    if path.is_dir():
        raise LmsysError(f"{what} {path}: is a directory, not a .py file")
    if not path.is_file():
        raise LmsysError(f"{what} {path}: no such file")
    resolved = path.resolve()
    name = f"lmsys_user_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    for folder in [str(resolved.parent)] + [str(root) for root in project_roots(resolved.parent)]:
        if folder not in sys.path:
            sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise LmsysError(f"{what} {path}: cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look themselves up here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - one line: the file, the line, the error
        del sys.modules[name]
        raise LmsysError(f"{what} {_where(exc, resolved)}") from None
    return module


PROJECT_FILES = ("pyproject.toml", "setup.py", "setup.cfg")


def project_roots(folder: Path, *, levels: int = 2) -> list[Path]:
    """The repository a file lives in, for its imports: the nearest folder up to `levels` above `folder`
    holding a pyproject.toml (or setup.py / setup.cfg), and its src/ where the package lives there. CS336's
    layout: repo/tests/adapters.py imports the student's package at repo/ (cs336_systems)."""
    for root in list(folder.parents)[:levels]:
        if any((root / name).is_file() for name in PROJECT_FILES):
            src = root / "src"
            return [root] + ([src] if src.is_dir() and not (src / "__init__.py").exists() else [])
    return []


def _where(exc: BaseException, path: Path | None) -> str:
    """'file.py:LINE: Error: message' at the deepest frame in `path` (or the deepest frame at all)."""
    message = f"{type(exc).__name__}: {' '.join(str(exc).split())}".rstrip(": ")
    if isinstance(exc, SyntaxError) and exc.filename:
        message = f"{type(exc).__name__}: {exc.msg}"
        return f"{exc.filename}:{exc.lineno}: {message}"
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if path is not None and Path(f.filename).resolve() == path]
    frame = (mine or [f for f in frames if "importlib" not in f.filename] or frames or [None])[-1]
    if frame is None:
        return f"{path}: {message}"
    return f"{frame.filename}:{frame.lineno}: {message}"


class NotImplementedByUser(Exception):
    """A user's function is missing or still raises NotImplementedError (the CS336 starting code): the
    row's status says which, and the other rows run."""

    def __init__(self, function: str):
        super().__init__(function)
        self.function = function

    @property
    def status(self) -> str:
        return f"not implemented ({self.function})"


def call_user(module, names: tuple[str, ...], *args, **kwargs):
    """The first of `names` that `module` has and that does not raise NotImplementedError, called;
    NotImplementedByUser(names[0]) when none does."""
    for name in names:
        fn = getattr(module, name, None)
        if fn is None:
            continue
        try:
            return fn(*args, **kwargs)
        except NotImplementedError:
            continue
    raise NotImplementedByUser(names[0])
