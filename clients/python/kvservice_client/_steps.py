"""One SDK core, two faces: each call is written once, as steps; a face runs the steps.

A call of the SDK (``register_buffers``, ``expect_delta``, ``watch`` ...) is a generator method of
the core (``_calls``, ``_transfer_calls``, ``_landing``) decorated with :func:`op` (or
:func:`stream_op`). It builds the request, decides, and records what the client owns as plain
code; wherever it needs the outside world it *yields an effect* (``_effects``: a unary RPC, the
session id, a lane call, a pause ...) and is sent the effect's result, or has its error thrown in::

    core step ──yield Unary(...)──▶ face runs it: sync stub call │ awaited aio stub call
              ◀──result / error──┘

The two faces differ only in how they run an effect: :class:`SyncFace` (``Client``) calls the grpc
sync stub on the caller's thread, :class:`AsyncFace` (``AsyncClient``) awaits the grpc.aio stub.
Subclassing a face installs a plain method per op on the class (same name, signature and
docstring; ``async def`` on the async face), so a call costs one generator and a resume per
effect: 1-4 µs on a 2-core VM (against fake stubs; a unary RPC there is ~700 µs, a one-page
lane send ~450 µs end to end), and the sync path keeps no event loop or thread hop in it.

Why not the sync client over the async core on a loop thread: every blocking call would then
wake a loop thread and be woken back (two thread hand-offs, each one scheduler wake-up), on the
path of one-page transfers that are latency-critical.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterator
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

__all__ = ["AsyncFace", "Emit", "Op", "Steps", "StreamOp", "SyncFace", "op", "relay", "stream_op"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
Steps = Generator[Any, Any, R]  # yields effects, is sent their results, returns the call's result


class Emit:
    """What a stream op yields for its caller (every other thing it yields is an effect)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class _Stepper:
    """Iterates the effects of ``steps``; the runner sets ``value`` (or, in ``with``, the error)
    before the next one. ``result``: what the steps returned."""

    __slots__ = ("steps", "value", "error", "result")

    def __init__(self, steps: Steps[Any]) -> None:
        self.steps = steps
        self.value: Any = None
        self.error: Exception | None = None
        self.result: Any = None

    def __iter__(self) -> _Stepper:
        return self

    def __next__(self) -> Any:
        value, error, self.value, self.error = self.value, self.error, None, None
        try:
            return self.steps.send(value) if error is None else self.steps.throw(error)
        except StopIteration as stop:
            self.result = stop.value
            raise StopIteration from None

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> bool:
        if isinstance(error, Exception):  # thrown into the steps at the next step
            self.error = error
            return True
        return False


def _run(face: Any, steps: Steps[R]) -> R:
    # NOTE: the blocking path, kept free of the stepper's method calls (a one-page transfer's
    # calls are latency-critical); the same rules as _Stepper.
    value: Any = None
    error: Exception | None = None
    while True:
        try:
            effect = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            value, error = effect.sync(face), None
        except Exception as exc:
            value, error = None, exc


async def _arun(face: Any, steps: Steps[R]) -> R:
    for effect in (stepper := _Stepper(steps)):
        with stepper:
            stepper.value = await effect.aio(face)
    return stepper.result  # type: ignore[no-any-return]


def _stream(face: Any, steps: Steps[None]) -> Generator[Any, None, None]:
    with _closing(steps):
        for effect in (stepper := _Stepper(steps)):
            with stepper:
                stepper.value = (yield effect.value) if type(effect) is Emit else effect.sync(face)


async def _astream(face: Any, steps: Steps[None]) -> AsyncIterator[Any]:
    with _closing(steps):
        for effect in (stepper := _Stepper(steps)):
            if type(effect) is Emit:
                yield effect.value
                continue
            with stepper:
                stepper.value = await effect.aio(face)


class _closing:
    """Close the steps when their runner ends early (the caller stopped iterating, a cancel):
    their ``finally`` blocks run now (a watch cancels its call)."""

    def __init__(self, steps: Steps[Any]) -> None:
        self.steps = steps

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.steps.close()


def relay(stream: Steps[None], take: Callable[[Any], T | None]) -> Steps[T | None]:
    """Run the stream op's ``stream`` inside another op: its effects pass through, each value it
    emits goes to ``take``; the first one ``take`` answers (not None) is returned, None if the
    stream ended first."""
    with _closing(stream):
        for effect in (stepper := _Stepper(stream)):
            if type(effect) is Emit:
                if (got := take(effect.value)) is not None:
                    return got
                continue
            with stepper:
                stepper.value = yield effect
    return None


