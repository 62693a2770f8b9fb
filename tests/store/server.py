"""A real HTTP server on 127.0.0.1 for the store's tests: files with Range and ETag support, and
the misbehaviours pulls must survive: a connection dropped midway, wrong bytes, redirects (also
to file://), an endless body, hand-written JSON manifests."""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Route:
    body: bytes = b""
    drop_after: int | None = None  # close the connection after this many body bytes (once)
    redirect: str | None = None
    endless: bool = False  # chunked, never ending
    ranges: bool = True
    content_type: str = "application/octet-stream"
    hits: list = field(default_factory=list)  # the Range header of each request


class FileServer:
    def __init__(self):
        self.routes: dict[str, Route] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                route = server.routes.get(self.path)
                if route is None:
                    self.send_error(404)
                    return
                route.hits.append(self.headers.get("Range"))
                if route.redirect:
                    self.send_response(302)
                    self.send_header("Location", route.redirect)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if route.endless:
                    self._endless()
                    return
                self._file(route)

            def _endless(self):
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chunk = b"GGUF" + bytes(65532)
                try:
                    while True:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                except OSError:
                    pass

            def _file(self, route: Route):
                body, start = route.body, 0
                wanted = self.headers.get("Range")
                etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
                if wanted and route.ranges and self.headers.get("If-Range", etag) == etag:
                    start = int(wanted.removeprefix("bytes=").split("-")[0])
                    if start >= len(body):
                        self.send_response(416)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Type", route.content_type)
                self.send_header("Content-Length", str(len(body) - start))
                self.send_header("ETag", etag)
                self.end_headers()
                part = body[start:]
                if route.drop_after is not None:
                    cut, route.drop_after = route.drop_after, None
                    self.wfile.write(part[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(part)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def add(self, path: str, **kwargs) -> str:
        self.routes[path] = Route(**kwargs)
        return self.base + path

    def add_json(self, path: str, data) -> str:
        return self.add(path, body=json.dumps(data).encode(), content_type="application/json")

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
