"""Engine KV pools registered with the service (buffer sets) and the memory they live in."""

from .layout import validate_layout, validate_region_sizes
from .memory import MappedRegion, MemoryImporter
from .registry import AuxBuffer, BufferRegistry, BufferSet

__all__ = [
    "AuxBuffer",
    "BufferRegistry",
    "BufferSet",
    "MappedRegion",
    "MemoryImporter",
    "validate_layout",
    "validate_region_sizes",
]
