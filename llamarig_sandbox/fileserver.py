"""A read-only HTTP file server with byte ranges, so `curl -C -` can resume downloads.

It stands in for a model hub when the sandbox rig downloads models:

    python -m llamarig_sandbox.fileserver --root DIR --port P [--bind 127.0.0.1]
"""

import argparse
import os
import re
import sys
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_RANGE_PATTERN = re.compile(r"bytes=(\d+)-(\d*)")


class UnsatisfiableRange(ValueError):
    """The requested byte range starts at or past the end of the file."""


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """Return the inclusive (first, last) byte positions a Range header asks for.

    Returns None when the whole file should be sent: no header, or a form this server does not
    handle (suffix ranges, several ranges), which RFC 9110 lets a server ignore.
    Raises UnsatisfiableRange when the range starts at or beyond `size`.
    """
    if not header:
        return None
    match = _RANGE_PATTERN.fullmatch(header.strip())
    if not match:
        return None
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) else size - 1
    if first >= size or last < first:
        raise UnsatisfiableRange(header)
    return first, min(last, size - 1)


class FileRequestHandler(BaseHTTPRequestHandler):
    """Serves regular files below `root` for GET and HEAD; everything else is 404 or 405."""

    root: Path
    server_version = "llamarig-fileserver"
    protocol_version = "HTTP/1.1"
    # Bytes per write, and a pause after each (tests slow a download down to interrupt it).
    chunk_bytes = 1 << 20
    chunk_pause = 0.0

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def _resolve(self) -> Path | None:
        """Map the request path to a regular file inside root, or None."""
        relative = unquote(urlsplit(self.path).path).lstrip("/")
        candidate = (self.root / relative).resolve()
        if not candidate.is_relative_to(self.root) or not candidate.is_file():
            return None
        return candidate

    def _serve(self, send_body: bool) -> None:
        path = self._resolve()
        if path is None:
            self._send_empty(HTTPStatus.NOT_FOUND)
            return
        with open(path, "rb") as served_file:
            size = os.fstat(served_file.fileno()).st_size
            try:
                byte_range = parse_range(self.headers.get("Range"), size)
            except UnsatisfiableRange:
                self._send_empty(
                    HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, {"Content-Range": f"bytes */{size}"}
                )
                return
            if byte_range is None:
                first, last = 0, size - 1
                self.send_response(HTTPStatus.OK)
            else:
                first, last = byte_range
                self.send_response(HTTPStatus.PARTIAL_CONTENT)
                self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            length = last - first + 1
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(length))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Last-Modified", self.date_time_string(int(path.stat().st_mtime)))
            self.end_headers()
            if send_body and length > 0:
                served_file.seek(first)
                self._copy(served_file, length)

    def _copy(self, source, length: int) -> None:
        """Send `length` bytes from `source`; a client that hangs up early is not an error."""
        try:
            while length > 0:
                chunk = source.read(min(length, self.chunk_bytes))
                if not chunk:
                    break
                self.wfile.write(chunk)
                length -= len(chunk)
                if self.chunk_pause:
                    time.sleep(self.chunk_pause)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _send_empty(self, status: HTTPStatus, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self._send_empty(HTTPStatus.METHOD_NOT_ALLOWED, {"Allow": "GET, HEAD"})

    do_PUT = do_DELETE = do_PATCH = do_POST


def make_server(root: str | os.PathLike, port: int, bind: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Create (but do not start) a threaded server for `root`; port 0 picks a free port."""
    handler = type("BoundFileRequestHandler", (FileRequestHandler,), {"root": Path(root).resolve()})
    server = ThreadingHTTPServer((bind, port), handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    """Serve a directory until interrupted."""
    parser = argparse.ArgumentParser(
        prog="python -m llamarig_sandbox.fileserver", description=__doc__
    )
    parser.add_argument("--root", required=True, help="directory to serve")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bind", default="127.0.0.1")
    args = parser.parse_args(argv)
    if not Path(args.root).is_dir():
        print(f"error: {args.root} is not a directory", file=sys.stderr)
        return 2
    try:
        server = make_server(args.root, args.port, args.bind)
    except OSError as error:
        print(f"error: cannot listen on {args.bind}:{args.port}: {error.strerror}", file=sys.stderr)
        return 2
    with server:
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
