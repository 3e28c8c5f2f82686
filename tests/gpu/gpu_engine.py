"""A GPU "engine" process for the GPU tests: allocates a KV pool with PyTorch and serves commands.

Run as ``python tests/gpu/gpu_engine.py`` with JSON commands on stdin, one per line; it answers
one JSON line each. The first K region sits at a non-zero offset inside a larger allocation (as
tensors of PyTorch's caching allocator often do).
"""

from __future__ import annotations

import hashlib
import json
import sys
from multiprocessing import shared_memory

import numpy as np
import torch
from kvservice_client import AuxSpec, Client, Layout, cuda_region, shm_region

AUX_ROW = 64  # bytes of an aux row in host memory ("aux_rows" at register)


def main() -> None:
    kv = None
    k: list[torch.Tensor] = []
    v: list[torch.Tensor] = []
    layout = None
    bs = ""
    block = None
    aux_shm: shared_memory.SharedMemory | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        out: dict[str, object] = {"ok": True}
        if op == "register":
            layout = Layout.mha(**cmd["layout"])
            torch.cuda.set_device(cmd.get("device", 0))
            size = layout.region_bytes_k
            block = torch.zeros(size * layout.num_layers + 4096, dtype=torch.uint8, device="cuda")
            # K regions: views at offsets 4096, 4096 + size, ... inside one allocation
            k = [block[4096 + i * size : 4096 + (i + 1) * size] for i in range(layout.num_layers)]
            v = [torch.zeros(size, dtype=torch.uint8, device="cuda") for _ in range(layout.num_v_regions)]
            gen = torch.Generator(device="cuda").manual_seed(cmd.get("seed", 0))
            if cmd.get("fill"):
                for t in k + v:
                    t.copy_(torch.randint(0, 256, t.shape, generator=gen, device="cuda", dtype=torch.uint8))
            torch.cuda.synchronize()
            kv = Client(cmd["address"], client_name="gpu-engine")
            regs = [cuda_region(t) for t in k]
            out["k_offsets"] = [r.offset for r in regs]
            aux = []
            if cmd.get("aux_rows"):  # an aux region in host memory (shm), random when ``fill``
                n = int(cmd["aux_rows"])
                aux_shm = shared_memory.SharedMemory(create=True, size=AUX_ROW * n)
                rows = np.ndarray((n, AUX_ROW), np.uint8, aux_shm.buf)
                rows[:] = (
                    np.random.default_rng(cmd.get("seed", 0)).integers(0, 256, rows.shape)
                    if cmd.get("fill")
                    else 0
                )
                del rows
                aux = [AuxSpec("meta", shm_region(aux_shm.name, AUX_ROW * n), AUX_ROW, n)]
            bs = kv.register_buffers(
                layout, regs, [cuda_region(t) for t in v], aux=aux, engine_id="gpu"
            ).buffer_set_id
            out["buffer_set_id"] = bs
        elif op == "pages":  # hex digest-like: sum of each named page per region, for comparison
            pages = cmd["pages"]
            pb = layout.page_bytes_k  # type: ignore[union-attr]
            out["sums"] = [
                [int(x) for x in t.view(-1, pb)[pages].to(torch.int64).sum(dim=1).tolist()] for t in k + v
            ]
            out["bytes"] = [t.view(-1, pb)[pages].cpu().numpy().tobytes().hex()[:64] for t in k[:1]]
        elif op == "digest":  # sha256 of the named pages' bytes (in the order named), per region
            pb = layout.page_bytes_k  # type: ignore[union-attr]
            torch.cuda.synchronize()
            out["digests"] = [
                hashlib.sha256(t.view(-1, pb)[cmd["pages"]].cpu().numpy().tobytes()).hexdigest()
                for t in k + v
            ]
        elif op == "tokens":  # sha256 of tokens [lo, hi) of the named pages' tokens in order, per region
            lay = layout
            torch.cuda.synchronize()
            out["digests"] = [
                hashlib.sha256(
                    t.view(lay.num_pages, lay.page_size, -1)[cmd["pages"]]  # type: ignore[union-attr]
                    .reshape(len(cmd["pages"]) * lay.page_size, -1)[
                        # type: ignore[union-attr]
                        cmd["lo"] : cmd["hi"]
                    ]
                    .cpu()
                    .numpy()
                    .tobytes()
                ).hexdigest()
                for t in k + v
            ]
        elif op == "heads":  # sha256 of each layer's K and V rows of the named pages, by token and head
            from tests.support.page_layouts import heads_kv

            torch.cuda.synchronize()
            pages = cmd["pages"]
            regs = [t.view(layout.num_pages, -1).cpu().numpy() for t in k + v]  # type: ignore[union-attr]
            ks, vs = heads_kv(regs, pages, layout)  # type: ignore[arg-type]
            out["digests"] = [hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for a in ks + vs]
        elif op == "head_sums":  # [region][page][local head] byte sums
            lay = layout
            pages = cmd["pages"]
            hb = lay.head_dim_k * lay.itemsize  # type: ignore[union-attr]
            out["sums"] = [
                t.view(lay.num_pages, lay.page_size, lay.local_kv_heads, hb)[pages]  # type: ignore[union-attr]
                .to(torch.int64)
                .sum(dim=(1, 3))
                .tolist()
                for t in k + v
            ]
        elif op == "check_fill":
            pb = layout.page_bytes_k  # type: ignore[union-attr]
            pages = cmd["pages"]
            t = k[cmd["layer"]].view(-1, pb)
            mask = torch.zeros(t.shape[0], dtype=torch.bool, device="cuda")
            mask[pages] = True
            out["named_ok"] = bool((t[mask] == cmd["value"]).all())
            out["others_zero"] = bool((t[~mask] == 0).all())
        elif op == "expect":
            st = kv.expect_delta(
                cmd["tid"],
                bs,
                prefix_pages=cmd["prefix"],
                dst_page_indices=cmd["dst"],  # type: ignore[union-attr]
                deadline_ms=cmd.get("deadline_ms", 0),
                sender_address=cmd.get("sender", ""),
                aux=cmd.get("aux"),
            )
            out["state"] = st.state
        elif op == "send":
            before = kv.lane_sent  # type: ignore[union-attr]
            st = kv.send_delta(
                cmd["tid"],
                bs,
                src_page_indices=cmd["src"],
                peer_address=cmd["peer"],  # type: ignore[union-attr]
                path=cmd.get("path", "auto"),
                chunk_offset=cmd.get("offset", 0),
                last_chunk=cmd.get("last", True),
                aux=cmd.get("aux"),
            )
            out["state"] = st.state
            out["lane"] = kv.lane_sent > before  # type: ignore[union-attr]  # over the native lane
        elif op == "abort":
            sts = kv.abort(cmd["tid"], reason="test abort")  # type: ignore[union-attr]
            out["states"] = [s.state for s in sts]
        elif op == "wait":
            try:
                (st,) = kv.wait(cmd["tid"], timeout=cmd.get("timeout", 60))  # type: ignore[union-attr]
            except Exception as exc:  # e.g. its service is gone: the test says what it expected
                out.update(ok=False, state="NO END", error=f"{type(exc).__name__}: {exc}")
                print(json.dumps(out), flush=True)
                continue
            out.update(
                state=st.state,
                error=st.error,
                path=st.path,
                bytes=st.bytes_sent,
                timings=st.timings_us,
                descriptors=st.descriptors,
                route_note=st.route_note,
            )
        elif op == "expect_landing":  # no destination pages
            st = kv.expect_landing(  # type: ignore[union-attr]
                cmd["tid"],
                bs,
                prefix_pages=cmd.get("prefix", 0),
                pages=cmd["pages"],
                ttl_ms=cmd.get("ttl_ms", 0),
            )
            out["state"] = st.state
        elif op == "wait_landed":
            (st,) = kv.wait_landed(cmd["tid"], timeout=60)  # type: ignore[union-attr]
            out.update(state=st.state, error=st.error, error_code=st.error_code, bytes=st.bytes_sent)
        elif op == "claim":
            try:
                c = kv.claim(cmd["tid"], bs, dst_page_indices=cmd["dst"])  # type: ignore[union-attr]
                out.update(state=c.status.state, claim_us=c.claim_us)
            except Exception as exc:  # the test checks the refusal
                out.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        elif op == "landing_stats":
            out["pools"] = [
                {"location": p.location, "used": p.used_bytes, "landings": p.landings, "claims": p.claims}
                for p in kv.get_stats().landing  # type: ignore[union-attr]
            ]
        elif op == "aux":  # the named aux rows' bytes, hex
            rows = np.ndarray((aux_shm.size // AUX_ROW, AUX_ROW), np.uint8, aux_shm.buf)  # type: ignore[union-attr]
            out["rows"] = rows[cmd["rows"]].tobytes().hex()
            del rows
        elif op == "register_aux_vram":  # aux rows in VRAM beside the pools: the service's answer
            meta = torch.zeros(256 * 64, dtype=torch.uint8, device="cuda")
            try:
                kv.register_buffers(  # type: ignore[union-attr]
                    layout,  # type: ignore[arg-type]
                    [cuda_region(t) for t in k],
                    [cuda_region(t) for t in v],
                    aux=[AuxSpec("meta", cuda_region(meta), 256, 64)],
                )
            except Exception as exc:
                out.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        elif op == "free":  # the engine frees its pool while it is registered (and in use)
            k, v, block = [], [], None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        elif op == "unregister":  # the service closes its mappings of the pool (every opening)
            try:
                kv.unregister_buffers(bs)  # type: ignore[union-attr]
            except Exception as exc:
                out.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        elif op == "stop":
            if kv is not None:
                kv.close()
            if aux_shm is not None:
                aux_shm.close()
                aux_shm.unlink()
            print(json.dumps(out), flush=True)
            return
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
