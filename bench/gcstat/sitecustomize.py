"""Cyclic-GC statistics of every Python process started with this folder on PYTHONPATH (a
sitecustomize): at exit, GCSTAT_DIR/gcstat-<pid>.txt gets per-generation counts and seconds,
each collection over 5 ms (seconds since start, generation, ms, collected) and the most common
tracked types, e.g. for the services of a bench_control run:

    PYTHONPATH=$PWD:$PWD/clients/python:$PWD/bench/gcstat GCSTAT_DIR=/tmp/gc \
        python3 bench/bench_control.py --device cuda --same-node --sustain-procs 8
"""

# ruff: noqa
import gc, time, atexit, os, sys

_t0 = time.monotonic()
_s = [0.0]
_log = []
_sum = {}


def cb(phase, info):
    if phase == "start":
        _s[0] = time.perf_counter()
    else:
        d = time.perf_counter() - _s[0]
        g = info["generation"]
        c = _sum.setdefault(g, [0, 0.0])
        c[0] += 1
        c[1] += d
        if d > 0.005:
            _log.append((round(time.monotonic() - _t0, 2), g, round(d * 1e3, 1), info.get("collected")))


gc.callbacks.append(cb)


def dump():
    import collections

    c = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    with open(os.path.join(os.environ.get("GCSTAT_DIR", "/tmp"), f"gcstat-{os.getpid()}.txt"), "w") as f:
        f.write(
            f"{sys.argv[:2]} sum {_sum} frozen {gc.get_freeze_count()} tracked {sum(c.values())}\n slow {_log}\n types {c.most_common(12)}\n"
        )


atexit.register(dump)
