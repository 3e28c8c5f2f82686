"""Adds ``--disaggregation-transfer-backend kvservice`` to SGLang 0.5.23.

SGLang chooses transfer backends from a fixed enum (``TransferBackend``) in ``get_kv_class``.
Its general-plugin hook (entry point group ``sglang.srt.plugins``, loaded early in every SGLang
process) lets this package add one without changing SGLang: :func:`register` appends the CLI
choice, adds the enum member and wraps ``get_kv_class`` through SGLang's ``HookRegistry`` (which
also rebinds modules that imported the function by name). Installing kvservice-sglang registers
the entry point; ``python -m kvservice_sglang.launch_server`` is the same thing for environments
that restrict plugins (``SGLANG_PLUGINS``). It also hooks the constructors of SGLang's KV pools and
metadata buffers, so that a CPU engine's pools lie in shared memory (``pools``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BACKEND", "register"]

BACKEND = "kvservice"


def _add_member(enum_cls: Any, name: str, value: str) -> Any:
    """An extra member of a closed Enum, reachable as ``enum_cls(value)`` and ``enum_cls.NAME``."""
    if value in enum_cls._value2member_map_:
        return enum_cls._value2member_map_[value]
    member = object.__new__(enum_cls)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    enum_cls._member_map_[name] = member
    enum_cls._member_names_.append(name)
    enum_cls._value2member_map_[value] = member
    type.__setattr__(enum_cls, name, member)
    return member


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    from sglang.srt.disaggregation.utils import KVClassType

    if getattr(transfer_backend, "value", transfer_backend) != BACKEND or class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    from .conn import KVServiceBootstrapServer, KVServiceManager, KVServiceReceiver, KVServiceSender

    return {
        KVClassType.MANAGER: KVServiceManager,
        KVClassType.SENDER: KVServiceSender,
        KVClassType.RECEIVER: KVServiceReceiver,
        KVClassType.BOOTSTRAP_SERVER: KVServiceBootstrapServer,
    }.get(class_type)


def register() -> None:
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    _add_member(utils.TransferBackend, "KVSERVICE", BACKEND)
    target = "sglang.srt.disaggregation.utils.get_kv_class"
    if not any(h is _get_kv_class for _, h, _ in HookRegistry._hooks.get(target, [])):
        HookRegistry.register(target, _get_kv_class, HookType.AROUND)
    from .pools import TARGETS, around_allocation

    for target in TARGETS:  # a CPU engine's pools in shared memory, which kvservice maps
        if not any(h is around_allocation for _, h, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, around_allocation, HookType.AROUND)
