"""Crash-safe writes: results, reports, cache entries, checkpoints and exported folders appear whole or not at all,
and a write replaces only what tcal wrote itself.

- New content is built beside its target (a temporary sibling, on the target's own filesystem) and renamed over
  it, so a kill, a full disk or a crash mid-write leaves the previous file or folder whole. Lightning
  checkpoints go the same way (`atomic_checkpoint_io`), never through the default temporary folder.
- A temporary sibling carries its writer's host and pid (`.<name>.tcal-<host>-<pid>-<random>.tmp`): the next write
  of the same target removes those of writers that are dead (same host), so a killed write leaves nothing behind
  for long; a live writer's (a parallel job's) is never touched.
- A folder export (`write_folder_atomic`) writes a manifest of its files (`.tcal-export.json`) and replaces an
  existing folder only when everything in it is listed there, or when it is empty. A folder holding anything
  else (`notes.txt`), the working folder or one above it, or a file where the folder should be, is refused with
  one line naming it (`WriteRefused`), before anything is written: nothing of the user's is ever deleted.
- A write the filesystem refuses (full disk, read-only, no permission, a file where a folder is expected)
  raises `WriteFailed`: one line naming the path and the cause.

Whatever is written gets the modes of a plain `open` under the user's umask (files 0666, folders 0777, less
the umask), not the 0600/0700 of the temporary files it starts as: a cache shared by a team stays readable.
"""

from __future__ import annotations

import errno
import functools
import io
import json
import math
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable

from tcal.errors import ConfigError

MANIFEST = ".tcal-export.json"  # in an exported folder: the files tcal wrote there


class WriteRefused(ConfigError):
    """Something tcal did not write is where a write would go (a user's file in an export folder, a file where a
    folder is expected, the working folder): refused, naming it, with nothing written or deleted."""


