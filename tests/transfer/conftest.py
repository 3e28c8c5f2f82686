"""Fixtures for the end-to-end transfer tests: loopback service pairs, shm pools, clients."""

from tests.support.fixtures import make_client, make_pool, pair

__all__ = ["make_client", "make_pool", "pair"]
