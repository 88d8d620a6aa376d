"""A real S3-protocol endpoint on loopback for the tests and ``jobs/bench/storage.py``: moto's
standalone server (``moto[server]``, a test dependency; not needed to run jobs).

Started on 127.0.0.1 on a free port in its own session, stopped through its own process id. The
job talks to it only through pyarrow's S3 client (``storage.endpoint``); this helper uses pyarrow
too, to create buckets and upload fixtures (and boto3 for moto's IAM in one test).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs as pafs

# Any key works against moto without auth enforcement; the metadata service must not be asked (no network).
CLIENT_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
              "AWS_EC2_METADATA_DISABLED": "true"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def moto_server(enforce_auth_after: int | None = None):
    """Yield the endpoint URL of a fresh moto server. ``enforce_auth_after``: moto checks signatures
    against its own IAM users after that many requests (the first ones create a user)."""
    port = _free_port()
    env = dict(os.environ)
    if enforce_auth_after is not None:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(enforce_auth_after)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("moto server did not start")
                time.sleep(0.2)
        yield url
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def s3fs(endpoint: str) -> pafs.S3FileSystem:
    """A pyarrow client for the test server (may create buckets)."""
    return pafs.S3FileSystem(endpoint_override=endpoint.split("://", 1)[1], scheme="http", region="us-east-1",
                             access_key=CLIENT_ENV["AWS_ACCESS_KEY_ID"],
                             secret_key=CLIENT_ENV["AWS_SECRET_ACCESS_KEY"], allow_bucket_creation=True)


def upload(fs: pafs.FileSystem, local: Path, dest: str) -> None:
    """Copy a local file or directory tree to ``dest`` (bucket/prefix)."""
    if local.is_file():
        pafs.copy_files(str(local), dest, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
        return
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        pafs.copy_files(str(path), f"{dest}/{path.relative_to(local).as_posix()}",
                        source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def iam_user(endpoint: str) -> tuple[str, str]:
    """Create an IAM user allowed everything on a server started with ``enforce_auth_after`` >= 3;
    → (access key id, secret). Uses moto's IAM query API over plain HTTP (3 requests)."""
    import boto3   # test-only client for moto's IAM (moto[server] brings it); the job never uses it

    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="x",
                       aws_secret_access_key="x")
    iam.create_user(UserName="job")
    iam.put_user_policy(UserName="job", PolicyName="all", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName="job")["AccessKey"]
    return key["AccessKeyId"], key["SecretAccessKey"]
