"""Parsing of the list- and size-valued options that many commands share."""

from __future__ import annotations

import re
from typing import Callable, Iterable, TypeVar

from lmsys.core.errors import LmsysError

T = TypeVar("T")

MiB = 2**20  # the unit every memory column is reported in

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30,
}


def choose(value: T, choices: Iterable[T], *, what: str) -> T:
    """`value` when it is one of `choices`; otherwise the one error every option with a fixed set of
    values gives: "WHAT must be one of A, B, C, not 'x'"."""
    choices = tuple(choices)
    if value not in choices:
        raise LmsysError(f"{what} must be one of {', '.join(map(str, choices))}, not {value!r}")
    return value


def parse_list(text: str | list[str] | None, convert: Callable[[str], T], *, what: str) -> list[T]:
    """'1,2, 4' or ['1,2', '4'] -> [1, 2, 4]; every item goes through `convert`. An empty value or item
    (`""`, `tiny,,tiny`) and an item given twice are errors naming the option, never dropped or run twice."""
    if text is None:
        return []
    parts = [text] if isinstance(text, str) else list(text)
    items = [p.strip() for part in parts for p in str(part).split(",")]
    if not any(items):
        raise LmsysError(f"{what}: expected a value or a comma-separated list, got {text!r}")
    if "" in items:
        raise LmsysError(f"{what}: empty item in {','.join(map(str, parts))!r}")
    twice = sorted({item for item in items if items.count(item) > 1})
    if twice:
        raise LmsysError(f"{what}: {', '.join(twice)} given twice; each value runs once, so give it once")
    expected = {int: "not a whole number", float: "not a number"}.get(convert)  # Python's words say less
    out = []
    for item in items:
        try:
            out.append(convert(item))
        except (ValueError, LmsysError) as exc:
            raise LmsysError(f"{what}: cannot parse {item!r} ({expected or exc})") from None
    return out


def parse_int_list(text, *, what: str, minimum: int = 1) -> list[int]:
    values = parse_list(text, int, what=what)
    for v in values:
        if v < minimum:
            raise LmsysError(f"{what} must be >= {minimum}, got {v}")
    return values


def parse_bytes(text: str, *, what: str = "size") -> int:
    """'1MB' -> 1_000_000, '1MiB' -> 1_048_576, '4096' -> 4096 (case-insensitive)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise LmsysError(f"{what}: cannot parse {text!r}: use e.g. 4096, 1MB, 10MiB, 1GB")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:
        raise LmsysError(f"{what} must be >= 1 byte, got {text!r}")
    return n


def format_bytes(n: float | None) -> str:
    """Binary units, as memory is reported by CUDA: 1536 -> '1.5 KiB'."""
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


BEYOND_ANY_MACHINE = 2**50  # 1 PiB: more memory than any GPU or host has, by orders of magnitude


def about_bytes(n: float) -> str:
    """An estimate in a message: 'about 80.5 GiB', and past any machine 'far more than any GPU or host has
    (over 1 PiB)' rather than a 20-digit number of GiB."""
    if n >= BEYOND_ANY_MACHINE:
        return "far more than any GPU or host has (over 1 PiB)"
    return f"about {format_bytes(n)}"


def a_or_an(word: str) -> str:
    """'a float', 'an int': the article a message puts before a type or a name."""
    return ("an " if word[:1].lower() in "aeiou" else "a ") + word


def check_message_sizes(labels: list[str], nbytes: list[int], dtype: str) -> None:
    """A message size that is not a whole number of elements of `dtype` is refused (it would be rounded)."""
    from lmsys.core.devices import DTYPE_BYTES  # devices imports this module

    width = DTYPE_BYTES[dtype]
    for label, n in zip(labels, nbytes):
        if n % width:
            raise LmsysError(f"--sizes {label}: {n} bytes is not a whole number of {dtype} elements "
                             f"({width} bytes each)", hint=f"give a multiple of {width} bytes")


def check_counts(**values: tuple[int, int]) -> None:
    """check_counts(steps=(steps, 1), warmup=(warmup, 0)): each option at least its minimum, or exit 2."""
    for opt, (value, minimum) in values.items():
        if value < minimum:
            raise LmsysError(f"--{opt.replace('_', '-')} must be >= {minimum}, got {value}")


def check_one_size(size: str | None, *, command: str, why: str) -> None:
    """--size is one preset or .yaml where a run looks at one model (`bench e2e` takes a comma list):
    a list there is one line, before torch is imported."""
    if size is not None and "," in size:
        raise LmsysError(f"--size {size}: {command} takes one preset or .yaml config, not a list ({why}); "
                         "run it once per size")


def check_dtypes(text: str | None, *, what: str = "--dtype") -> list[str] | None:
    """A comma list of dtypes, each one of fp32, bf16, fp16; None when the option is not given."""
    from lmsys.core.devices import DTYPE_CHOICES

    if text is None:
        return None
    return [choose(d, DTYPE_CHOICES, what=what) for d in parse_list(text, str, what=what)]
