"""Checkpoint files: written atomically and sealed with a SHA-256 of their bytes, verified before they are read.

Sealing. ``torch.save`` writes a zip archive. The zip format lets the archive's end record carry a comment; the
writer puts ``mpistrategy-sha256:<64 hex digits>`` there, the SHA-256 of every byte of the file before the comment
(the end record included, with its comment length). The file stays a normal torch and Lightning checkpoint:
``torch.load`` reads it as any other, ``unzip -z file.ckpt`` prints the digest. A file that is not a zip archive
(another ``CheckpointIO``'s format) is written atomically but not sealed.

Atomic writing. The checkpoint goes to a temporary file in the same folder (a new file with an unguessable name,
so a link planted in a folder that others can write is not followed), which is sealed, flushed and fsynced,
then renamed over the destination (``os.replace``), and the folder is fsynced: a reader sees the old file or the
complete new one, also after a crash. A temporary left by a write killed before its rename is removed by the next
write of the same file (the temporaries of that name not modified since the new write began).

Verifying. A sealed file must hash to its digest. A torch zip archive without a seal (written by something else)
must pass the CRC-32 of each of its entries. An empty file, an archive cut short (no end record, or a shorter
comment), a digest or CRC mismatch, or a file that cannot be read raise :class:`CorruptCheckpointError`, which
names the file, the problem, and the newest older zip checkpoint in the same folder that passes these checks. A
path with no file is not a corrupt checkpoint: :func:`verify` raises ``FileNotFoundError`` for it. A file that
starts with a block of zero bytes (a write lost in a crash) is corrupt in any format. Other files (not zip archives)
are left to the loader; when the loader fails on one that is not a pickle either (the format of
``torch.save(..., _use_new_zipfile_serialization=False)``), :func:`unrecognised` names it as corrupt.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

SEAL_PREFIX = b"mpistrategy-sha256:"

_END_RECORD = b"PK\x05\x06"
_END_RECORD_SIZE = 22
_COMMENT_LENGTH_OFFSET = 20
_MAX_COMMENT = 0xFFFF
_LOCAL_HEADER = b"PK\x03\x04"
_CHUNK = 1 << 22
#: the leading bytes that must not all be zero
_HEAD = 4096


def is_remote(path: str) -> bool:
    """Whether ``path`` is an fsspec URL of a remote file system (``s3://``, ``gs://``; not ``file://``)."""
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    """``path`` as the local file system names it (a ``file://`` URL without its scheme)."""
    return path.removeprefix("file://")


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file that is damaged, incomplete or unreadable (the message names it and what to use instead)."""


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """``write(temporary)`` writes the checkpoint; it is sealed and renamed to ``path`` (see the module doc)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = _new_temporary(directory, os.path.basename(path))
    began = os.stat(temporary).st_mtime  # the file system's clock (a shared one's may differ from this host's)
    try:
        write(temporary)
        _seal(temporary)
        os.replace(temporary, path)
        _fsync_directory(directory)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    _remove_abandoned(directory, os.path.basename(path), began)


def _remove_abandoned(directory: str, name: str, began: float) -> None:
    """Remove the temporaries of ``name`` in ``directory`` that no writer has touched since this write began: those
    of writes killed before their rename (a preemption's SIGKILL), which would otherwise stay, one per kill."""
    prefix = f".{name}.tmp-"
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(prefix):
                with contextlib.suppress(OSError):  # gone already, or not ours to remove
                    if entry.stat(follow_symlinks=False).st_mtime < began:
                        os.remove(entry.path)


def _new_temporary(directory: str, name: str) -> str:
    """A new empty file for ``name`` in ``directory``, created by this call (``O_EXCL``, mode 0666 less the umask,
    an unguessable name): in a folder that others can write, a link they placed there is never written through."""
    while True:
        temporary = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666))
        except FileExistsError:
            continue
        return temporary


def _seal(path: str) -> None:
    """Append the SHA-256 comment to a zip archive without a comment; fsync the file either way."""
    with open(path, "r+b") as handle:
        size = handle.seek(0, os.SEEK_END)
        if size >= _END_RECORD_SIZE:
            handle.seek(size - _END_RECORD_SIZE)
            end = handle.read(_END_RECORD_SIZE)
            if end.startswith(_END_RECORD) and end[_COMMENT_LENGTH_OFFSET:] == b"\0\0":
                comment_length = len(SEAL_PREFIX) + 64
                handle.seek(size - _END_RECORD_SIZE + _COMMENT_LENGTH_OFFSET)
                handle.write(struct.pack("<H", comment_length))
                handle.flush()
                handle.seek(0)
                digest = _sha256(handle, size)
                handle.seek(size)
                handle.write(SEAL_PREFIX + digest.encode("ascii"))
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_directory(directory: str) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sha256(handle, length: int) -> str:
    """SHA-256 (hex) of the next ``length`` bytes of ``handle``."""
    digest = hashlib.sha256()
    remaining = length
    while remaining:
        chunk = handle.read(min(_CHUNK, remaining))
        if not chunk:
            break
        digest.update(chunk)
        remaining -= len(chunk)
    return digest.hexdigest()