class WriteFailed(OSError):
    """The filesystem refused a write (full disk, read-only, permissions): one line naming the path and the cause;
    the previous content of the target is whole."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()


def write_failure(path: Path, err: OSError, kept: bool = True) -> WriteFailed:
    """The one line of a refused write; `kept`: the write was atomic, so the previous content is whole (a log
    file's or Hydra's own writes are not)."""
    cause = err.strerror or type(err).__name__
    code = f" ({errno.errorcode.get(err.errno, err.errno)})" if err.errno else ""
    failed = WriteFailed(f"cannot write {path}: {cause}{code}{'; the previous content is kept' if kept else ''}")
    failed.errno, failed.filename = err.errno, str(path)
    return failed


def in_the_way(folder: Path) -> Path | None:
    """The first existing path on the way to `folder` (itself included) that is not a folder, or None."""
    for part in [*reversed(folder.parents), folder]:
        if part.exists() and not part.is_dir():
            return part
    return None


def make_folder(folder: Path) -> None:
    """`folder` and its parents, or WriteRefused naming a file in the way, or WriteFailed."""
    blocker = in_the_way(folder)
    if blocker is not None:
        raise WriteRefused(f"{blocker} is a file; expected a folder there (writing {folder})")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise write_failure(folder, err) from None


def _temp_prefix(target: Path) -> str:
    return f".{target.name}.tcal-{socket.gethostname()}-{os.getpid()}-"


def _stale_pattern(target: Path) -> re.Pattern:
    return re.compile(rf"\.{re.escape(target.name)}\.tcal-(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]+\.(?P<kind>tmp|old)")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(target: Path) -> None:
    """Remove the temporary siblings of `target` left by dead writers on this host; a folder moved aside by a
    replace that was killed midway (`.old`) is put back when `target` is missing."""
    target = Path(target)
    pattern, host = _stale_pattern(target), socket.gethostname()
    try:
        siblings = list(target.parent.iterdir())
    except OSError:
        return
    for sibling in siblings:
        match = pattern.fullmatch(sibling.name)
        if not match or match["host"] != host or pid_alive(int(match["pid"])):
            continue
        if match["kind"] == "old" and not os.path.lexists(target):
            os.replace(sibling, target)
        elif sibling.is_dir() and not sibling.is_symlink():
            shutil.rmtree(sibling, ignore_errors=True)
        else:
            sibling.unlink(missing_ok=True)


def umask() -> int:
    """The process's umask (Linux reports it; elsewhere it is read by setting it and putting it back)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def chmod_as_created(path: Path) -> None:
    """The mode `path` (and, for a folder, everything in it) would have had if created by `open` / `mkdir`
    under the current umask."""
    mask = umask()
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not item.is_symlink():
            os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` into a temporary file in the same folder, then rename it over `path` (a file; a folder there is
    refused)."""
    path = Path(path)
    make_folder(path.parent)
    if path.is_dir():
        raise WriteRefused(f"{path} is a folder; expected a file there (or nothing)")
    clean_stale(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
    except OSError as err:
        raise write_failure(path, err) from None
    os.close(fd)
    try:
        write(Path(tmp))
        chmod_as_created(Path(tmp))  # after `write`: some writers (safetensors) replace the file
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        refused = os_error_of(err)
        if refused is not None and not isinstance(err, WriteFailed):
            raise write_failure(path, refused) from None
        raise
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())

    return write_atomic(path, write)


@functools.cache
def atomic_checkpoint_io():
    """A Lightning CheckpointIO (`Trainer(plugins=[...])`) that writes each checkpoint with `write_atomic`: to a
    temporary file in the checkpoint's own folder, fsynced, then renamed. Lightning's own writes through the
    system's temporary folder and, when that is another filesystem than the run's, copies over the old
    checkpoint in place (a kill during the copy leaves a truncated one)."""
    import torch
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class AtomicCheckpointIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            if storage_options is not None:
                raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")

            buffer = io.BytesIO()  # serialized first: torch.save into a full disk hides the OSError
            torch.save(checkpoint, buffer)

            def write(tmp: Path) -> None:
                with open(tmp, "wb") as handle:
                    handle.write(buffer.getbuffer())
                    handle.flush()
                    os.fsync(handle.fileno())

            write_atomic(Path(path), write)

    return AtomicCheckpointIO


def write_json_atomic(path: str | Path, data) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def null_non_finite(data, path: str = "") -> list[str]:
    """Replace every NaN or infinite float in `data` (nested dicts and lists, changed in place) by None, so its
    JSON holds no non-standard NaN / Infinity token; returns the replaced values as "dotted.path=value"."""
    found: list[str] = []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else []
    for key, value in items:
        where = f"{path}[{key}]" if isinstance(data, list) else f"{path}.{key}" if path else str(key)
        if isinstance(value, float) and not math.isfinite(value):
            data[key] = None
            found.append(f"{where}={value}")
        else:
            found += null_non_finite(value, where)
    return found


def flatten(tree: dict, sep: str = ".", keep: Callable[[object], bool] = lambda value: True,
            prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}, keys joined by `sep`: a non-empty mapping is walked, anything else (a list, an
    empty mapping) is a value, kept where `keep(value)`. The one flattener of nested results and configs."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, sep, keep, name + sep))
        elif keep(value):
            flat[name] = value
    return flat


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def listed_files(folder: Path) -> set[str] | None:
    """The files the manifest of `folder` lists (paths relative to it), or None when it has none."""
    try:
        data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        return {str(name) for name in data["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def foreign_entries(folder: Path) -> list[str]:
    """What `folder` holds that tcal's manifest there does not list (all of it without a manifest)."""
    own = listed_files(folder) or set()
    found = []
    for item in sorted(folder.rglob("*")):
        name = item.relative_to(folder).as_posix()
        if name == MANIFEST or item.is_dir() and not item.is_symlink():
            continue
        if name not in own:
            found.append(name)
    return found


def through_links(folder: str | Path) -> Path:
    """The folder a write to `folder` replaces: where `folder` is a symbolic link (to an earlier export, or to a
    folder not made yet), the folder it points at, so the write goes through the link and the link stays; `folder`
    itself otherwise. WriteRefused for a link that loops."""
    folder = Path(folder)
    if not folder.is_symlink():
        return folder
    try:
        return folder.resolve(strict=False)
    except (OSError, RuntimeError) as err:  # a loop of links
        raise WriteRefused(f"{folder} is a symbolic link that cannot be followed ({type(err).__name__}: {err}); "
                           f"expected a folder or a link to one") from None


def check_folder_target(folder: str | Path) -> Path:
    """`folder` can be written by `write_folder_atomic`: absent, empty, or a folder tcal exported whose every
    file its manifest lists; WriteRefused naming what is in the way otherwise (checked before any work). A link is
    checked as the folder it points at (`through_links`)."""
    folder = through_links(folder)
    blocker = in_the_way(folder)
    if blocker is not None:
        raise WriteRefused(f"{blocker} is a file; expected a folder there (writing {folder})")
    if not folder.exists():
        return folder
    where = folder.resolve()
    if where == Path.cwd().resolve() or where in Path.cwd().resolve().parents:
        raise WriteRefused(f"{folder}: refusing to write an export into the working folder or one above it "
                           f"(that would replace its files); expected a new or empty folder")
    foreign = foreign_entries(folder)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise WriteRefused(f"{folder} holds files tcal did not write ({shown}); refusing to replace them: move "
                           f"them away or choose a new or empty folder")
    return folder


def check_writable(folder: str | Path) -> None:
    """`folder` can be made and written here: a temporary folder is made (and removed) in the nearest existing folder
    on its way, so a read-only filesystem or a folder this user cannot write is one line before any work
    (`WriteRefused`), not a failure after it. Nothing is left behind."""
    folder = through_links(folder).absolute()
    existing = next(part for part in [folder, *folder.parents] if part.exists())
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=_temp_prefix(folder), suffix=".tmp"))
    except OSError as err:
        raise WriteRefused(f"{folder} cannot be written: {existing} refuses a new folder "
                           f"({err.strerror or type(err).__name__}); expected a folder this user can write") from None


def write_manifest(folder: Path) -> None:
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.name != MANIFEST and not (p.is_dir() and not p.is_symlink()))
    with open(folder / MANIFEST, "w", encoding="utf-8") as handle:
        json.dump({"written_by": "tcal", "files": files}, handle, indent=1)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def write_folder_atomic(folder: str | Path, write: Callable[[Path], None], replace: bool = True) -> Path:
    """`write(tmp)` into a temporary sibling folder, then rename it to `folder` (see the module doc: an existing
    folder is replaced only when it is empty or tcal's own export, `check_folder_target`). With `replace=False`
    (a cache folder that a parallel job may have finished first) an existing folder is kept and ours is dropped.
    Through a symbolic link the folder it points at is replaced (`through_links`), the link kept."""
    folder = through_links(folder)
    if replace:
        check_folder_target(folder)
    make_folder(folder.parent)
    clean_stale(folder)
    try:
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=_temp_prefix(folder), suffix=".tmp"))
    except OSError as err:
        raise write_failure(folder, err) from None
    try:
        write(tmp)
        write_manifest(tmp)
        chmod_as_created(tmp)
        if folder.exists() and not replace:
            shutil.rmtree(tmp)
            return folder
        if folder.exists():
            check_folder_target(folder)  # unchanged since the check before the work
            aside = Path(tempfile.mkdtemp(dir=folder.parent, prefix=_temp_prefix(folder), suffix=".old"))
            try:
                os.replace(folder, aside)  # an empty folder `aside` is replaced by the old export
            except BaseException:
                os.rmdir(aside)  # never an empty `.old` left beside the folder
                raise
            os.replace(tmp, folder)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        refused = os_error_of(err)
        if refused is not None and not isinstance(err, WriteFailed):
            raise write_failure(folder, refused) from None
        raise
    return folder


def os_error_of(err: BaseException) -> OSError | None:
    """The filesystem's refusal in `err`: an OSError with its errno, or one that a library's Rust writer reports as
    its own exception with the OS error in its text (tokenizers, safetensors: "No space left on device (os error
    28)"); None for anything else."""
    if isinstance(err, OSError):
        return err if err.errno is not None else None
    found = re.search(r"\(os error (\d+)\)", str(err)) if isinstance(err, Exception) else None
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))
