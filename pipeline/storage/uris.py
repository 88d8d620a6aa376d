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

import pyarrow as pa
import pyarrow.fs as pafs

from pipeline.config import ConfigError, StorageConfig

_URI = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)$")
_HALF_URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]+:/?(?!/)")    # 's3:/bkt/x', 's3:bkt': a slash short
_BUCKET_STORES = ("s3", "gs", "gcs")
STORE_ERRORS = (OSError, pa.ArrowException)     # what a filesystem call raises (ArrowInvalid: a bad path)
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
    authority: str = ""   # 'namenode:8020' of hdfs://namenode:8020/path; '' where the path holds it

    @property
    def local(self) -> bool:
        return self.scheme == "file"

    @property
    def uri(self) -> str:
        """How messages name it: the user's form of the path."""
        return self.path if self.local else f"{self.scheme}://{self.authority}{self.path}"

    def at(self, path: str) -> "Location":
        """Another path in the same filesystem."""
        return Location(self.fs, path, self.scheme, self.authority)

    def __str__(self) -> str:
        return self.uri


def _endpoint(storage: StorageConfig) -> tuple[str | None, str]:
    """(host[:port], 'http' or 'https') of ``storage.endpoint``."""
    if storage.endpoint and "://" in storage.endpoint:
        scheme, host = storage.endpoint.split("://", 1)
        return host, scheme
    return storage.endpoint, "https"


@functools.lru_cache(maxsize=16)
def _object_store(scheme: str, storage: StorageConfig, region: str | None) -> pafs.FileSystem:
    endpoint, http = _endpoint(storage)
    if scheme == "s3":
        return pafs.S3FileSystem(region=region, endpoint_override=endpoint, scheme=http,
                                 anonymous=storage.anonymous, connect_timeout=storage.connect_timeout_s,
                                 request_timeout=storage.request_timeout_s)
    return pafs.GcsFileSystem(anonymous=storage.anonymous, endpoint_override=endpoint, scheme=http,
                              default_bucket_location=storage.region or "US")


@functools.lru_cache(maxsize=64)
def _bucket_region(bucket: str) -> str | None:
    """An S3 bucket's region (a bucket outside the client's region answers 301, which reads like
    an access problem); None if it cannot be found out, and the client's default applies."""
    try:
        return pafs.resolve_s3_region(bucket)
    except STORE_ERRORS:
        return None


def _other(path: str) -> tuple[pafs.FileSystem, str, str]:
    """(filesystem, path in it, authority) of a URI pyarrow or, failing that, fsspec can open."""
    authority = _URI.match(path).group(2).split("/", 1)[0]
    try:
        fs, inner = pafs.FileSystem.from_uri(path)
        return fs, inner, authority
    except STORE_ERRORS:   # pyarrow has no filesystem for it (or no driver, e.g. libhdfs): try fsspec's
        import fsspec

        fs, inner = fsspec.core.url_to_fs(path)
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), inner, ""


def locate(path: str, storage: StorageConfig, field: str) -> Location:
    """The :class:`Location` of a config path; :class:`ConfigError` naming ``field`` if it cannot be."""
    scheme = scheme_of(path)
    if scheme is None and _HALF_URI.match(path):
        raise ConfigError(f"{field}: {path!r} looks like a URI without its '//' (write scheme://bucket/path); "
                          "a local path with a ':' in its first name must start with './'")
    if scheme in (None, "file", "local"):
        return Location(pafs.LocalFileSystem(), os.path.realpath(local_path(path)), "file")
    rest = _URI.match(path).group(2)
    if scheme in _BUCKET_STORES:
        bucket = rest.split("/", 1)[0]
        if not bucket or any(c in bucket for c in "*?["):
            raise ConfigError(f"{field}: {path!r} names no bucket ({scheme}://BUCKET/prefix; no wildcards in it)")
        if "//" in rest.rstrip("/"):
            raise ConfigError(f"{field}: {path!r} has an empty path component ('//')")
    try:
        if scheme in _BUCKET_STORES:
            region = storage.region or (None if storage.endpoint or scheme != "s3" else _bucket_region(bucket))
            fs, inner, authority = _object_store(scheme, storage, region), rest, ""
        else:
            fs, inner, authority = _other(path)
    except Exception as e:  # noqa: BLE001 - unknown scheme, missing driver, bad option
        raise ConfigError(f"{field}: {path!r}: no filesystem for the scheme {scheme!r} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return Location(fs, inner.rstrip("/") or inner, "gs" if scheme == "gcs" else scheme, authority)


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
    except STORE_ERRORS as e:  # from the store: denied, unreachable, bad signature, a bad path
        raise access_error(field, loc, "read", e) from None


def list_files(loc: Location, field: str) -> list[pafs.FileInfo]:
    """Every file below ``loc`` (recursive), or a :class:`ConfigError` naming ``field``."""
    try:
        found = loc.fs.get_file_info(pafs.FileSelector(loc.path, recursive=True, allow_not_found=True))
    except STORE_ERRORS as e:  # see info()
        raise access_error(field, loc, "list", e) from None
    return [f for f in found if f.type == pafs.FileType.File]


def glob_regex(pattern: str) -> re.Pattern:
    """A glob as a regex over whole paths, with ``glob.glob(recursive=True)``'s semantics: ``*``, ``?``
    and ``[...]`` stay inside one path segment, a segment that is exactly ``**`` spans any number of
    segments (elsewhere ``**`` is ``*``), ``[!...]`` negates, and a wildcard never matches a name's
    leading dot."""
    out, i = [], 0
    while i < len(pattern):
        start = "(?!\\.)" if i == 0 or pattern[i - 1] == "/" else ""   # hidden names need an explicit dot
        whole = start and pattern.startswith("**", i) and pattern[i + 2:i + 3] in ("", "/")
        if whole and pattern.startswith("**/", i):
            out.append("(?:(?!\\.)[^/]+/)*")
            i += 3
        elif whole:
            out.append("(?:(?!\\.)[^/]*(?:/(?!\\.)[^/]*)*)?")
            i += 2
        elif pattern[i] in "*?":
            n = 2 if pattern.startswith("**", i) else 1
            out.append(start + ("[^/]*" if pattern[i] == "*" else "[^/]"))
            i += n if pattern[i] == "*" else 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            negate = body.startswith("!")
            chars = re.sub(r"([\\^\]])", r"\\\1", body[1:] if negate else body)
            out.append(start + "(?!/)[" + ("^/" if negate else "") + chars + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")
