"""One shape for everything a command takes by name: a `Registry` of specs.

Attention implementations (`lmsys.kernels.registry.ATTENTION`), distributed strategies
(`lmsys.distributed.data_parallel.strategies.STRATEGIES`) and models (`lmsys.model.user.MODELS`) are each
one `Registry`. A spec is a frozen dataclass with a `name` and a one-line `help`, plus the fields the
commands ask of it (an attention's layout and device needs, what a strategy shards, how a model is
built); nothing tests a registered name with `==` outside its spec (tests/test_registry.py scans src/).

A registry is a read-only mapping name -> spec in registration order (`name in R`, `R[name]`,
`", ".join(R)`), and:
- `lookup(name)`: the spec of a registered name, else the one `from_path` makes for a user's
  `pkg.module:Name` / `path/to/file.py:Name` (it loads the user's code), else the miss error;
- `check(name)`: the same answer before anything is loaded (torch-free): the name, or the miss error;
- `listing()`: (name, help) rows for `lmsys list` and an option's `list` value, the import-path row last;
- `miss(name)`: "WHAT must be one of A, B, C or pkg.module:Name, not 'x'", with a hint naming the close
  registered names when there are any.

Torch-free: the CLI lists and validates names before torch loads. Specs hold their implementation as a
callable that imports what it needs when it runs.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, Optional, TypeVar

from lmsys.core.errors import LmsysError
from lmsys.core.imports import is_import_path


@dataclass(frozen=True)
class Spec:
    """What every registered thing has: its name and one line saying what it is."""

    name: str
    help: str


S = TypeVar("S", bound=Spec)


class Registry(Mapping, Generic[S]):
    """Specs by name (see the module docstring). `kind`: what the names name ("attention implementation");
    `option`: the command-line option that takes them (--impl); `path_form` / `path_help`: the import-path
    row (`None`: the registry takes no import paths); `from_path(name) -> spec`: the spec for a user's
    import path (loads it); `qualifier(spec)`: words the miss error puts in brackets after the names
    that share them ("yours-torch, yours-triton (with --adapters)"); `must`: the miss error's verb
    ("must be one of"); `is_path(name)`: what counts as an import path (default
    lmsys.core.imports.is_import_path)."""

    def __init__(self, kind: str, *, option: str, path_form: Optional[str] = "pkg.module:Name",
                 path_help: str = "", from_path: Optional[Callable[[str], S]] = None,
                 qualifier: Optional[Callable[[S], Optional[str]]] = None, must: str = "must be one of",
                 is_path: Callable[[str], bool] = is_import_path):
        self.kind, self.option, self.is_path = kind, option, is_path
        self.path_form, self.path_help, self.from_path = path_form, path_help, from_path
        self.qualifier, self.must = qualifier, must
        self._specs: dict[str, S] = {}

    # -- a mapping name -> spec
    def __getitem__(self, name: str) -> S:
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._specs)})"

    # -- filling it
    def add(self, spec: S) -> S:
        """Register `spec` under its name (a name registered again is replaced: a reload stays one entry)."""
        self._specs[spec.name] = spec
        return spec

    # -- asking it
    def takes_path(self, name: str) -> bool:
        """`name` is an import path this registry resolves (and not a registered name)."""
        return self.path_form is not None and name not in self._specs and self.is_path(name)

    def names(self, where: Optional[Callable[[S], bool]] = None) -> tuple[str, ...]:
        """The registered names, in order; with `where`, those whose spec it holds for."""
        return tuple(n for n, s in self._specs.items() if where is None or where(s))

    def check(self, name: str, *, what: Optional[str] = None) -> str:
        """`name` when it is registered or an import path this registry takes; the miss error otherwise.
        Loads nothing."""
        if name in self._specs or self.takes_path(name):
            return name
        raise self.miss(name, what=what)

    def lookup(self, name: str, *, what: Optional[str] = None) -> S:
        """The spec for a registered name, or the one `from_path` makes for an import path (the user's
        code is loaded now)."""
        if name in self._specs:
            return self._specs[name]
        if self.takes_path(name) and self.from_path is not None:
            return self.from_path(name)
        raise self.miss(name, what=what)

    def miss(self, name: str, *, what: Optional[str] = None) -> LmsysError:
        """The error for a name that is none of this registry's: every name it knows, and a hint naming the
        close ones."""
        groups: dict[Optional[str], list[str]] = {}
        for spec in self._specs.values():
            groups.setdefault(self.qualifier(spec) if self.qualifier else None, []).append(spec.name)
        known = ", ".join(", ".join(names) + (f" ({q})" if q else "") for q, names in groups.items())
        tail = f" or {self.path_form}" if self.path_form else ""
        close = difflib.get_close_matches(str(name), list(self._specs), n=3, cutoff=0.75)
        hint = f"did you mean {' or '.join(close)}? (`lmsys list` lists every name)" if close else None
        return LmsysError(f"{what or self.option} {self.must} {known}{tail}, not {name!r}", hint=hint)

    def listing(self, *, where: Optional[Callable[[S], bool]] = None,
                label: Optional[Callable[[S], str]] = None) -> list[tuple[str, str]]:
        """(name, help) of every name the option takes, the import-path row last. `label(spec)` replaces a
        spec's help; `where(spec)` leaves specs out."""
        rows = [(s.name, label(s) if label else s.help) for s in self._specs.values() if where is None or where(s)]
        if self.path_form is not None:
            rows.append((self.path_form, self.path_help))
        return rows
