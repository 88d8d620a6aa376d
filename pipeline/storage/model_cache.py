"""Checkpoints in object storage: downloaded once per node into a local cache, then loaded from disk.

``<storage.model_cache_dir>/<name>-<hash of the URI>/`` holds the files, and
``.orthrus-manifest.json`` there records each one's remote size and modification time. A download
runs under a file lock (``<dir>.lock``), so the driver, the preprocessing tasks and the actors of
one node fetch each file once while the others wait; each file is written to a ``.partial`` name,
its size checked against the listing, then renamed into place. The next job on the node reuses
every file whose remote size and time are unchanged, so a replaced checkpoint is fetched again.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import time
from pathlib import Path

import pyarrow.fs as pafs

from pipeline.config import ConfigError, StorageConfig
from pipeline.storage.uris import STORE_ERRORS, Location, access_error, list_files

MANIFEST = ".orthrus-manifest.json"
LOCK_TIMEOUT_S = 3600.0   # another process downloading a large checkpoint: wait, then say so
_CHUNK = 8 << 20


def cache_dir(loc: Location, storage: StorageConfig) -> Path:
    """The node-local directory that mirrors ``loc``."""
    digest = hashlib.sha256(loc.uri.encode()).hexdigest()[:16]
    name = loc.path.rstrip("/").rsplit("/", 1)[-1] or "model"
    return Path(os.path.expanduser(storage.model_cache_dir)) / f"{name}-{digest}"


def _remote_files(loc: Location) -> dict[str, pafs.FileInfo]:
    files = {f.path[len(loc.path):].lstrip("/"): f for f in list_files(loc, "model.path")}
    files = {name: f for name, f in files.items() if not any(p.startswith(".") for p in name.split("/"))}
    if "config.json" not in files:
        raise ConfigError(f"model.path: {loc.uri} has no config.json (not an HF-layout checkpoint); "
                          f"found {sorted(files)[:5] or 'nothing'}")
    return files


def _stamp(f: pafs.FileInfo) -> list:
    return [f.size, f.mtime_ns]


def _fetch(loc: Location, name: str, remote: pafs.FileInfo, dest: Path) -> None:
    """Copy one file to ``dest`` through a ``.partial`` name; its size must match the listing."""
    partial = dest.with_name(dest.name + ".partial")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        out = open(partial, "wb")
    except OSError as e:
        raise ConfigError(f"model.path: cannot write the model cache {partial} ({e.strerror or e}); set "
                          "storage.model_cache_dir to a writable local directory with room for the model") from None
    try:
        with loc.fs.open_input_stream(remote.path) as src, out:
            while chunk := src.read(_CHUNK):
                try:
                    out.write(chunk)
                except OSError as e:   # the local disk (space, quota), not the store
                    raise ConfigError(f"model.path: cannot write the model cache {partial} ({e.strerror or e}); "
                                      "free space there or set storage.model_cache_dir") from None
            out.flush()
            os.fsync(out.fileno())
    except STORE_ERRORS as e:
        partial.unlink(missing_ok=True)
        raise access_error("model.path", loc, f"download {name} from", e) from None
    except ConfigError:
        partial.unlink(missing_ok=True)
        raise
    if partial.stat().st_size != remote.size:
        got = partial.stat().st_size
        partial.unlink()
        raise ConfigError(f"model.path: {loc.uri}/{name} downloaded {got} bytes but the store lists "
                          f"{remote.size}; was it being replaced? Try again")
    os.replace(partial, dest)


def download(loc: Location, storage: StorageConfig, patterns: list[str] | None = None) -> str:
    """The local cache directory holding ``loc``'s files (only those matching ``patterns``, if given),
    downloading what is missing or changed. Safe to call from many processes on one node."""
    from filelock import FileLock, Timeout

    target = cache_dir(loc, storage)
    files = _remote_files(loc)
    wanted = {n: f for n, f in files.items() if patterns is None or any(fnmatch.fnmatch(n, p) for p in patterns)}
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(target) + ".lock")
    try:
        lock.acquire(timeout=LOCK_TIMEOUT_S)
    except Timeout:
        raise ConfigError(f"model.path: waited {LOCK_TIMEOUT_S:.0f} s for another process downloading "
                          f"{loc.uri} into {target} (lock {lock.lock_file})") from None
    try:
        manifest_path = target / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError):
            manifest = {}
        fetched, start = 0, time.time()
        if patterns is None:      # the whole checkpoint: files no longer in the store leave the cache too
            for name in [n for n in manifest if n not in files]:
                (target / name).unlink(missing_ok=True)
                del manifest[name]
        for name, remote in sorted(wanted.items()):
            dest = target / name
            if manifest.get(name) == _stamp(remote) and dest.is_file() and dest.stat().st_size == remote.size:
                continue
            _fetch(loc, name, remote, dest)
            manifest[name] = _stamp(remote)
            fetched += remote.size
            target.mkdir(parents=True, exist_ok=True)
            tmp = manifest_path.with_name(MANIFEST + ".tmp")
            tmp.write_text(json.dumps(manifest, indent=1))
            os.replace(tmp, manifest_path)
        if fetched:
            print(f"[orthrus] model {loc.uri}: downloaded {fetched / 1e6:.1f} MB into {target} "
                  f"in {time.time() - start:.1f} s", flush=True)
    finally:
        lock.release()
    return str(target)


def check_remote_weight_headers(loc: Location) -> None:
    """Read the header of every ``*.safetensors`` object (two ranged reads each, no tensor data) and
    check that the tensors it lists end exactly where the object does: a truncated or corrupt
    weights file is refused before any actor downloads it."""
    for name, remote in sorted(_remote_files(loc).items()):
        if not name.endswith(".safetensors"):
            continue
        try:
            with loc.fs.open_input_file(remote.path) as f:
                size = int.from_bytes(f.read(8), "little")
                if not 0 < size <= min(remote.size - 8, 100 << 20):
                    raise ValueError(f"header length {size} does not fit in {remote.size} bytes")
                header = json.loads(f.read(size))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except STORE_ERRORS as e:
            raise access_error("model.path", loc, f"read {name} in", e) from None
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise ConfigError(f"model.path: weights file {name} in {loc.uri} is not readable (header: "
                              f"{type(e).__name__}: {e})") from None
        if 8 + size + end != remote.size:
            raise ConfigError(f"model.path: weights file {name} in {loc.uri} is {remote.size} bytes but its "
                              f"header says {8 + size + end} (truncated or corrupt)")
