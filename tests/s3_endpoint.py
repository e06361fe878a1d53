"""A real S3 API on localhost for the object-store checkpoint tests: moto's server (the
endpoint s3fs's own tests use), started on a free port, with a bucket, stopped after."""

from __future__ import annotations

import logging
import os
import socket
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def s3_endpoint(bucket: str = "runs") -> Iterator[dict]:
    """Yields ``storage_options`` for s3fs pointing at a fresh moto server with ``bucket``;
    the credentials are set in the environment (as s3fs reads them) while it runs."""
    from moto.server import ThreadedMotoServer
    import s3fs

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    saved = {name: os.environ.get(name) for name in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
               "skip_instance_cache": True}
    try:
        # moto's backends are per process: a server started earlier in this session left
        # its buckets there; start empty.
        request = urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset",
                                         method="POST")
        urllib.request.urlopen(request, timeout=30).close()
        s3fs.S3FileSystem(**options).mkdir(bucket)
        yield options
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()
