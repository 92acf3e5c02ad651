"""torch DCP's ``FileSystemWriter``/``FileSystemReader`` on a :class:`~impl.common.storage.emulator.Storage`,
so DCP pays the same per-request latency and bandwidth cap as our format.

Reads: DCP reads each saved chunk item (``_slice_file``) and ``torch.load``s it, then slices
the part it needs; we fetch the item's whole byte range as one request (its best case: one
read per chunk item, no coalescing across items), then hand DCP that buffer. Writes: DCP
streams each file sequentially; every non-contiguous write on a handle is a request.
"""
from __future__ import annotations

import io
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Generator

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from .emulator import Storage


class _CountedWriteStream(io.RawIOBase):
    def __init__(self, f, storage: Storage) -> None:
        self._f, self._storage, self._end = f, storage, None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b) -> int:
        pos = self._f.tell()
        n = self._f.write(b)
        self._storage.charge("write", 0 if self._end == pos else 1, n)
        self._end = pos + n
        return n

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()


class EmulatedFileSystem(FileSystem):
    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    @contextmanager
    def create_stream(self, path, mode: str) -> Generator[io.IOBase, None, None]:
        path = Path(path)
        if "w" in mode:
            with path.open(mode) as f:
                yield _CountedWriteStream(f, self.storage)  # type: ignore[misc]
        else:
            with path.open(mode) as f:
                yield f  # reads are charged in _slice_file / read_metadata


class EmulatedFileSystemWriter(FileSystemWriter):
    def __init__(self, path, storage: Storage, **kw) -> None:
        super().__init__(path, **kw)
        self.fs = EmulatedFileSystem(storage)


class EmulatedFileSystemReader(FileSystemReader):
    def __init__(self, path, storage: Storage) -> None:
        super().__init__(path)
        self.storage = storage
        self.fs = EmulatedFileSystem(storage)

    def _slice_file(self, file, sinfo):
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        self.storage.charge("read", 1, len(data))
        return io.BytesIO(data)

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        self.storage.charge("read", 1, os.path.getsize(path))
        return super().read_metadata(*args, **kwargs)
