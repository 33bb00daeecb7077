"""Every file lmsys writes (tables, plots, traces, snapshots) goes through here: whole or not at all.

What a path is decides how it is written, as the shell's `>` would treat it:
- a regular file, or nothing yet: written under a temporary name beside it and renamed when complete, so
  an interrupt or a full disk never leaves a partial file at the final path;
- a symlink: written through to its target (the link stays a link);
- a character device or a FIFO (`/dev/null`, `/dev/stdout`, a named pipe), or a path under /dev or
  /proc/self/fd: written to directly (a rename would replace the node with a regular file);
- a directory, a socket or a block device: one line, exit 2.
A failed write (ENOSPC, EIO, a name too long) is an `LmsysError` naming the path and the error.
"""

from __future__ import annotations

import itertools
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from lmsys.core.errors import LmsysError

_DIRECT_PREFIXES = ("/dev/", "/proc/self/fd/", "/proc/thread-self/fd/")
_counter = itertools.count()


def _failed(what: str, path, exc: OSError) -> LmsysError:
    return LmsysError(f"{what}: cannot write {path}: {exc.strerror or exc}")


def output_target(path: str | os.PathLike, *, what: str = "--output") -> tuple[Path, bool]:
    """(the file to write, whether to write it directly) for `path`; LmsysError for what cannot be a file."""
    given = Path(os.path.expanduser(os.fspath(path)))
    try:
        st = os.stat(given)  # follows symlinks: the type of what a write would reach
    except (FileNotFoundError, NotADirectoryError):  # check_output_path says which part is missing
        st = None
    except OSError as exc:  # ENAMETOOLONG, ELOOP, EACCES
        raise _failed(what, given, exc) from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise LmsysError(f"{what}: {given} is a directory; give a file name")
    if st is not None and (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        return given, True
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise LmsysError(f"{what}: {given} is not a regular file, a device or a pipe; give a file name")
    if str(given.absolute()).startswith(_DIRECT_PREFIXES):
        return given, True
    # A symlink (dangling or not) is written through to its target, as `>` does.
    return Path(os.path.realpath(given)) if os.path.islink(given) else given, False


def check_output_path(path: str | os.PathLike | None, *, what: str = "--output") -> None:
    """Fail before the work starts, not after, when `path` cannot be written."""
    if path is None:
        return
    target, direct = output_target(path, what=what)
    if direct:
        if not os.access(target, os.W_OK):
            raise LmsysError(f"{what}: {target} is not writable")
        return
    try:
        parent = target.absolute().parent
        for folder in (parent, *parent.parents):  # the nearest existing part of the path says what is wrong
            if folder.exists():
                break
        if folder != parent:
            if not folder.is_dir():
                raise LmsysError(f"{what}: {folder} is a file, not a directory")
            raise LmsysError(f"{what}: directory {parent} does not exist")
        if not parent.is_dir():
            raise LmsysError(f"{what}: {parent} is a file, not a directory")
        if not os.access(parent, os.W_OK):
            raise LmsysError(f"{what}: directory {parent} is not writable")
        # Permissions do not tell everything (/proc, a read-only mount, a full disk, a name too long): write
        # the temporary file atomic_output would use, and remove it.
        _probe(parent, target.name)
        if len(target.name.encode()) > os.pathconf(parent, "PC_NAME_MAX"):
            raise OSError(36, os.strerror(36))  # ENAMETOOLONG
        if os.path.isfile(target):  # an immutable file (chattr +i) cannot be replaced, even by root
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND))
    except OSError as exc:
        where = target if os.path.isfile(target) and exc.errno in (1, 13) else f"in {target.parent}"  # EPERM, EACCES
        raise LmsysError(f"{what}: cannot write {where} ({exc.strerror or exc})") from None


PROBE_BYTES = 64 * 1024  # what a probe writes: a full disk refuses it (an empty file needs no block)


def _probe(folder: Path, name: str = "probe") -> None:
    """Write PROBE_BYTES to a new hidden file in `folder`, to the disk (fsync), and remove it: a read-only
    mount, an immutable folder or a full disk fail here, before the work, with the OSError a real write
    would have met."""
    probe = _temporary_name(folder / name)
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(bytes(PROBE_BYTES))
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
        try:
            os.unlink(probe)
        except OSError:
            pass


def check_output_dir(path: str | os.PathLike, *, what: str = "--out-dir") -> Path:
    """Create the folder a command writes its files into (traces, snapshots, plots) and probe a write there,
    before any work: one LmsysError for a path that cannot be a folder, a read-only or full file system."""
    folder = Path(os.path.expanduser(os.fspath(path)))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LmsysError(f"{what}: cannot create {folder} ({exc.strerror or exc})") from None
    try:
        _probe(folder)
    except OSError as exc:
        raise LmsysError(f"{what}: cannot write in {folder} ({exc.strerror or exc})") from None
    return folder


def _temporary_name(target: Path) -> Path:
    """A hidden name beside `target` that keeps its extension (savefig and friends read it), short
    enough for the file system even when the target's name is near the limit."""
    stem = target.stem[:64]
    return target.with_name(f".{stem}.tmp-{os.getpid()}-{next(_counter)}{target.suffix[:16]}")


@contextmanager
def atomic_output(path: str | os.PathLike, *, what: str = "--output") -> Iterator[Path]:
    """Yield the path a writer (savefig, export_chrome_trace, open) should write to; when the block ends
    without an exception it becomes `path`. Devices and pipes are written directly; a failure removes the
    temporary file and is one line (LmsysError)."""
    target, direct = output_target(path, what=what)
    if direct:
        try:
            yield target
        except OSError as exc:
            raise _failed(what, path, exc) from None
        return
    tmp = _temporary_name(target)
    try:
        try:
            mode = os.stat(target).st_mode & 0o7777  # an existing file keeps its permissions, as with `>`
        except FileNotFoundError:
            mode = None
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except OSError as exc:
        raise _failed(what, path, exc) from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def save_figure(fig, path: str | os.PathLike, *, what: str = "--plot", dpi: int | None = None) -> None:
    """`fig.savefig` to `path` as atomic_output says, in the format its extension names (.png, .pdf, .svg,
    ...), else PNG. The format is always passed: matplotlib would append .png to a name without an
    extension (`--plot /dev/full` wrote /dev/full.png) and read the temporary name's tail as one."""
    suffix = Path(os.fspath(path)).suffix.lower().lstrip(".")
    fmt = suffix if suffix in fig.canvas.get_supported_filetypes() else "png"
    with atomic_output(path, what=what) as tmp:
        fig.savefig(tmp, format=fmt, dpi=dpi if dpi is not None else "figure")


def write_atomic(path: str | os.PathLike, data: str | bytes, *, what: str = "--output") -> None:
    """Write `data` to `path` as atomic_output says (whole or not at all; devices and pipes directly)."""
    with atomic_output(path, what=what) as out:
        with open(out, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
