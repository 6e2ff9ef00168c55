"""A stand-in for a SandboxFusion service on 127.0.0.1, for the remote backend's tests.

It speaks SandboxFusion's ``POST /run_code`` schema (``RunCodeRequest`` in, ``RunCodeResponse``
out, field names and status strings as in SandboxFusion's server) and runs Python code with
``python -I -c`` under ``run_timeout``. It does not isolate anything: it exists to test the
client (protocol, retries, queue, failure counting), not a sandbox.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeSandboxFusion:
    def __init__(self):
        self.requests: list[dict] = []
        self.fail_next = 0
        """Answer this many requests with HTTP 500."""
        self.sandbox_error_next = 0
        """Answer this many requests with status SandboxError."""
        self.delay_s = 0.0
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                owner._handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def _reply(self, h, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _handle(self, h) -> None:
        if h.path != "/run_code":
            return self._reply(h, 404, {"detail": "Not Found"})
        req = json.loads(h.rfile.read(int(h.headers["Content-Length"])))
        with self._lock:
            self.requests.append(req)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            fail, self.fail_next = self.fail_next > 0, max(0, self.fail_next - 1)
            sb_error, self.sandbox_error_next = self.sandbox_error_next > 0, max(0, self.sandbox_error_next - 1)
        try:
            time.sleep(self.delay_s)
            if fail:
                return self._reply(h, 500, {"detail": "Internal Server Error"})
            if sb_error:
                return self._reply(h, 200, {"status": "SandboxError", "message": "executor unavailable",
                                            "compile_result": None, "run_result": None, "files": {}})
            assert req["language"] == "python"
            start = time.monotonic()
            try:
                p = subprocess.run([sys.executable, "-I", "-c", req["code"]], input=req.get("stdin", ""),
                                   capture_output=True, text=True, timeout=req.get("run_timeout", 10))
                run = {"status": "Finished", "return_code": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
            except subprocess.TimeoutExpired as e:
                run = {"status": "TimeLimitExceeded", "return_code": None,
                       "stdout": (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                       else (e.stdout or ""), "stderr": ""}
            run["execution_time"] = time.monotonic() - start
            ok = run["status"] == "Finished" and run["return_code"] == 0
            self._reply(h, 200, {"status": "Success" if ok else "Failed", "message": "",
                                 "compile_result": None, "run_result": run, "executor_pod_name": None,
                                 "files": {}})
        finally:
            with self._lock:
                self.in_flight -= 1
