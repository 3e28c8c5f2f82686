"""kvservice: moves only the KV-cache pages a receiver lacks between inference engines."""

from .config import Config, load_config
from .node import VERSION, Node

__all__ = ["VERSION", "Config", "Node", "load_config"]
__version__ = VERSION
