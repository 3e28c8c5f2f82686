"""The parent's handle on one vllm_instance.py process (used by tests/adapters and bench/)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
VLLM_PY = ROOT / os.environ.get("VLLM_VENV", ".venv-vllm") / "bin" / "python"


class VllmInstance:
    """``connector``: a kvservice address, "nixl" (vLLM's NixlConnector) or "" (none)."""

    def __init__(self, model: str, connector: str, log: Path, env: dict[str, str] | None = None) -> None:
        self.logpath = log
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [str(VLLM_PY), str(HERE / "vllm_instance.py"), "serve", model, connector],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=dict(os.environ, **(env or {})),
        )

    @staticmethod
    def build_model(path: str, kind: str = "build", *args: str) -> None:
        """``kind``: "build" (a tiny Llama), "build-mla" (a tiny DeepSeek-V3) or "build-bench"
        (a deeper Llama; ``args``: its layer count)."""
        subprocess.run(
            [str(VLLM_PY), str(HERE / "vllm_instance.py"), kind, path, *args], check=True, capture_output=True
        )

    def _answer(self) -> str:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.log.flush()
                raise RuntimeError(f"vLLM instance exited: {self.logpath.read_text()[-3000:]}")
            if line.startswith("@@ "):
                return line[3:].strip()
            self.log.write(line)  # vLLM logs to stdout too (the engine core's tracebacks)
            self.log.flush()

    def _send(self, msg: dict[str, Any]) -> None:
        """One request line; an instance that exited is a RuntimeError with its log's tail (as
        :meth:`_answer` raises), not a BrokenPipeError."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # (ValueError: a stdin closed by an earlier failure)
            self.log.flush()
            raise RuntimeError(f"vLLM instance exited: {self.logpath.read_text()[-3000:]}") from None

    def ready(self) -> None:
        assert self._answer() == "ready"

    def generate(
        self, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        self._send({"op": "generate", "prompt": prompt, "max_tokens": max_tokens, "params": params})
        return json.loads(self._answer())  # type: ignore[no-any-return]

    def start(self, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None) -> None:
        """Send a generate request without waiting; :meth:`result` reads its answer (a proxy that
        starts the decode request beside the prefill's)."""
        self._send({"op": "generate", "prompt": prompt, "max_tokens": max_tokens, "params": params})

    def result(self) -> dict[str, Any]:
        return json.loads(self._answer())  # type: ignore[no-any-return]

    def generate_many(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Requests (``prompt``, ``max_tokens``, ``params``) in one llm.generate call, arriving in
        order: they share the engine's steps and KV blocks. One answer per request, in order."""
        self._send({"op": "generate_many", "requests": requests})
        return json.loads(self._answer())["outputs"]  # type: ignore[no-any-return]

    def reset(self) -> bool:
        """Empty the instance's prefix cache."""
        self._send({"op": "reset"})
        return bool(json.loads(self._answer())["reset"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(60)
            except Exception:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()
