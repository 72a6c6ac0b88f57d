"""A local HTTP server that sends its one body slowly, in pieces: the remote image a server
with --allow-remote-images fetches, at the speed a slow (or hostile) host would send it."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class DripServer:
    def __init__(self, body: bytes, seconds: float, pieces: int = 40, host: str = "127.0.0.1"):
        self.body, self.seconds, self.pieces = body, seconds, pieces
        self.finished: list[float] = []  # perf_counter() when each response's last byte went out
        drip = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(drip.body)))
                self.end_headers()
                step = -(-len(drip.body) // drip.pieces)
                for k in range(0, len(drip.body), step):
                    try:
                        self.wfile.write(drip.body[k:k + step])
                        self.wfile.flush()
                    except OSError:  # the fetcher gave up: that is its right
                        return
                    time.sleep(drip.seconds / drip.pieces)
                drip.finished.append(time.perf_counter())

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.httpd.server_address[1]}/image.png"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
