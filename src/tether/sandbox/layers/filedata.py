"""A file's data copied and compared with its holes kept as holes: `data_segments` (where the data lies),
`same_data` (equal contents, reading only the data) and `copy_data` (a reflink where the filesystem has them,
else only the stretches that hold data). On open file descriptors; standard library only (`fs.py`, the layers
and the journal use them)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

__all__ = ["copy_data", "data_segments", "same_data"]

_FICLONE = 0x40049409  # ioctl: share the source's extents (btrfs, xfs, bcachefs); no data is copied
_SEG = 1 << 24  # at most this much per copy_file_range call, so a huge extent is copied in bounded steps


def data_segments(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of each stretch of `fd` that holds data, skipping holes (SEEK_DATA/SEEK_HOLE);
    a filesystem without them reports the whole file as one stretch."""
    if size <= 0:
        return
    seek_data, seek_hole = getattr(os, "SEEK_DATA", None), getattr(os, "SEEK_HOLE", None)
    if seek_data is None or seek_hole is None:
        yield 0, size
        return
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, seek_data)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole from here to the end
                return
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                yield pos, size - pos
                return
            raise
        if start >= size:
            return
        end = min(os.lseek(fd, start, seek_hole), size)
        yield start, end - start
        pos = end


def same_data(a: int, b: int, length: int, chunk: int = 1 << 16) -> bool:
    """Whether the first `length` bytes of the open files `a` and `b` are equal (both must be that long).
    Where their holes lie alike only the stretches with data are read; else everything (a hole reads
    as zeros)."""
    def clipped(fd: int) -> list[tuple[int, int]]:
        return [(start, min(n, length - start)) for start, n in data_segments(fd, length)]

    segments = clipped(a)
    if segments != clipped(b):
        segments = [(0, length)]
    for start, n in segments:
        for pos in range(start, start + n, chunk):
            step = min(chunk, start + n - pos)
            if os.pread(a, step, pos) != os.pread(b, step, pos):
                return False
    return True


def copy_data(src: int, dst: int) -> int:
    """Copy the content of the open file `src` into the empty open file `dst`, holes kept as holes.

    A reflink (FICLONE) where the filesystem shares extents; else only the stretches that hold data,
    by `copy_file_range` (in-kernel, no copy through this process) or read/write, and `dst` is then
    sized to match, so a 2 GiB sparse file with 1 byte of data costs one block, not 2 GiB. Returns the
    size. Both fds' offsets are left undefined.
    """
    size = os.fstat(src).st_size
    with contextlib.suppress(OSError):
        import fcntl  # POSIX only

        fcntl.ioctl(dst, _FICLONE, src)
        return size
    ranged = hasattr(os, "copy_file_range")
    for start, length in data_segments(src, size):
        done = 0
        while done < length:
            step = min(_SEG, length - done)
            n = 0
            if ranged:
                try:
                    n = os.copy_file_range(src, dst, step, start + done, start + done)
                except OSError as exc:
                    if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF):
                        raise
                    ranged = False
            if n <= 0:
                chunk = os.pread(src, min(step, 1 << 20), start + done)
                if not chunk:
                    break  # the source shrank meanwhile
                n = os.pwrite(dst, chunk, start + done)
            done += n
    os.ftruncate(dst, size)
    return size
