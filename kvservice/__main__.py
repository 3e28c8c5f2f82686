import atexit
import logging
import os
import sys

from .cli import main

code = main()
# NOTE: every command has finished its work here (a service has stopped: its sockets, shared
# memory and staging released, "kvservice stopped" logged). The process ends without running the
# C libraries' exit finalizers: on a host with RDMA libraries (libibverbs, the system's libnl)
# NIXL's bundled UCX loads a second copy of libnl-route, and unloading it at exit crashes
# (SIGSEGV after a clean stop: a service that stopped cleanly would report a crash). Python's own
# exit handlers run first.
atexit._run_exitfuncs()
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code if isinstance(code, int) else 1)
