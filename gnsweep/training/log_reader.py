"""Reading what a script writes, in bounded pieces: its log file as it grows, its printed
lines, and a line too long to be a row named and skipped.

A log file must be a regular file: a FIFO or a device would block the reader (or never end),
so it fails the run at once. Reads take at most `CHUNK_BYTES` at a time and keep at most
`MAX_LINE_BYTES` of an unfinished line: a file with a gigabyte-long unterminated tail (a
preallocated or sparse file) costs a bounded amount of memory, whatever its size.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from gnsweep.errors import ScriptFailed

MAX_LINE_BYTES = 1 << 20
"""The longest line read as a row (1 MiB): a longer one is named on stderr and skipped."""
CHUNK_BYTES = 1 << 20
"""How much of a file one read takes."""


def skipped(where: str) -> None:
    """Say that the line at `where` was too long to be a row."""
    print(f"gnsweep: {where}: a line over {MAX_LINE_BYTES} bytes, skipped (not a row)",
          file=sys.stderr, flush=True)


def _open_regular(path: Path) -> int | None:
    """A read descriptor of `path` (None: not there). ScriptFailed when it is no regular file:
    opened without blocking, so that a FIFO is refused, not waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ScriptFailed(f"{path}: cannot be read ({err.strerror or err})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) \
            else "not a regular file"
        raise ScriptFailed(f"{path}: the log file is {kind}; task.log_file must name a "
                           "regular file the command writes")
    return fd


class LineReader:
    """A file another process appends to, read line by line as it grows: from its end when it
    exists already (an earlier attempt's lines), from its start when it is new or rewritten.
    Memory stays bounded: `CHUNK_BYTES` a read, `MAX_LINE_BYTES` of an unfinished line."""

    def __init__(self, path: Path, *, skip_existing: bool) -> None:
        self.path = path
        self.offset, self.line, self.inode = 0, 0, None
        self.partial = b""
        self.cutting = False  # inside a line over the limit: dropped up to its newline
        if skip_existing:
            fd = _open_regular(path)
            if fd is not None:
                with os.fdopen(fd, "rb") as handle:
                    self.inode = os.fstat(handle.fileno()).st_ino
                    self._count_to_end(handle)

    def _count_to_end(self, handle: IO[bytes]) -> None:
        """Skip the file's complete lines, counting them; an unfinished last line stays to be
        read (or, over the limit, is dropped up to its newline)."""
        complete = 0
        while chunk := handle.read(CHUNK_BYTES):
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                self.line += chunk.count(b"\n")
                complete = self.offset + newline + 1
            self.offset += len(chunk)
        tail = self.offset - complete
        if tail > MAX_LINE_BYTES:
            self.line += 1
            self.cutting = True
            skipped(f"{self.path}:{self.line}")
        else:
            self.offset = complete

    def lines(self) -> Iterator[tuple[int, str, bool]]:
        """New complete lines: (line number, text, whether the file started over here)."""
        try:
            size = os.stat(self.path).st_size
        except OSError:
            return
        fd = _open_regular(self.path)
        if fd is None:
            return
        with os.fdopen(fd, "rb") as handle:
            st = os.fstat(handle.fileno())
            restarted = False
            if (self.inode is not None and st.st_ino != self.inode) or st.st_size < self.offset:
                self.offset, self.line, self.partial, restarted = 0, 0, b"", True
                self.cutting = False
            self.inode = st.st_ino
            size = st.st_size
            handle.seek(self.offset)
            while self.offset < size:
                chunk = handle.read(min(CHUNK_BYTES, size - self.offset))
                if not chunk:
                    break
                self.offset += len(chunk)
                for number, text in self._split(chunk):
                    yield number, text, restarted
                    restarted = False

    def _split(self, chunk: bytes) -> Iterator[tuple[int, str]]:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end < 0:
                rest = chunk[start:]
                if self.cutting:
                    return
                if len(self.partial) + len(rest) > MAX_LINE_BYTES:
                    self.line += 1
                    skipped(f"{self.path}:{self.line}")
                    self.partial, self.cutting = b"", True
                else:
                    self.partial += rest
                return
            piece, start = chunk[start:end], end + 1
            if self.cutting:  # the end of a line already named and skipped
                self.cutting = False
                continue
            self.line += 1
            raw, self.partial = self.partial + piece, b""
            if len(raw) > MAX_LINE_BYTES:
                skipped(f"{self.path}:{self.line}")
                continue
            yield self.line, raw.decode("utf-8", "replace").rstrip("\r")


NEWLINES = re.compile(rb"\r\n|\r|\n")
"""Where a printed line ends: a lone carriage return too (a progress bar's updates are lines,
as Python's text mode reads them)."""


def read_lines(stream: IO[bytes]) -> Iterator[tuple[str, bool]]:
    """The lines of a pipe, each at most `MAX_LINE_BYTES`: (text, whether it was cut). A cut
    line's text is its first `MAX_LINE_BYTES`; the rest is read and dropped. Reads what the
    pipe holds (`read1`), so a line is handed on as soon as it is complete."""
    partial, cutting = b"", False
    read = getattr(stream, "read1", stream.read)
    while chunk := read(CHUNK_BYTES):
        data = partial + chunk
        hold = b"\r" if data.endswith(b"\r") else b""  # perhaps the first half of \r\n
        *complete, partial = NEWLINES.split(data[:len(data) - len(hold)])
        partial += hold
        for raw in complete:
            if cutting:  # the end of a line already handed on cut
                cutting = False
                continue
            cut = len(raw) > MAX_LINE_BYTES
            yield raw[:MAX_LINE_BYTES].decode("utf-8", "replace"), cut
        if len(partial) > MAX_LINE_BYTES:
            if not cutting:
                yield partial[:MAX_LINE_BYTES].decode("utf-8", "replace"), True
            partial, cutting = b"", True
    partial = partial.rstrip(b"\r")
    if partial and not cutting:
        yield partial.decode("utf-8", "replace"), False
