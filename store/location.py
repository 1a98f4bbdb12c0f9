"""A data location — a directory on this machine's disk or a prefix in an S3-compatible bucket — as one type.

Every reader and writer of the store reaches its files through a :class:`Location`
(``store.Location.of(path)``): by *keys*, paths relative to the location's root
(``spans/date=2025-11-30/part-….parquet``, ``policy.json``), and by *names*, what a reader opens a
file by (:meth:`Location.name`: a ``Path``, or an ``s3://bucket/key`` URL). The operations mean the
same wherever the location is:

- :meth:`~Location.list` — every file under a key (recursively), with its size and time;
- :meth:`~Location.read_bytes`, :meth:`~Location.open_input` — read one;
- :meth:`~Location.put_bytes`, :meth:`~Location.put_file` — write one atomically, so that readers
  see all of it or nothing: on disk a temporary file, fsynced, renamed, and the directory fsynced;
  in a bucket one request (a PUT; a multipart upload becomes visible whole at its completion);
- :meth:`~Location.create` — write one unless it is there (on disk the first writer wins);
- :meth:`~Location.delete`, :meth:`~Location.remove_tree` — delete files, or a whole directory so
  that readers see all of it or none;
- :meth:`~Location.lock` — serialise a read-modify-write among this machine's processes;
- :meth:`~Location.check`, :meth:`~Location.register` (DuckDB reads the files by name),
  :attr:`~Location.fs` (the ``pyarrow.fs`` filesystem that holds it: ``LocalFileSystem`` or
  ``S3FileSystem``, lightspan.store.objects);
- :meth:`~Location.local` — a directory on local disk under the location, for what must be on a
  disk (the collector's WAL, rollout logs, checkpoints): ``None`` in a bucket, whose users must
  name one.

What differs is the store's business, here: a disk renames atomically and fsyncs, a bucket does
neither but writes each object in one request; a listing of a disk follows no symbolic link (the
pyarrow local listing would descend into a link to ``/``) and stats only when asked; an object's
time is the bucket's clock (:attr:`~Location.mtime_slack_s`). Nothing outside ``store/`` asks which
kind a location is.

Standard library only at import, and for reading or replacing a small file on disk: ``policy.json``
is read in an agent's environment, which has no pyarrow. The other operations import pyarrow.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from lightspan.store.layout import bucket_path, data_dir, fsync_dir, is_remote

TRASH = ".trash"
"""On disk, where :meth:`Location.remove_tree` renames a directory before deleting it (at the root,
outside every table)."""
BUCKET_MTIME_SLACK_S = 300.0
"""An object's time is the bucket's clock, not ours: "written since T" reads back this much more."""
BUCKET_TICK_S = 2.0


@dataclass(frozen=True)
class Entry:
    key: str              # relative to the location, '/'-separated
    size: int             # bytes (0 for a directory, or when the listing was asked not to stat)
    mtime: float          # seconds since the epoch (an object's LastModified)
    is_dir: bool = False


class Location:
    """A data location: ``root`` (a directory, or ``s3://bucket/prefix``) and the filesystem that
    holds it. Build one with :meth:`Location.of`."""

    __slots__ = ("_url", "_path", "_fs")

    @classmethod
    def of(cls, path: str | os.PathLike | Location | None = None) -> Location:
        """The data location ``path`` names (``$LIGHTSPAN_DATA_DIR``, else ``./lightspan-data``, when
        none): a directory, or ``s3://bucket/prefix``. A :class:`Location` is returned as it is."""
        if isinstance(path, Location):
            return path
        return cls(data_dir(path))

    def __init__(self, root: Path | str):
        if is_remote(root):
            self._url, self._path = str(root).rstrip("/"), None
        else:
            self._url, self._path = str(root), Path(root)
        self._fs = None

    # --- names ---
    @property
    def root(self) -> Path | str:
        """The location as :func:`lightspan.store.data_dir` gives it: a ``Path``, or the ``s3://`` URL."""
        return self._url if self._path is None else self._path

    def __str__(self) -> str:
        return self._url

    def __repr__(self) -> str:
        return f"Location({self._url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Location) and other._url == self._url

    def __hash__(self) -> int:
        return hash(self._url)

    def name(self, *keys: str) -> Path | str:
        """What a reader opens ``key`` by (DuckDB, pyarrow, a message): a path, or an ``s3://`` URL."""
        if self._path is None:
            return "/".join([self._url, *keys])
        return self._path.joinpath(*keys)

    def key(self, name: Path | str) -> str:
        """The key of a :meth:`name` under this location."""
        if self._path is None:
            return str(name)[len(self._url) + 1:]
        return Path(name).relative_to(self._path).as_posix()

    def child(self, *keys: str) -> Location:
        """The location of ``key`` (a directory, a prefix) under this one."""
        return Location(self.name(*keys))

    def local(self, *keys: str) -> Path | None:
        """The directory ``key`` of this location on local disk, for what must be on a disk (a WAL,
        logs, checkpoints); ``None`` when the location is not on this machine's disk."""
        return None if self._path is None else self._path.joinpath(*keys)

    def exists(self) -> bool:
        """Whether the location is there: a directory on disk; a prefix in a bucket always (nothing
        makes one: :meth:`check` asks the bucket)."""
        return self._path is None or self._path.is_dir()

    def resolved(self) -> Location:
        """The same location named absolutely (symbolic links resolved)."""
        return self if self._path is None else Location(self._path.resolve())

    @property
    def fs(self):
        """The ``pyarrow.fs`` filesystem holding the location (imports pyarrow)."""
        if self._fs is None:
            if self._path is None:
                from lightspan.store import objects

                return objects.filesystem()       # per endpoint, as the AWS settings name it now
            import pyarrow.fs as pafs

            self._fs = pafs.LocalFileSystem()
        return self._fs

    def fs_path(self, *keys: str) -> str:
        """The path of ``key`` as :attr:`fs` takes it (``bucket/key``, or an absolute path)."""
        if self._path is None:
            return bucket_path(self.name(*keys))
        return os.path.abspath(self._path.joinpath(*keys))

    @property
    def mtime_slack_s(self) -> float:
        """How far an :class:`Entry`'s time may be from this machine's clock: 0 on local disk; in a
        bucket the server stamps each object with its own."""
        return 0.0 if self._path is not None else BUCKET_MTIME_SLACK_S

    def _named(self, key: str, exc: OSError) -> OSError:
        """``exc`` naming the object and the endpoint (a bucket); a disk's errors stay as they are."""
        if self._path is not None:
            return exc
        from lightspan.store import objects

        return objects.named(str(self.name(key)), exc)

    # --- reading ---
    def list(self, key: str = "", *, stat: bool = True, dirs: bool = False) -> list[Entry]:
        """Every file under ``key``, recursively (none when there is nothing there); with ``dirs``
        its directories too (on disk, empty ones included). On disk no symbolic link to a directory
        is followed, and ``stat=False`` leaves size and time 0 (a listing of names only)."""
        if self._path is None:
            return self._list_bucket(key, dirs)
        base = self._path.joinpath(key) if key else self._path
        found, todo = [], [(base, key)]
        while todo:
            directory, prefix = todo.pop()
            try:
                with os.scandir(directory) as it:
                    children = list(it)
            except (FileNotFoundError, NotADirectoryError):  # removed under the listing
                continue
            for child in children:
                child_key = f"{prefix}/{child.name}" if prefix else child.name
                try:
                    if child.is_dir(follow_symlinks=False):
                        todo.append((child.path, child_key))
                        if dirs:
                            found.append(Entry(child_key, 0, child.stat(follow_symlinks=False).st_mtime if stat else 0.0,
                                               True))
                        continue
                    if child.is_symlink() and child.is_dir():
                        continue                          # a link to a directory: not followed
                    st = child.stat(follow_symlinks=False) if stat else None
                except FileNotFoundError:
                    continue
                found.append(Entry(child_key, st.st_size if st else 0, st.st_mtime if st else 0.0))
        return sorted(found, key=lambda e: e.key)

    def _list_bucket(self, key: str, dirs: bool) -> list[Entry]:
        import pyarrow.fs as pafs

        base = self.fs_path(key) if key else self.fs_path()
        root = self.fs_path()
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        except OSError as exc:
            raise self._named(key, exc) from exc
        return sorted((Entry(i.path[len(root) + 1:], int(i.size or 0), i.mtime.timestamp() if i.mtime else 0.0,
                             i.type == pafs.FileType.Directory)
                       for i in infos if i.type == pafs.FileType.File or (dirs and i.type == pafs.FileType.Directory)),
                      key=lambda e: e.key)

    def read_bytes(self, key: str) -> bytes:
        """The file's bytes; ``FileNotFoundError`` when there is none."""
        if self._path is not None:
            with open(self._path.joinpath(key), "rb") as fh:
                return fh.read()
        try:
            with self.fs.open_input_stream(self.fs_path(key)) as stream:
                return stream.read()
        except FileNotFoundError:
            raise
        except OSError as exc:
            if "NoSuchKey" in str(exc) or "does not exist" in str(exc):
                raise FileNotFoundError(str(self.name(key))) from exc
            raise self._named(key, exc) from exc

    def read_text(self, key: str) -> str:
        return self.read_bytes(key).decode()

    def open_input(self, key: str):
        """What ``pyarrow.parquet.ParquetFile`` reads ``key`` from: its path on disk (memory-mapped
        there), else a random-access file over the object."""
        if self._path is not None:
            return str(self._path.joinpath(key))
        return self.fs.open_input_file(self.fs_path(key))

    def changed_at(self, key: str) -> float:
        """A value that differs whenever ``key`` may have changed: its time on disk (``OSError`` when
        it is not there); in a bucket, where asking costs a request as reading does, the clock's
        2-second tick (read it again every 2 s)."""
        if self._path is not None:
            return self._path.joinpath(key).stat().st_mtime
        return time.monotonic() // BUCKET_TICK_S

    # --- writing ---
    def put_bytes(self, key: str, data) -> None:
        """Replace ``key`` with ``data`` (bytes, or a buffer such as ``pyarrow.Buffer``) atomically."""
        if self._path is None:
            try:
                with self.fs.open_output_stream(self.fs_path(key)) as stream:
                    stream.write(data)
            except OSError as exc:
                raise self._named(key, exc) from exc
            return
        final = self._path.joinpath(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(final.parent)

    def put_text(self, key: str, text: str) -> None:
        self.put_bytes(key, text.encode())

    @contextlib.contextmanager
    def put_file(self, key: str, scratch: str | os.PathLike | None = None):
        """A local path to write ``key``'s content to, put in place whole when the block ends (and
        not at all if it raises). On disk the file is written beside ``key`` (then fsynced and
        renamed); for a bucket in ``scratch`` (the system's temporary directory by default), then
        uploaded and its size checked, an object that is not whole deleted."""
        if self._path is not None:
            final = self._path.joinpath(key)
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.parent / f".{final.name}.tmp"
            try:
                yield str(tmp)
                with open(tmp, "rb") as fh:
                    os.fsync(fh.fileno())
                os.replace(tmp, final)
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(final.parent)
            return
        import pyarrow.fs as pafs

        if scratch is not None:
            Path(scratch).mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".put-", suffix=Path(key).suffix, dir=scratch)
        os.close(fd)
        try:
            yield tmp
            size = os.path.getsize(tmp)
            try:
                pafs.copy_files(tmp, self.fs_path(key), destination_filesystem=self.fs)
                uploaded = self.fs.get_file_info(self.fs_path(key)).size
                if uploaded != size:
                    raise OSError(f"{self.name(key)}: {uploaded} bytes uploaded of {size}")
            except BaseException as exc:
                self.delete([key])                    # never half an object
                if isinstance(exc, OSError):
                    raise self._named(key, exc) from exc
                raise
        finally:
            Path(tmp).unlink(missing_ok=True)

    def create(self, key: str, data: bytes) -> None:
        """Write ``key`` unless it exists. On disk the first writer wins (the file, readable by its
        owner only, is linked into place whole); in a bucket, which has no such request, the last
        PUT does: read the object back to agree on it."""
        if self._path is None:
            self.put_bytes(key, data)
            return
        path = self._path.joinpath(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)          # fails if another writer was first: theirs stays
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        fsync_dir(path.parent)

    def delete(self, keys) -> None:
        """Delete files; one already gone is no error. On disk their directories are fsynced before
        this returns (what is deleted in one call is gone before what the next call deletes)."""
        if self._path is None:
            for key in keys:
                try:
                    self.fs.delete_file(self.fs_path(key))
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    if "NoSuchKey" not in str(exc):
                        raise self._named(key, exc) from exc
            return
        parents = set()
        for key in keys:
            path = self._path.joinpath(key)
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            parents.add(path.parent)
        for parent in sorted(parents):
            fsync_dir(parent)

    def remove_tree(self, key: str, *, marker: str) -> None:
        """Delete the directory ``key`` and everything under it so that a reader's listing holds
        all of it or none of it. On disk it is renamed out of the way (into ``.trash/`` at the
        root), then deleted; a bucket renames nothing, so there the object ``marker`` is written
        into it first (a reader that sees it skips the whole directory), then every object is
        deleted, the marker last."""
        if self._path is not None:
            path = self._path.joinpath(key)
            trash = self._path / TRASH / f"{key.replace('/', '-')}-{uuid.uuid4().hex}"
            trash.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, trash)                  # atomic: out of every reader's listing at once
            fsync_dir(path.parent)
            shutil.rmtree(trash, ignore_errors=True)
            return
        mark = f"{key}/{marker}"
        self.put_bytes(mark, b"")                    # readers skip the directory from here
        self.delete([f"{key}/{e.key}" for e in self.child(key).list() if e.key != marker])
        self.delete([mark])

    @contextlib.contextmanager
    def lock(self, key: str):
        """Hold an exclusive lock for a read-modify-write of the location's files: a file lock
        (``key``) on disk, among this machine's processes. A bucket has none: there one process
        does the writing (docs/architecture.md, "Storage")."""
        if self._path is None:
            yield
            return
        self._path.mkdir(parents=True, exist_ok=True)
        with open(self._path.joinpath(key), "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            yield

    # --- reaching it ---
    def check(self) -> None:
        """Raise ``OSError`` unless the location can be written: a directory is made if need be and
        a file written and removed in it (``errno`` says why it cannot be); a bucket must answer."""
        if self._path is None:
            from lightspan.store import objects

            objects.check(self._url)
            return
        self._path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=self._path)
        os.close(fd)
        os.unlink(probe)

    def register(self, con) -> None:
        """Let DuckDB connection ``con`` read (and write) this location's files by :meth:`name`."""
        if self._path is None:
            from lightspan.store import objects

            objects.register(con)


NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST})
"""The ``errno`` of a :meth:`Location.check` that failed because the directory cannot be written
(not because the disk is full or failed)."""
