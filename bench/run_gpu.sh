#!/usr/bin/env bash
# Full-size GPU runs, one command per device call (see bench/README.md).
#   bash bench/run_gpu.sh x1   # one GPU: both services and engines on GPU 0, plus the CPU path run
#   bash bench/run_gpu.sh x2   # GPU0 -> GPU1: senders on 0, receivers on 1
#   bash bench/run_gpu.sh x2open # two GPUs, one device call (< 10 min): issue 32's open goals
#   bash bench/run_gpu.sh x2final # two GPUs: issue 32's rows on this session's code, the cross-node lane's GPU tests
#   bash bench/run_gpu.sh verify # the GPU tests of the lanes, abort and two GPUs (verbose log)
#   bash bench/run_gpu.sh open # one GPU, one device call (< 10 min): only the runs behind the goals
#                              # SUMMARY.md lists as missed or not measured, and the GPU tests they need
#   bash bench/run_gpu.sh goals28 # one GPU (< 10 min): issue 28's 2 GiB rows (same node, mixed TP,
#                                 # cross-node on one GPU under MPS) and the kernel sweep
# Earlier sessions' one-off modes (stream, mixed, fast, final28, kern, shape*, ahead, ...) are in the
# git history; bench/results/NOTES.md names the commit and mode of every call.
# Writes JSON and a log under ${OUT:-bench/results}.
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import nixl" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/clients/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
LOG="$OUT/log_$1.txt"
run() { echo "== $*" | tee -a "$LOG"; timeout "${T:-240}" python3 "$@" --out "$OUT" 2>&1 | grep -v -e "NIXL INFO" -e "eventfd error" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$LOG"
# CUDA's multi-process service: both services' kernels on one GPU run side by side, not time-sliced
mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog && nvidia-cuda-mps-control -d && echo "== MPS on" | tee -a "$LOG"
}
mps_off() {
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
if [ "$1" = open ]; then
  # the row SUMMARY.md lists as missed (2026-11-29): cross-node 2 GiB on one GPU >= 30% of NIXL's
  # one-descriptor WRITE, both services under CUDA MPS, at the default staging four times and with
  # 2 GiB of GPU staging twice (each with its own NIXL baseline); the cross-node lane's GPU tests
  mps_on
  for i in 1 2 3 4; do
    T=80 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag mps_open$i
  done
  for i in 1 2; do
    KVSERVICE_LANE_CROSS_GPU_MB=2048 T=80 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag mps_open_g2$i
  done
  mps_off
  timeout 150 python3 -m pytest -v -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_gpu_cross_lane.py 2>&1 \
    | grep -v -e "NIXL INFO" -e "eventfd error" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
elif [ "$1" = x2open ]; then
  # issue 32's missed or unmeasured goals on two GPUs (< 10 min): cross-node forced GPU0 -> GPU1
  # streamed through the cross-node lane (>= 85% of NIXL 1 desc), two services (>= 90% of the peer
  # copy), mixed TP 2->4 and 4->2 across the GPUs at 2 GiB (>= 80%), and the GPU tests across them
  T=120 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag lane_stream
  T=90 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --paths auto --iters 10 --skip-nixl --expect-lead-ms 3 --tag svc2_open
  T=120 run bench/bench_mixed_tp.py --device cuda --src-gpu 0 --dst-gpu 1 --pages 1024 --pool-pages 1088 --configs 2:4,4:2 --skip-per-token --tag 2g
  echo "== GPU tests across two GPUs" | tee -a "$LOG"
  timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_gpu_across.py tests/gpu/test_gpu_cross_lane.py 2>&1 | tail -8 | tee -a "$LOG"
elif [ "$1" = x2final ]; then
  # issue 32's rows at the defaults on this session's code (two services GPU0 -> GPU1 twice, mixed
  # TP across on the lane, the one-service lane, the forced cross-node route), then the GPU tests
  # of the cross-node lane (streamed included) and across the two GPUs
  for i in 1 2; do
    T=80 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --paths auto --iters 10 --skip-nixl --expect-lead-ms 3 --tag svc2_final$i
  done
  T=100 run bench/bench_mixed_tp.py --device cuda --same-node --src-gpu 0 --dst-gpu 1 --pages 1024 --pool-pages 1088 --configs 2:4,4:2 --skip-per-token --iters 10 --tag 2g_lane_final
  T=80 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --same-node --paths auto --iters 20 --skip-nixl --tag lane_final
  T=100 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --cross-node --paths auto --iters 5 --expect-lead-ms 3 --tag lane_stream_final
  timeout 200 python3 -m pytest -v -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_gpu_cross_lane.py tests/gpu/test_gpu_across.py \
    2>&1 | grep -v -e "NIXL INFO" -e "eventfd error" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
elif [ "$1" = goals28 ]; then
  # issue 28's 2 GiB rows on one GPU, each beside its same-run baseline: the lane kernel's sweep,
  # same node three times with the spin and once at the defaults, mixed TP on the lane, the
  # cross-node route with both services on the GPU under CUDA MPS four times
  T=120 run bench/sweep_lane_kernel.py --rounds 2
  for i in 1 2 3; do
    KVSERVICE_LANE_SPIN_US=5000 T=80 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag goals$i
  done
  T=80 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag goals_nospin
  KVSERVICE_LANE_SPIN_US=5000 T=100 run bench/bench_mixed_tp.py --device cuda --same-node --pages 1024 --pool-pages 1088 --configs 4:2,2:1 --skip-per-token --iters 20 --tag 2g_lane_goals
  mps_on
  for i in 1 2 3 4; do
    T=80 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag mps_goals$i
  done
  mps_off
elif [ "$1" = spin ]; then
  # 2026-11-29 (second): the Copier split's GPU tests (same-node lane, mixed TP), the same-node
  # 2 GiB row at the defaults (waiters spin as the service advises: 2 ms on a GPU lane), the
  # cross-node 2 GiB on one GPU under MPS with the lane's chunk timeline
  timeout 200 python3 -m pytest -v -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_gpu_lane.py tests/gpu/test_gpu_mixed_tp.py \
    2>&1 | grep -v -e "NIXL INFO" -e "eventfd error" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
  for i in 1 2; do
    T=80 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag advised$i
  done
  mps_on
  for i in 1 2; do
    T=90 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag mps_chunks$i
  done
  mps_off
elif [ "$1" = auto ]; then
  # 2026-11-29 (second), third call: same node 2 GiB at the defaults (the lane's thread spins 5 ms,
  # waiters 2 ms) twice, and with waiters told 5 ms twice; cross-node 2 GiB on one GPU under MPS
  # at the defaults, 20 iterations, twice without the DEBUG timeline and once with it; the GPU
  # tests of abort and mixed TP (not yet run on the Copier split)
  for i in 1 2; do
    T=70 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag auto5k$i
    KVSERVICE_LANE_WAIT_SPIN_US=5000 T=70 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag auto5k_wait5k$i
  done
  mps_on
  for i in 1 2; do
    T=100 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 20 --expect-lead-ms 3 --tag mps_auto$i
  done
  T=100 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 10 --expect-lead-ms 3 --timeline --tag mps_auto_tl
  mps_off
  timeout 170 python3 -m pytest -v -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_gpu_abort.py tests/gpu/test_gpu_mixed_tp.py 2>&1 \
    | grep -v -e "NIXL INFO" -e "eventfd error" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
elif [ "$1" = final ]; then
  # 2026-11-29 (second), last call: the bulk thread spins after an offer, waiters 5 ms: same node
  # 2 GiB at the defaults three times, cross-node 2 GiB on one GPU under MPS three times (20
  # iterations) and once with the chunks' timeline, then the cross-node lane's GPU tests
  for i in 1 2 3; do
    T=70 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag fin29b$i
  done
  mps_on
  for i in 1 2 3; do
    T=100 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 20 --expect-lead-ms 3 --tag mps_fin29b$i
  done
  T=100 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 10 --expect-lead-ms 3 --timeline --tag mps_fin29b_tl
  mps_off
  timeout 120 python3 -m pytest -v -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_gpu_cross_lane.py 2>&1 \
    | grep -v -e "NIXL INFO" -e "eventfd error" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
elif [ "$1" = last29b ]; then
  # 2026-11-29 (second), the code of "final" again: mixed TP 4->2 / 2->1 at the defaults, same node
  # 2 GiB twice more, cross-node 2 GiB on one GPU under MPS twice more
  T=100 run bench/bench_mixed_tp.py --device cuda --same-node --pages 1024 --pool-pages 1088 --configs 4:2,2:1 --skip-per-token --iters 20 --tag 2g_lane_fin29b
  for i in 4 5; do
    T=70 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag fin29b$i
  done
  mps_on
  for i in 4 5; do
    T=100 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 20 --expect-lead-ms 3 --tag mps_fin29b$i
  done
  mps_off
elif [ "$1" = verify ]; then
  # the GPU tests of the lanes and the transfer paths (same node, cross-node, abort, mixed TP, two
  # GPUs where there are two), verbose, into $OUT/gpu_tests.log (copied to docs/gpu-verification/)
  timeout "${T:-540}" python3 -m pytest -v -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_gpu_lane.py \
    tests/gpu/test_gpu_cross_lane.py tests/gpu/test_gpu_abort.py tests/gpu/test_gpu_across.py \
    tests/gpu/test_gpu_transfer.py tests/gpu/test_gpu_mixed_tp.py 2>&1 | grep -v -e "NIXL INFO" -e "eventfd error" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
elif [ "$1" = x1 ]; then
  # issue 30 item 1: every conversion case (CASES: each page layout as sender and receiver, each
  # page-size relation) at 2 GiB against the same-layout fused rate -> convert_gpu_matrix.json
  T=300 run bench/bench_convert.py --device cuda --tokens 16384 --layers 32 --heads 8 --iters 5 --tag matrix
  # same node: one service (fused), two services on this host (fused over CUDA IPC), cross-node forced
  T=150 run bench/bench_transfer.py --device cuda --same-node --paths auto,packed
  # deltas: a page is layers x K/V x 32 KiB: 64 KiB = 1 layer x 1 page, 1 MiB = 16 layers, 64 MiB = 32 pages
  for d in "64k 1 1" "1m 16 1" "64m 32 32"; do
    set -- $d
    T=60 run bench/bench_transfer.py --device cuda --same-node --layers $2 --pages $3 --iters 20 --skip-nixl --paths auto --tag delta_$1
  done
  set -- x1
  T=150 run bench/bench_transfer.py --device cuda --paths auto
  T=150 run bench/bench_transfer.py --device cuda --cross-node --paths auto,packed --timeline  # batch timeline
  # 2 GiB cross-node streamed through the lane (64 MiB slot, 32 MiB chunks; then 128 MiB chunks)
  T=150 run bench/bench_transfer.py --device cuda --cross-node --paths auto --expect-lead-ms 3 --tag lane_stream
  KVSERVICE_LANE_CROSS_MB=1024 T=150 run bench/bench_transfer.py --device cuda --cross-node --paths auto --expect-lead-ms 3 --tag lane_stream_1g
  T=170 run bench/sweep_fused.py   # the fused kernel's launch shapes against a device copy
  T=150 run bench/bench_mixed_tp.py --device cuda
  T=150 run bench/bench_mixed_tp.py --device cuda --pages 1024 --pool-pages 1088 --configs 4:2,2:1 --skip-per-token --tag 2g  # two services (gRPC route)
  T=120 run bench/bench_mixed_tp.py --device cuda --same-node --pages 1024 --pool-pages 1088 --configs 4:2,2:1 --skip-per-token --iters 20 --tag 2g_lane  # goal: >= 80% of a copy
  T=110 run bench/bench_multiturn.py --device cuda
  T=60 run bench/bench_control.py
  T=60 run bench/bench_launch.py --layers 1 --tag _64k   # the Python launch floor (native decision)
  T=60 run bench/bench_launch.py --layers 32 --tag _2m
  T=60 run bench/bench_control.py --same-node
  T=90 run bench/bench_landing.py --device cuda --mib 64   # issue 31: claim <= copy + 0.3 ms
  T=70 run bench/bench_transfer.py --device cpu --layers 32 --pages 256 --pool-pages 512 --iters 3 --tag host16
else
  # which kernels may touch a pool imported on the other GPU (c1/c2 fault by design: not run here)
  for c in a d e; do echo "== probe $c" | tee -a "$LOG"; timeout 60 python3 bench/probe_two_gpu_ipc.py $c 2>&1 | tail -3 | tee -a "$LOG"; done
  # one service: the native lane's kernel across the link (push, then pull), one page beside the same GPU's
  T=90 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --same-node --paths auto --iters 10 --skip-nixl --tag lane
  KVSERVICE_TWO_GPU_COPY=pull T=90 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --same-node --paths auto --iters 10 --skip-nixl --tag lane_pull_16
  T=60 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --same-node --layers 1 --pages 1 --iters 100 --skip-nixl --skip-baseline --paths auto --tag delta_64k_lane
  T=60 run bench/bench_transfer.py --device cuda --same-node --layers 1 --pages 1 --iters 100 --skip-nixl --skip-baseline --paths auto --tag delta_64k_x2host_b
  # the gRPC route (no lane): two_gpu_copy push / pull / staged, 2 GiB and one page
  for m in push pull staged; do
    KVSERVICE_TWO_GPU_COPY=$m T=70 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --same-node --no-lane --paths auto --iters 10 --skip-nixl --tag $m
    KVSERVICE_TWO_GPU_COPY=$m T=50 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --same-node --no-lane --layers 1 --pages 1 --iters 60 --skip-nixl --skip-baseline --paths auto --tag delta_64k_$m
  done
  T=150 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --paths auto --iters 10 --skip-nixl --tag svc2_staged
  T=150 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --cross-node --paths auto,packed
  T=150 run bench/bench_mixed_tp.py --device cuda --src-gpu 0 --dst-gpu 1
  T=120 run bench/bench_mixed_tp.py --device cuda --same-node --src-gpu 0 --dst-gpu 1 --pages 1024 --pool-pages 1088 --configs 2:4,4:2 --skip-per-token --iters 10 --tag 2g_lane  # goal: >= 80%
  T=130 run bench/bench_multiturn.py --device cuda --src-gpu 0 --dst-gpu 1
  # diagnosis: fewer, larger staging batches (4 GiB pool -> 1 GiB batches instead of 256 MiB)
  T=90 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --iters 3 --skip-baseline --vram-staging-mb 4096 --tag staging4g
fi
# the device tool brings back at most 8 files: past that, the results go back as one archive
# (tar xzf results.tar.gz -C bench/results)
if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && find . -maxdepth 1 -type f \( -name "*.json" -o -name "*.png" \) -printf "%f\n" \
    | tar czf results.tar.gz --remove-files -T -)
fi
ls -la "$OUT"