def _face_method(fn: Callable[..., Any], method: Callable[..., Any], ret: str = "") -> Callable[..., Any]:
    """``method`` dressed as ``fn`` (name, docstring, signature), returning ``ret`` (default: the
    type inside ``fn``'s ``Steps[...]``)."""
    functools.update_wrapper(method, fn, updated=())
    del method.__wrapped__  # type: ignore[attr-defined]
    sig = inspect.signature(fn)
    ret = ret or str(sig.return_annotation).removeprefix("Steps[").removesuffix("]")
    method.__signature__ = sig.replace(return_annotation=ret)  # type: ignore[attr-defined]
    method.__annotations__ = {**fn.__annotations__, "return": ret}
    return method


class Op(Generic[P, R]):
    """A call written once as steps; on a face's instance, that face's method."""

    def __init__(self, fn: Callable[Concatenate[Any, P], Steps[R]]) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Op[P, R]: ...
    @overload
    def __get__(self, obj: SyncFace, owner: type | None = None) -> Callable[P, R]: ...
    @overload
    def __get__(self, obj: AsyncFace, owner: type | None = None) -> Callable[P, Coroutine[Any, Any, R]]: ...
    def __get__(self, obj: object, owner: type | None = None) -> Any:
        return self  # a face put its method on its class; the core runs the steps as ``.fn``

    def sync(self) -> Callable[..., Any]:
        fn = self.fn

        def method(face: Any, /, *args: Any, **kwargs: Any) -> Any:
            return _run(face, fn(face, *args, **kwargs))

        return _face_method(fn, method)

    def aio(self) -> Callable[..., Any]:
        fn = self.fn

        async def method(face: Any, /, *args: Any, **kwargs: Any) -> Any:
            return await _arun(face, fn(face, *args, **kwargs))

        return _face_method(fn, method)


class StreamOp(Generic[P, T]):
    """A stream written once as steps (its values yielded as :class:`Emit`): an iterator on the
    sync face, an async iterator on the async face."""

    def __init__(self, fn: Callable[Concatenate[Any, P], Steps[None]], item: str) -> None:
        self.fn, self.item = fn, item
        self.__doc__ = fn.__doc__

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> StreamOp[P, T]: ...
    @overload
    def __get__(self, obj: SyncFace, owner: type | None = None) -> Callable[P, Iterator[T]]: ...
    @overload
    def __get__(self, obj: AsyncFace, owner: type | None = None) -> Callable[P, AsyncIterator[T]]: ...
    def __get__(self, obj: object, owner: type | None = None) -> Any:
        return self

    def sync(self) -> Callable[..., Any]:
        fn = self.fn

        def method(face: Any, /, *args: Any, **kwargs: Any) -> Any:
            return _stream(face, fn(face, *args, **kwargs))

        return _face_method(fn, method, f"Iterator[{self.item}]")

    def aio(self) -> Callable[..., Any]:
        fn = self.fn

        def method(face: Any, /, *args: Any, **kwargs: Any) -> Any:
            return _astream(face, fn(face, *args, **kwargs))

        return _face_method(fn, method, f"AsyncIterator[{self.item}]")


def op(fn: Callable[Concatenate[Any, P], Steps[R]]) -> Op[P, R]:
    return Op(fn)


def stream_op(item: type[T]) -> Callable[[Callable[Concatenate[Any, P], Steps[None]]], StreamOp[P, T]]:
    """``@stream_op(TransferStatus)``: a stream op emitting ``item`` values."""

    def wrap(fn: Callable[Concatenate[Any, P], Steps[None]]) -> StreamOp[P, T]:
        return StreamOp(fn, item.__name__)

    return wrap


def _install(cls: type, which: str) -> None:
    for name in dir(cls):
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, (Op, StreamOp)):
            setattr(cls, name, getattr(attr, which)())


class SyncFace:
    """Runs each effect on the calling thread (subclass it to get the ops as blocking methods)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _install(cls, "sync")


class AsyncFace:
    """Awaits each effect (subclass it to get the ops as coroutine methods)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _install(cls, "aio")
