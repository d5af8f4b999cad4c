"""Files written whole or not at all: a unique temporary name in the target folder, fsync, then rename."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Mapping

import torch


def temporary_name(path: Path) -> Path:
    """A hidden name beside `path`, unique per process and call (concurrent writers never share one)."""
    return path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"


def save_safetensors(tensors: Mapping[str, torch.Tensor], path, metadata: dict[str, str] | None = None) -> Path:
    """Write a safetensors file atomically, readable like any other file (safetensors creates 0600)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        try:
            save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        except OSError:
            raise
        except Exception as err:  # safetensors reports I/O failures as its own error type: keep their errno
            code = re.search(r"os error (\d+)|code: (\d+)", str(err))
            if code is None:
                raise
            number = int(code.group(1) or code.group(2))
            raise OSError(number, os.strerror(number), str(tmp)) from err
        os.chmod(tmp, 0o644)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_bytes(path, data: bytes) -> Path:
    """Write `data` to `path` atomically (a temporary name beside it, fsync, rename): readers see the old file
    or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def png_bytes(image) -> bytes:
    """A PIL image encoded as PNG, as `image.save(path)` writes it."""
    import io
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def save_png(image, path) -> Path:
    """Write a PIL image as a PNG file atomically (`write_bytes`): never a partial picture under its name."""
    return write_bytes(path, png_bytes(image))


class OutputWriteError(OSError):
    """Writing an output failed for a reason the user can fix (disk full, read-only, permission); the message
    names the path, what was being written and what survived."""

    def __str__(self) -> str:
        return str(self.strerror)


#: errno -> what the user reads and can do about it
_IO_REASONS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
               errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
               errno.EPERM: "permission denied", errno.EEXIST: "a file of that name is in the way (not a folder)",
               errno.ENOTDIR: "part of the path is a file, not a folder"}


def io_reason(err: OSError, path, key: str = "") -> str | None:
    """A user-facing reason for an I/O error a user can fix (with the free space when the disk is full) and
    what to do, naming the config `key` that chose the place; None for other errors."""
    reason = _IO_REASONS.get(err.errno)
    if reason is None:
        return None
    place = f"another folder for {key}" if key else "another output directory"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(path)
        if free is not None:
            reason += f" ({free / 2**20:.1f} MiB free there)"
        reason += f"; free some space or choose {place}"
    else:
        reason += f"; choose a writable folder for {key}" if key else "; choose a writable output directory"
    return reason


def free_bytes(path) -> int | None:
    """Free bytes on the volume holding `path` (or its nearest existing parent), None if unknown."""
    path = Path(path)
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


@contextlib.contextmanager
def writing(path, what: str, survived="", key: str = ""):
    """Turn a disk-full, read-only or permission error inside the block into an OutputWriteError naming
    `path`, the config `key` that chose it, `what` was being written and what `survived` (a text, or a callable
    giving it, asked only on an error; other errors pass unchanged)."""
    try:
        yield
    except OSError as err:
        reason = io_reason(err, path, key)
        if reason is None or isinstance(err, OutputWriteError):
            raise
        where = f" ({key})" if key else ""
        survived = survived() if callable(survived) else survived
        raise OutputWriteError(err.errno, f"could not write {what} to {str(path)!r}{where}: {reason}."
                                          + (f" {survived}" if survived else "")) from err


LOCK_NAME = ".qwen-edit.lock"


class OutputDirBusyError(RuntimeError):
    """Another live process (or another run in this one) writes to the same output directory."""


class OutputLock:
    """One writer per output directory: an advisory lock the process holds on the directory itself (flock on
    its descriptor on POSIX; on Windows, where only files lock, msvcrt on `<dir>/.qwen-edit.lock`). The kernel
    releases it when the holder exits or is killed (SIGKILL included), so a crashed run never leaves a stale
    lock, and deleting a file cannot defeat it. `<dir>/.qwen-edit.lock` only tells a refused run who holds the
    folder (PID, host, start time); it is removed when the lock is released."""

    def __init__(self, directory, purpose: str = "training", key: str = "train.output_dir"):
        self.directory = Path(directory)
        self.key = key
        self.path = self.directory / LOCK_NAME
        self.purpose = purpose
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "OutputLock":
        """Take the lock now or raise OutputDirBusyError naming the holder; never waits."""
        import datetime
        with writing(self.directory, "the run's lock file", key=self.key):
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = _open_lockable(self.directory, self.path)
        try:
            _try_lock(fd)
        except OSError:
            os.close(fd)
            try:
                holder = self.path.read_text(encoding="utf-8").strip()
            except OSError:
                holder = ""
            raise OutputDirBusyError(
                f"output directory {str(self.directory)!r} is in use by another run ({holder or 'unknown holder'}); "
                "wait for it to finish or stop it, or choose another output directory") from None
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        try:
            with writing(self.directory, "the run's lock file", key=self.key):
                _write_holder(self.path, fd, f"PID {os.getpid()} on {_hostname()}, {self.purpose} started {started}\n")
        except BaseException:
            _unlock(fd)
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            if os.name != "nt":
                self.path.unlink(missing_ok=True)  # while still held: no other holder's file is removed
            _unlock(fd)
            os.close(fd)

    def __enter__(self) -> "OutputLock":
        return self.acquire() if not self.held else self

    def __exit__(self, *exc) -> None:
        self.release()


def _open_lockable(directory: Path, lock_file: Path) -> int:
    """The descriptor to lock: the directory's own on POSIX, the lock file's on Windows."""
    if os.name == "nt":
        return os.open(lock_file, os.O_RDWR | os.O_CREAT)
    return os.open(directory, os.O_RDONLY)


def _write_holder(path: Path, fd: int, text: str) -> None:
    """Who holds the lock, for a refused run's message (on Windows into the locked file itself)."""
    if os.name == "nt":
        os.lseek(fd, 0, os.SEEK_SET)
        os.truncate(fd, 0)
        os.write(fd, text.encode("utf-8"))
    else:
        write_bytes(path, text.encode("utf-8"))


def _hostname() -> str:
    import socket
    return socket.gethostname()


def _try_lock(fd: int) -> None:
    """An exclusive, non-blocking lock on the open descriptor; OSError when another holder has it."""
    if os.name == "nt":
        import msvcrt
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    else:
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _unlock(fd: int) -> None:
    if os.name == "nt":
        import msvcrt
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
    else:
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_UN)
