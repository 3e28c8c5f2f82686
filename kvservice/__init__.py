"""kvservice: moves only the KV-cache pages a receiver lacks between inference engines.

Import submodules directly (``kvservice.server``, ``kvservice.kernels``, ...); this package
module stays light so the kernels and staging pools import without the server's dependencies.
"""

VERSION = "0.1.0"
__version__ = VERSION
__all__ = ["VERSION"]
