"""The end-to-end landing tests run on the transfer tests' fixtures (loopback service pairs, shm
pools, clients)."""

from tests.support.fixtures import make_client, make_pool, pair

__all__ = ["make_client", "make_pool", "pair"]
