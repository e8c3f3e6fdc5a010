"""A local S3 server for the tests, the benchmark and the demo: moto behind a fault proxy.

:class:`LocalS3` starts moto's S3 server (``pip install "moto[server]"``) on 127.0.0.1 and a
small HTTP/1.1 reverse proxy (:class:`FaultProxy`) in front of it, which adds a latency per
request and injects faults moto cannot: error answers (503 ``SlowDown``, 429, ...) and bodies
cut after some bytes. Clients talk to the proxy (:attr:`LocalS3.endpoint`).
"""

from __future__ import annotations

import contextlib
import http.client
import importlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ("FaultProxy", "LocalS3")

# Headers the proxy does not pass on (hop by hop, or recomputed).
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "proxy-connection"})


class _Rule:
    __slots__ = ("after", "code", "path", "status", "then", "times")

    def __init__(self, times: int, status: int = 0, code: str = "", after: int = 0,
                 then: Callable[[], None] | None = None, path: str | None = None) -> None:
        self.path = path  # only GETs of paths ending so (None: any object)
        self.times = times
        self.status = status
        self.code = code
        self.after = after
        self.then = then


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _forward(self) -> None:
        proxy = self.server.owner
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        # A presigned GET's query is its signature: still an object GET.
        is_object_get = (self.command == "GET"
                         and ("?" not in self.path or "X-Amz-Signature=" in self.path)
                         and self.path.split("?")[0].strip("/").count("/") >= 1)
        rule = proxy._take(self.command, self.path, self.headers.get("Range"), is_object_get)
        if proxy.latency:
            time.sleep(proxy.latency)
        if rule is not None and rule.status:
            payload = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{rule.code}'
                       f"</Code><Message>injected</Message></Error>").encode()
            self.send_response(rule.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        upstream = self.server.upstream()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException):
            self.server.drop_upstream()
            raise
        self.send_response(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in _HOP and key.lower() != "content-length":
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if rule is not None and rule.after < len(data) and self.command != "HEAD":
            # The whole length announced, part of the body sent, then the connection drops.
            self.wfile.write(data[: rule.after])
            self.wfile.flush()
            if rule.then is not None:
                rule.then()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: FaultProxy

    def __init__(self, owner: FaultProxy, upstream_port: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.owner = owner
        self._port = upstream_port
        self._local = threading.local()

    def upstream(self) -> http.client.HTTPConnection:
        """This handler thread's keep-alive connection to the upstream server."""
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=30)
            self._local.connection = connection
        return connection

    def drop_upstream(self) -> None:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
            self._local.connection = None


class FaultProxy:
    """A reverse proxy on 127.0.0.1 in front of ``upstream_port``, injecting faults.

    Faults apply to the next object GETs (a ``GET /bucket/key`` without a query, or with a
    presigned URL's), in the order they were asked for. :attr:`requests` records ``(method,
    path, Range header)`` of every request.
    """

    def __init__(self, upstream_port: int, latency: float = 0.0) -> None:
        self.latency = latency
        self.requests: list[tuple[str, str, str | None]] = []
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._server = _ProxyServer(self, upstream_port)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def fail(self, times: int, status: int = 503, code: str = "SlowDown") -> None:
        """Answer the next ``times`` object GETs with ``status`` and an S3 error ``code``."""
        with self._lock:
            self._rules.append(_Rule(times, status=status, code=code))

    def cut(self, times: int, after: int, then: Callable[[], None] | None = None,
            path: str | None = None) -> None:
        """Send only ``after`` bytes of the next ``times`` object GETs' bodies (the full
        length announced), then drop the connection (calling ``then`` first); with ``path``,
        only GETs of a path ending so (a read still in flight from an earlier, closed stream
        of another object cannot take the fault)."""
        with self._lock:
            self._rules.append(_Rule(times, after=after, then=then, path=path))

    def reset(self) -> None:
        """Forget the faults not injected yet and the requests seen."""
        with self._lock:
            self._rules.clear()
            self.requests.clear()

    def _take(self, method: str, path: str, range_: str | None,
              is_object_get: bool) -> _Rule | None:
        with self._lock:
            self.requests.append((method, path, range_))
            if not is_object_get or not self._rules:
                return None
            rule = self._rules[0]
            if rule.path is not None and not path.split("?")[0].endswith(rule.path):
                return None
            rule.times -= 1
            if rule.times <= 0:
                self._rules.pop(0)
            return rule

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class LocalS3:
    """moto's S3 server on 127.0.0.1 behind a :class:`FaultProxy`.

    Args:
        latency: seconds the proxy waits before forwarding each request.

    Attributes:
        endpoint: the proxy's URL, for clients.
        direct_endpoint: moto's own URL (no faults, no latency).
        proxy: the :class:`FaultProxy`.
    """

    access_key = "testing"
    secret_key = "testing"
    region = "us-east-1"

    def __init__(self, latency: float = 0.0) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        self.direct_endpoint = f"http://{host}:{port}"
        self.proxy = FaultProxy(port, latency)
        self.endpoint = f"http://127.0.0.1:{self.proxy.port}"

    def client(self) -> Any:
        """A boto3 S3 client talking to moto directly."""
        # boto3 ships no type information.
        boto3: Any = importlib.import_module("boto3")
        return boto3.client("s3", endpoint_url=self.direct_endpoint,
                            aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name=self.region)

    def put(self, bucket: str, files: Mapping[str, bytes]) -> None:
        """Create ``bucket`` if needed and upload ``files`` (``{key: body}``) to it."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        for key, body in files.items():
            client.put_object(Bucket=bucket, Key=key, Body=body)

    def env(self) -> dict[str, str]:
        """Environment variables pointing obstore (and boto3) at the proxy."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",
        }

    def store(self, bucket: str, **config: Any) -> Any:
        """An obstore ``S3Store`` for ``bucket`` through the proxy, without obstore's retries
        (so that aloader's retries are the ones tested)."""
        from obstore.store import S3Store

        options: dict[str, Any] = {
            "endpoint": self.endpoint, "access_key_id": self.access_key,
            "secret_access_key": self.secret_key, "region": self.region,
            "client_options": {"allow_http": True},
            "retry_config": {"max_retries": 0},
        }
        options.update(config)
        return S3Store(bucket, **options)

    def close(self) -> None:
        self.proxy.close()
        self._moto.stop()

    def __enter__(self) -> LocalS3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
