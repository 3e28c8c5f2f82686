"""A disaggregated-serving proxy in front of two ``vllm serve`` instances using KVServiceConnector,
the way vLLM's own disaggregated examples drive a prefill and a decode instance (stdlib only)::

    python proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --decode-kvservice 10.0.0.2:7777

``POST /v1/completions`` (and ``/v1/chat/completions``): the request goes to the prefill instance
with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true, "kvservice_peer": <the
decode instance's kvservice>}``; the ``kv_transfer_params`` of its answer go with the original
request to the decode instance, whose answer is returned. Only the pages the decode instance's
prefix cache lacks move. ``GET /health`` answers 200. Streaming is not proxied.
"""

from __future__ import annotations

import argparse
import http.server
import json
import secrets
import urllib.error
import urllib.request
from typing import Any


def _post(url: str, body: dict[str, Any], timeout: float) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def disaggregate(
    path: str, body: dict[str, Any], prefill: str, decode: str, decode_kvservice: str, timeout: float
) -> tuple[int, dict[str, Any]]:
    """Prefill (one token, KV sent to the decode instance's service), then decode."""
    pre = dict(body, max_tokens=1, stream=False)
    pre.pop("max_completion_tokens", None)
    pre["kv_transfer_params"] = {
        "do_remote_decode": True,
        "kvservice_peer": decode_kvservice,
        "transfer_id": f"proxy-{secrets.token_hex(8)}",
    }
    code, answer = _post(prefill + path, pre, timeout)
    if code != 200:
        return code, answer
    params = answer.get("kv_transfer_params")
    if not params:
        why = "the prefill instance returned no kv_transfer_params"
        return 502, {"error": {"message": why, "prefill": answer}}
    return _post(decode + path, dict(body, kv_transfer_params=params), timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", required=True, help="base URL of the prefill instance")
    ap.add_argument("--decode", required=True, help="base URL of the decode instance")
    ap.add_argument("--decode-kvservice", required=True, help="the decode instance's kvservice peer address")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    args = ap.parse_args()

    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._reply(200 if self.path == "/health" else 404, {})

        def do_POST(self) -> None:  # noqa: N802
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self._reply(404, {"error": {"message": f"{self.path} is not proxied"}})
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if body.get("stream"):
                self._reply(400, {"error": {"message": "stream: not supported by this proxy"}})
                return
            self._reply(*disaggregate(self.path, body, args.prefill, args.decode, args.decode_kvservice,
                                      args.timeout_s))  # fmt: skip

        def log_message(self, *a: Any) -> None:
            return

    server = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"proxy listening on http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
