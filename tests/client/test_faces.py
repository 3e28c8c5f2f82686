"""The SDK's two faces over its one core: the same calls, and the steps run the same way."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from kvservice_client import AsyncClient, Client
from kvservice_client._steps import AsyncFace, Emit, SyncFace, op, relay, stream_op

# the parts of each face that differ in kind: a property on one, a coroutine on the other
_FACE_ONLY = {"session_id", "service_peer_address", "close"}


def _calls(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(getattr(cls, name))
        for name in dir(cls)
        if not name.startswith("_") and callable(getattr(cls, name)) and name not in _FACE_ONLY
    }


def test_both_clients_have_the_same_calls_with_the_same_signatures() -> None:
    """Every public call of Client is on AsyncClient with the same parameters and result type."""
    sync, aio = _calls(Client), _calls(AsyncClient)
    assert sync.keys() == aio.keys()
    for name, sig in sync.items():  # a stream is an Iterator on one, an AsyncIterator on the other
        assert sig.parameters == aio[name].parameters, name
        assert str(aio[name].return_annotation).removeprefix("Async") == sig.return_annotation, name
    assert inspect.signature(Client.__init__) == inspect.signature(AsyncClient.__init__)


def test_async_calls_are_coroutine_functions_and_keep_their_docstrings() -> None:
    """AsyncClient's unary calls are ``async def``; each face shows the core's docstring."""
    assert inspect.iscoroutinefunction(AsyncClient.expect_delta)
    assert not inspect.iscoroutinefunction(Client.expect_delta)
    assert Client.expect_delta.__doc__ == AsyncClient.expect_delta.__doc__
    assert Client.expect_delta.__doc__ and "transfer_id" in Client.expect_delta.__doc__
    assert inspect.signature(Client.watch).return_annotation == "Iterator[TransferStatus]"
    assert inspect.signature(AsyncClient.watch).return_annotation == "AsyncIterator[TransferStatus]"


class _Echo:
    """An effect that returns its value, or raises it when it is an exception."""

    def __init__(self, value: object) -> None:
        self.value = value

    def _out(self) -> object:
        if isinstance(self.value, Exception):
            raise self.value
        return self.value

    def sync(self, face: object) -> object:
        return self._out()

    async def aio(self, face: object) -> object:
        await asyncio.sleep(0)
        return self._out()


class _Core:
    closed: list[str]

    @op
    def add(self, a: int, b: int = 1) -> object:
        got = yield _Echo(a)
        try:
            yield _Echo(ValueError("thrown in"))
        except ValueError as exc:
            return (got + b, str(exc))
        raise AssertionError("the effect's error was not thrown in")

    @stream_op(int)
    def count(self, n: int) -> object:
        try:
            for i in range(n):
                yield Emit((yield _Echo(i)))
        finally:
            self.closed.append("count")

    @op
    def first_over(self, n: int, over: int) -> object:
        return (yield from relay(_Core.count.fn(self, n), lambda i: i if i > over else None))


class _Sync(SyncFace, _Core):
    def __init__(self) -> None:
        self.closed = []


class _Async(AsyncFace, _Core):
    def __init__(self) -> None:
        self.closed = []


def test_steps_run_alike_on_both_faces() -> None:
    """Results are sent in, errors thrown in, streams emit, relays stop early, on both faces."""
    s = _Sync()
    assert s.add(2, b=3) == (5, "thrown in")
    assert list(s.count(3)) == [0, 1, 2]
    assert s.first_over(10, 4) == 5 and s.closed == ["count", "count"]

    async def main() -> None:
        a = _Async()
        assert await a.add(2, b=3) == (5, "thrown in")
        assert [i async for i in a.count(3)] == [0, 1, 2]
        assert await a.first_over(10, 4) == 5 and a.closed == ["count", "count"]

    asyncio.run(main())


def test_a_stream_left_early_runs_its_cleanup() -> None:
    """Closing a face's stream closes the steps (a watch cancels its call there)."""
    s = _Sync()
    it = s.count(100)
    assert next(it) == 0
    it.close()
    assert s.closed == ["count"]


def test_an_error_the_steps_do_not_catch_reaches_the_caller() -> None:
    """An effect's error that the steps let through is raised by the face's call."""

    class Core:
        @op
        def fail(self) -> object:
            yield _Echo(KeyError("k"))

    class Face(SyncFace, Core):
        pass

    with pytest.raises(KeyError):
        Face().fail()
