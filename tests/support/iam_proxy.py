"""The real GCS emulator behind a proxy that denies chosen permissions, answering 403 with GCS's bodies."""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse


def gcs_error_403(permission: str) -> dict:
    """The body GCS answers a request whose caller lacks ``permission`` with (JSON API error format)."""
    message = (
        f"jax-recovery@my-project.iam.gserviceaccount.com does not have {permission} access to the Google Cloud "
        f"Storage bucket. Permission '{permission}' denied on resource (or it may not exist)."
    )
    return {
        "error": {
            "code": 403,
            "message": message,
            "errors": [{"message": message, "domain": "global", "reason": "forbidden"}],
        }
    }


def _permission_of(method: str, path: str) -> str | None:
    """Which GCS permission a JSON API request needs (GCS docs "IAM permissions for JSON methods")."""
    if path.startswith("/upload/"):
        return "storage.objects.create"
    if path.startswith("/download/") or (method == "GET" and "/o/" in path):
        return "storage.objects.get"
    if method == "DELETE" and "/o/" in path:
        return "storage.objects.delete"
    if method == "GET" and path.rstrip("/").endswith("/o"):
        return "storage.objects.list"
    if method == "GET" and path.startswith("/storage/v1/b/"):
        return "storage.buckets.get"
    return None


class IamProxy:
    """Forwards every request to the real emulator, except those needing a denied permission (403 as GCS answers)."""

    def __init__(self, upstream: str, denied: set[str]):
        up = urlparse(upstream)
        self.denied = denied

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                perm = _permission_of(self.command, urlparse(self.path).path)
                if perm in denied:
                    data, status, ctype = json.dumps(gcs_error_403(perm)).encode(), 403, "application/json"
                else:
                    conn = http.client.HTTPConnection(up.hostname, up.port, timeout=10)
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    r = conn.getresponse()
                    data, status, ctype = r.read(), r.status, r.getheader("Content-Type", "application/json")
                    conn.close()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def client(self):
        """A google-cloud-storage client that talks to the proxy."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project="local", credentials=AnonymousCredentials(), client_options={"api_endpoint": self.url}
        )

    def close(self):
        self.server.shutdown()
        self.server.server_close()
