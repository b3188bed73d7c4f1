"""Directories a command writes, written so that nothing the user owns is lost.

A command that writes a directory (export, quantize, a training run's final model) builds it in a hidden
sibling (`.NAME.partial-XXXX`) and renames it into place once complete, so a crash at any point leaves the old
contents intact. Before anything is written the target is checked: a path that is a file, that is the
command's own input (or holds it, or lies inside it), or a non-empty directory without `overwrite` is refused
with a line naming it. A single output file (a plot) is written the same way: beside its target, renamed into
place, and an existing file is replaced only with `overwrite`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path


class OutputDirError(FileExistsError):
    """The output path cannot be written as asked; the message names it and what to do."""


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def check_output_dir(target: str | os.PathLike, *, overwrite: bool = False,
                     sources: Sequence[str | os.PathLike] = (), what: str = "output") -> Path:
    """The target as an absolute path, if a command may write it (see the module docstring)."""
    if not os.fspath(target).strip():
        raise OutputDirError(f"{what} is empty; give a directory path")
    target = Path(target).expanduser().absolute()
    if target.exists() and not target.is_dir():
        raise OutputDirError(f"{what} {target} exists and is not a directory; choose a directory path")
    for source in sources:
        source = Path(source).expanduser().absolute()
        if _overlaps(target.resolve(), source.resolve()):
            raise OutputDirError(f"{what} {target} is or overlaps the input {source}: writing it would destroy what "
                                 "is read; choose another directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise OutputDirError(f"{what} {target} is a non-empty directory; choose a new or empty directory, or give "
                             "--overwrite to replace it")
    return target


def make_dirs(path: Path, what: str = "output") -> None:
    """mkdir -p, failing with a line that names the option rather than a bare errno."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"{what} {path}: cannot create the directory: {e.strerror or e}") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _remove_stale_staging(target: Path) -> None:
    """Staging siblings of `target` left by a writer that was killed (its pid, in the name, is gone). A writer
    killed between moving the old `target` aside and renaming the new one into place left no `target`: its old
    contents are put back rather than removed."""
    for path in sorted(target.parent.glob(f".{glob.escape(target.name)}.*-*-*")):
        kind, _, rest = path.name[len(target.name) + 2:].partition("-")
        pid = rest.partition("-")[0]
        if kind in ("partial", "old") and pid.isdigit() and not _alive(int(pid)):
            if kind == "old" and not target.exists():
                os.replace(path, target)
            else:
                shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def staged_output_dir(target: str | os.PathLike, *, overwrite: bool = False,
                      sources: Sequence[str | os.PathLike] = (), what: str = "output") -> Iterator[Path]:
    """Yields an empty hidden sibling of `target` to write into; on success it replaces `target` (the old
    contents are removed only after the new directory is in place), on an exception it is removed. What a
    killed writer left beside `target` is cleaned up first."""
    target = check_output_dir(target, overwrite=True, what=what)  # an empty path, a file: refused
    _remove_stale_staging(target)  # first: it may put a killed writer's old target back, which is then checked
    target = check_output_dir(target, overwrite=overwrite, sources=sources, what=what)
    make_dirs(target.parent, what)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
    try:
        yield staging
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-{os.getpid()}-", dir=target.parent))
            os.replace(target, old)  # an empty directory is replaced by the target's rename
            os.replace(staging, target)
            shutil.rmtree(old)
        else:
            os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def check_output_file(target: str | os.PathLike, *, overwrite: bool = False,
                      sources: Sequence[str | os.PathLike] = (), what: str = "output") -> Path:
    """The target as an absolute path, if a command may write it: not a directory, not one of `sources`, not an
    existing file unless `overwrite`, in a directory that exists."""
    target = Path(target).expanduser().absolute()
    if target.is_dir():
        raise OutputDirError(f"{what} {target} is a directory; give a file path")
    for source in sources:
        if target.exists() and Path(source).exists() and target.samefile(source):
            raise OutputDirError(f"{what} {target} is the input {source}: writing it would destroy what is read; "
                                 "choose another path")
    if target.exists() and not overwrite:
        raise OutputDirError(f"{what} {target} exists; choose another path, or give --overwrite to replace it")
    if not target.parent.is_dir():
        raise OutputDirError(f"{what} {target}: the directory {target.parent} does not exist")
    return target


@contextlib.contextmanager
def staged_output_file(target: str | os.PathLike, *, overwrite: bool = False,
                       sources: Sequence[str | os.PathLike] = (), what: str = "output") -> Iterator[Path]:
    """Yields a hidden sibling path of `target` to write; on success it replaces `target`, on an exception it is
    removed. A directory, one of `sources`, or an existing file without `overwrite` is refused first."""
    target = check_output_file(target, overwrite=overwrite, sources=sources, what=what)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.partial-{os.getpid()}-", suffix=target.suffix,
                                dir=target.parent)
    os.close(fd)
    staging = Path(name)
    try:
        yield staging
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
