"""Where data lives: local paths and URIs (``s3://``, ``gs://``, ``hdfs://``, ...) as pyarrow filesystems.

Every path the job takes (``input.paths``, ``output.path``, ``model.path``) goes through
:func:`locate`, which returns a :class:`Location`: a ``pyarrow.fs`` filesystem and the path inside
it (``bucket/key`` on object stores, an absolute real path locally). S3 and GCS use pyarrow's own
clients, built from the ``storage:`` section (region, endpoint override, anonymous access); other
schemes use ``FileSystem.from_uri`` and, where pyarrow has no filesystem, fsspec's.

Credentials never come from the job config: pyarrow's clients read the standard environment
(``AWS_ACCESS_KEY_ID``..., ``AWS_PROFILE``, ``GOOGLE_APPLICATION_CREDENTIALS``), the users' config
files and the instance's role, on the driver and on every node alike.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

import pyarrow.fs as pafs

from pipeline.config import ConfigError, StorageConfig

_URI = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)$")
CREDENTIALS_HINT = ("credentials come from the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
                    "GOOGLE_APPLICATION_CREDENTIALS), the standard config files or the instance role; "
                    "storage.endpoint and storage.region set where the store is")


def scheme_of(path: str) -> str | None:
    """``'s3'`` for ``'s3://bucket/key'``; None for a plain local path."""
    m = _URI.match(path)
    return m.group(1).lower() if m else None


def local_path(path: str) -> str:
    """A local path with any ``file://`` scheme taken off (other paths unchanged)."""
    return _URI.match(path).group(2) if scheme_of(path) in ("file", "local") else path


def is_remote(path: str) -> bool:
    """Whether ``path`` names something outside the local filesystem."""
    return scheme_of(path) not in (None, "file", "local")


@dataclass(frozen=True)
class Location:
    """A path inside a filesystem (picklable: shipped to Ray tasks with the plan)."""

    fs: pafs.FileSystem
    path: str          # inside ``fs``: 'bucket/prefix/key' on object stores, an absolute local path
    scheme: str        # 's3', 'gs', ... or 'file'

    @property
    def local(self) -> bool:
        return self.scheme == "file"

    @property
    def uri(self) -> str:
        """How messages name it: the user's form of the path."""
        return self.path if self.local else f"{self.scheme}://{self.path}"

    def __str__(self) -> str:
        return self.uri


@functools.lru_cache(maxsize=16)
def filesystem(scheme: str, storage: StorageConfig, authority: str = "") -> pafs.FileSystem:
    """The filesystem for ``scheme`` with the ``storage`` settings (cached per process)."""
    if scheme == "s3":
        endpoint, http = storage.endpoint, None
        if endpoint and "://" in endpoint:
            http, endpoint = endpoint.split("://", 1)
        return pafs.S3FileSystem(region=storage.region, endpoint_override=endpoint, scheme=http or "https",
                                 anonymous=storage.anonymous, connect_timeout=storage.connect_timeout_s,
                                 request_timeout=storage.request_timeout_s)
    if scheme in ("gs", "gcs"):
        endpoint, http = storage.endpoint, "https"
        if endpoint and "://" in endpoint:
            http, endpoint = endpoint.split("://", 1)
        return pafs.GcsFileSystem(anonymous=storage.anonymous, endpoint_override=endpoint, scheme=http,
                                  default_bucket_location=storage.region or "US",
                                  request_timeout=storage.request_timeout_s)
    try:
        return pafs.FileSystem.from_uri(f"{scheme}://{authority}")[0]
    except Exception:  # noqa: BLE001 - pyarrow has no filesystem for it: try fsspec's
        import fsspec

        return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem(scheme)))


def locate(path: str, storage: StorageConfig, field: str) -> Location:
    """The :class:`Location` of a config path; :class:`ConfigError` naming ``field`` if it cannot be."""
    scheme = scheme_of(path)
    if scheme in (None, "file", "local"):
        local = _URI.match(path).group(2) if scheme else path
        return Location(pafs.LocalFileSystem(), os.path.realpath(local), "file")
    rest = _URI.match(path).group(2)
    if scheme in ("s3", "gs", "gcs") and not rest.split("/", 1)[0]:
        raise ConfigError(f"{field}: {path!r} names no bucket ({scheme}://BUCKET/prefix)")
    try:
        fs = filesystem(scheme, storage, rest.split("/", 1)[0] if scheme not in ("s3", "gs", "gcs") else "")
    except Exception as e:  # noqa: BLE001 - unknown scheme, missing driver, bad option
        raise ConfigError(f"{field}: {path!r}: no filesystem for the scheme {scheme!r} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if scheme in ("s3", "gs", "gcs"):
        inner = rest
    else:  # hdfs://host:port/path and fsspec schemes: the path part, as that filesystem names it
        inner = "/" + rest.split("/", 1)[1] if "/" in rest else "/"
    return Location(fs, inner.rstrip("/") or inner, "gs" if scheme == "gcs" else scheme)


def access_error(field: str, where: Location, what: str, error: Exception) -> ConfigError:
    """A :class:`ConfigError` for a failed filesystem call during preflight (bucket, credentials, ...)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    hint = "" if where.local else f". Check the bucket name and access: {CREDENTIALS_HINT}"
    return ConfigError(f"{field}: cannot {what} {where.uri}: {text}{hint}")


def info(loc: Location, field: str) -> pafs.FileInfo:
    """``get_file_info`` of ``loc``, turning a storage error into a :class:`ConfigError` naming ``field``."""
    try:
        found = loc.fs.get_file_info(loc.path)
        bucket = loc.path.split("/", 1)[0]
        if found.type == pafs.FileType.NotFound and loc.scheme in ("s3", "gs") and \
                loc.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
            raise ConfigError(f"{field}: cannot read {loc.uri}: the bucket {bucket!r} does not exist (or these "
                              f"credentials cannot see it); {CREDENTIALS_HINT}")
        return found
    except OSError as e:  # from the store: denied, unreachable, bad signature
        raise access_error(field, loc, "read", e) from None


def list_files(loc: Location, field: str) -> list[pafs.FileInfo]:
    """Every file below ``loc`` (recursive), or a :class:`ConfigError` naming ``field``."""
    try:
        found = loc.fs.get_file_info(pafs.FileSelector(loc.path, recursive=True, allow_not_found=True))
    except Exception as e:  # noqa: BLE001 - see info()
        raise access_error(field, loc, "list", e) from None
    return [f for f in found if f.type == pafs.FileType.File]


def glob_regex(pattern: str) -> re.Pattern:
    """A glob as a regex over whole paths, with ``glob.glob(recursive=True)``'s semantics: ``*`` and
    ``?`` stay inside one path segment, ``**`` spans any number of them, ``[...]`` is a character
    class, and a wildcard never matches a name's leading dot."""
    out, i = [], 0
    while i < len(pattern):
        start = "(?!\\.)" if i == 0 or pattern[i - 1] == "/" else ""   # hidden names need an explicit dot
        if pattern.startswith("**/", i):
            out.append("(?:(?!\\.)[^/]+/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(start + "(?:[^/]*(?:/(?!\\.)[^/]*)*)")
            i += 2
        elif pattern[i] in "*?":
            out.append(start + ("[^/]*" if pattern[i] == "*" else "[^/]"))
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            out.append(start + "[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")
