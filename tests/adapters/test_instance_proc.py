"""The test harness's handle on a vLLM instance process: an instance that has exited is a
RuntimeError carrying its log (what the e2e tests skip or fail on), on a request as on an answer."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.vllm_pair import VllmInstance


def _exited(tmp_path, code: str) -> VllmInstance:
    inst = VllmInstance.__new__(VllmInstance)
    inst.logpath = tmp_path / "instance.log"
    inst.log = open(inst.logpath, "w")
    inst.proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=inst.log,
        text=True,
    )
    inst.proc.wait(30)
    return inst


def test_a_request_to_an_exited_instance_is_a_runtime_error_with_its_log(tmp_path) -> None:
    inst = _exited(tmp_path, "import sys; sys.stderr.write('engine core died: KeyError\\n')")
    try:
        with pytest.raises(RuntimeError, match="engine core died"):
            inst.generate([1, 2, 3], 4)  # the pipe is broken: a large write fails at once
        with pytest.raises(RuntimeError, match="engine core died"):
            inst.reset()
    finally:
        inst.stop()
