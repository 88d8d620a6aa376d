"""Part stores: the two ways an object appears whole or not at all.

- :class:`LocalStore` (a local or shared filesystem): write into ``_tmp/``, fsync, ``os.replace``
  into place (atomic), fsync the directory (the rename survives a machine crash).
- :class:`ObjectStore` (``s3://``, ``gs://``...): no rename, but every PUT is atomic, so an object
  is serialised in memory and written with one PUT at its final key; an upload killed halfway never
  becomes an object.

Both offer the same few operations; everything else about the output directory is
``directory.py``'s, once.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from pipeline.config import ConfigError
from pipeline.storage.uris import STORE_ERRORS, Location, access_error


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore:
    """A directory on a local or shared filesystem."""

    fs = None
    local = True

    def __init__(self, root: str) -> None:
        self.root = Path(os.path.realpath(root))  # real paths: a symlink cannot hide output-in-input
        self.uri = str(self.root)
        self.tmp = self.root / "_tmp"

    def path(self, *names: str) -> str:
        return str(self.root.joinpath(*names))

    def top(self) -> list[str]:
        """Names directly under the root ([] if it does not exist)."""
        return sorted(p.name for p in self.root.iterdir()) if self.root.is_dir() else []

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)

    def read_bytes(self, path: str) -> bytes:
        return Path(path).read_bytes()

    def list_files(self, folder: str, prefix: str, suffix: str) -> list[str]:
        d = self.root / folder
        return sorted(str(p) for p in d.glob(f"{prefix}*{suffix}")) if d.is_dir() else []

    def sink(self, dest: str) -> tuple[object, str]:
        """A writable file for ``dest`` → (stream, its temp path)."""
        tmp = self.tmp / (os.path.basename(dest) + f".{uuid.uuid4().hex[:8]}.inprogress")
        return open(tmp, "wb"), str(tmp)

    def finish(self, stream, tmp: str, dest: str, times_ns: tuple[int, int] | None = None) -> None:
        """Make ``dest`` the complete file written to ``stream`` (fsync, rename, fsync the dir)."""
        stream.flush()
        os.fsync(stream.fileno())
        stream.close()
        if times_ns is not None:         # set before the rename, so no crash leaves another time
            os.utime(tmp, ns=times_ns)
        os.replace(tmp, dest)
        fsync_dir(Path(dest).parent)

    def abort(self, stream, tmp: str | None) -> None:
        """Drop a half-written file: closing may fail too (a full disk cannot take the buffered
        rest), and must not keep the file from being removed."""
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
        try:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
        except OSError:
            pass  # the directory itself may have become unwritable; _tmp is wiped at start anyway

    def put(self, dest: str, payload: bytes) -> None:
        """Write a whole small file so readers see the old or the new version."""
        stream, tmp = self.sink(dest)
        try:
            stream.write(payload)
            self.finish(stream, tmp, dest)
        except BaseException:
            self.abort(stream, tmp)
            raise

    def delete(self, path: str) -> None:
        p = Path(path)
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        fsync_dir(p.parent)

    def commit_time(self, path: str) -> tuple:
        """Sort key of commit order: the file's time (a repair keeps it), then its name."""
        return os.stat(path).st_mtime_ns, os.path.basename(path)

    def times(self, path: str) -> tuple[int, int]:
        st = os.stat(path)
        return st.st_atime_ns, st.st_mtime_ns

    def make_dirs(self, *names: str) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)   # leftovers of a killed run: never committed
        for name in names:
            (self.root / name).mkdir(parents=True, exist_ok=True)

    def refuse_unsafe(self, ours: set[str]) -> None:
        """No regular file at the root, and no planted symlink among the names we write."""
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"output.path {self.root} exists and is not a directory")
        links = [n for n in sorted(ours) if (self.root / n).is_symlink()]
        if links:  # a planted link would send writes (or an overwrite's deletes) outside the directory
            raise ConfigError(f"output.path {self.root}: {links[0]} is a symbolic link; refusing to write through it")

    def probe(self) -> None:
        """Create the directory and write, fsync and delete a file in it; undo what it created.

        Permission bits alone say nothing for root or on read-only mounts: only a real write tells,
        and it must tell now, before the model loads, not at the first commit hours later.
        """
        missing, p = [], self.root
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        created: list[Path] = []
        try:
            for d in reversed(missing):
                d.mkdir()
                created.append(d)
            fd, probe = tempfile.mkstemp(prefix=".orthrus-probe-", dir=self.root)
            try:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as e:
            raise ConfigError(f"output.path {self.root} is not writable: {e.strerror or e}"
                              f"{f' ({e.filename})' if e.filename else ''}") from None
        finally:
            for d in reversed(created):  # preflight leaves no trace
                try:
                    d.rmdir()
                except OSError:
                    pass


class ObjectStore:
    """A key prefix on an object store."""

    local = False

    def __init__(self, loc: Location) -> None:
        self.loc, self.fs = loc, loc.fs
        self.root = self.uri = loc.uri

    def path(self, *names: str) -> str:
        return "/".join([self.loc.path, *names])

    def top(self) -> list[str]:
        found = self.fs.get_file_info(pafs.FileSelector(self.loc.path, allow_not_found=True))
        return sorted(f.base_name for f in found)

    def is_file(self, path: str) -> bool:
        return self.fs.get_file_info(path).type == pafs.FileType.File

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as f:
            return f.read()

    def list_files(self, folder: str, prefix: str, suffix: str) -> list[str]:
        found = self.fs.get_file_info(pafs.FileSelector(self.path(folder), allow_not_found=True))
        return sorted(f.path for f in found if f.type == pafs.FileType.File
                      and f.base_name.startswith(prefix) and f.base_name.endswith(suffix))

    def sink(self, dest: str) -> tuple[object, None]:
        """An in-memory buffer: the object is PUT whole by :meth:`finish`."""
        return pa.BufferOutputStream(), None

    def finish(self, stream, tmp: None, dest: str, times_ns=None) -> None:
        self.put(dest, stream.getvalue())

    def abort(self, stream, tmp: None) -> None:
        pass     # nothing was uploaded: the buffer is dropped

    def put(self, dest: str, payload: bytes | pa.Buffer) -> None:
        """One PUT: the object appears whole or not at all."""
        with self.fs.open_output_stream(dest) as f:
            f.write(payload)

    def delete(self, path: str) -> None:
        if self.fs.get_file_info(path).type == pafs.FileType.Directory:
            self.fs.delete_dir(path)
        else:
            self.fs.delete_file(path)

    def commit_time(self, path: str) -> tuple:
        """Name order: the run id starts with its UTC start time (an object's own time changes when
        a repair rewrites it)."""
        return (path,)

    def times(self, path: str) -> None:
        return None

    def make_dirs(self, *names: str) -> None:
        pass     # prefixes need no creating; there is no temp area

    def refuse_unsafe(self, ours: set[str]) -> None:
        try:
            if self.fs.get_file_info(self.loc.path).type == pafs.FileType.File:
                raise ConfigError(f"output.path {self.root} is an existing object, not a prefix")
        except STORE_ERRORS as e:
            raise access_error("output.path", self.loc, "list", e) from None

    def probe(self) -> None:
        """Write and delete one small object: the bucket exists and the credentials may write to it."""
        probe = self.path(f".orthrus-probe-{uuid.uuid4().hex}")
        try:
            with self.fs.open_output_stream(probe) as f:
                f.write(b"\0" * 16)
            self.fs.delete_file(probe)
        except STORE_ERRORS as e:
            raise access_error("output.path", self.loc, "write to", e) from None
