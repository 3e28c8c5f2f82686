"""SGLang's own KV-event publisher (sglang 0.5.23, run with .venv-vllm's python) driven from a test.

Creates ``sglang.srt.disaggregation.kv_events.ZmqEventPublisher`` (SGLang's encoding, sequence
numbers and replay ROUTER), prints ``@@ ready``, then reads one JSON command per line::

    {"events": [{"type": "BlockStored", ...fields...}, {"type": "BlockRemoved", ...}, ...]}

builds SGLang's BlockStored / BlockRemoved / AllBlocksCleared structs from them, publishes one
KVEventBatch, and answers ``@@ ok``. EOF ends it. Usage: sglang_driver.py PUB REPLAY
"""

import json
import sys
import time


def main() -> None:
    from sglang.srt.disaggregation.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    kinds = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
    pub = ZmqEventPublisher(attn_dp_rank=0, endpoint=sys.argv[1], replay_endpoint=sys.argv[2], topic="kv")
    print("@@ ready", flush=True)
    for line in sys.stdin:
        events = [kinds[e.pop("type")](**e) for e in json.loads(line)["events"]]
        pub.publish(KVEventBatch(ts=time.time(), events=events))
        time.sleep(0.05)
        print("@@ ok", flush=True)
    pub.shutdown()


if __name__ == "__main__":
    main()