def verify(path: str) -> None:
    """Raise :class:`CorruptCheckpointError` if ``path`` is damaged (see the module doc), ``FileNotFoundError`` if
    there is no file there; return if it is sound."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    problem = find_problem(path)
    if problem is not None:
        raise CorruptCheckpointError(corrupt_message(path, problem, older_sound_checkpoint(path)))


def find_problem(path: str) -> str | None:
    """What is wrong with the checkpoint at ``path`` (a phrase), or ``None``."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            if size == 0:
                return "the file is empty (0 bytes)"
            handle.seek(0)
            head = handle.read(_HEAD)
            if not any(head):
                return f"its first {len(head)} bytes are all zero (a write lost in a crash?)"
            is_zip = head.startswith(_LOCAL_HEADER)
            comment = _zip_comment(handle, size)
            if comment is None:
                return (
                    f"it ends early: the zip archive has no end record ({size} bytes; cut short?)" if is_zip else None
                )
            if comment.startswith(SEAL_PREFIX):
                return _check_seal(handle, size, comment)
        return _check_entries(path) if is_zip else None
    except OSError as error:
        return f"it cannot be read ({error})"


def _zip_comment(handle, size: int) -> bytes | None:
    """The archive comment if the file ends with a zip end record and its comment, else ``None``."""
    tail_size = min(size, _END_RECORD_SIZE + _MAX_COMMENT)
    handle.seek(size - tail_size)
    tail = handle.read(tail_size)
    start = tail.rfind(_END_RECORD)
    while start >= 0:
        if start + _END_RECORD_SIZE <= len(tail):
            (length,) = struct.unpack_from("<H", tail, start + _COMMENT_LENGTH_OFFSET)
            if start + _END_RECORD_SIZE + length == len(tail):
                return tail[start + _END_RECORD_SIZE :]
        start = tail.rfind(_END_RECORD, 0, start)
    return None


def _check_seal(handle, size: int, comment: bytes) -> str | None:
    recorded = comment[len(SEAL_PREFIX) :].decode("ascii", errors="replace")
    handle.seek(0)
    actual = _sha256(handle, size - len(comment))
    if actual == recorded:
        return None
    return (
        f"its contents do not match the SHA-256 recorded when it was written (recorded {recorded[:16]}..., "
        f"now {actual[:16]}...): the file changed after it was saved"
    )


def _check_entries(path: str) -> str | None:
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as error:
        return f"its zip structure is damaged ({error})"
    return None if damaged is None else f"the CRC-32 of its entry {damaged!r} does not match its data"


def unrecognised(path: str) -> str | None:
    """For a file its loader failed on: what shows it is no torch checkpoint (a phrase), or ``None`` if it is a zip
    archive or a pickle (protocol 2 to 5), whose failure is the loader's to tell."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
    except OSError as error:
        return f"it cannot be read ({error})"
    if head.startswith(_LOCAL_HEADER) or (len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5):
        return None
    return f"it is neither a zip archive nor a pickle (its first bytes are {head.hex(' ')}): not a torch checkpoint"


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(len(_LOCAL_HEADER)) == _LOCAL_HEADER


def older_sound_checkpoint(path: str) -> str | None:
    """The newest other ``*.ckpt`` zip archive in ``path``'s folder, not newer than ``path``, that passes
    :func:`verify` (a file of another format cannot be checked, so it is not offered)."""
    target = Path(path).resolve()
    try:
        limit = target.stat().st_mtime
    except OSError:
        limit = float("inf")
    candidates = []
    for candidate in target.parent.glob("*.ckpt"):
        try:
            modified = candidate.stat().st_mtime
            if candidate.is_file() and candidate.resolve() != target and modified <= limit and _is_zip(candidate):
                candidates.append((modified, candidate))
        except OSError:
            continue
    for _, candidate in sorted(candidates, reverse=True):
        if find_problem(str(candidate)) is None:
            return str(candidate)
    return None


def corrupt_message(path: str, problem: str, alternative: str | None) -> str:
    """The error text for a corrupt checkpoint: the file, the problem, and what to resume from instead."""
    advice = (
        f"An older checkpoint in the same folder passes the check: {alternative} (resume from it, e.g. "
        f"ckpt_path={alternative})."
        if alternative
        else "No older checkpoint in the same folder passes the check."
    )
    return f"Checkpoint {path} is corrupt: {problem}. Refusing to load it. {advice}"
