"""gRPC layer: servicers, the error boundary, server construction."""

from .app import App, build_server, serve

__all__ = ["App", "build_server", "serve"]
