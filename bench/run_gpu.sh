#!/usr/bin/env bash
# Full-size GPU runs, one command per device call (see bench/README.md).
#   bash bench/run_gpu.sh x1   # one GPU: both services and engines on GPU 0, plus the CPU path run
#   bash bench/run_gpu.sh x2   # GPU0 -> GPU1: senders on 0, receivers on 1
#   bash bench/run_gpu.sh x2open # two GPUs, one device call (< 10 min): issue 32's open goals
#   bash bench/run_gpu.sh stream # the cross-node lane's streamed 2 GiB, parts 4/8/2, one and two GPUs
#   bash bench/run_gpu.sh mixed  # mixed TP on the same-node lane, the lane's spin (one GPU)
#   bash bench/run_gpu.sh x2mixed # two GPUs: mixed TP across them on the lane, the one-GPU goal rows
#   bash bench/run_gpu.sh x2confirm # two GPUs: issue 32's rows once more at the defaults (< 10 min)
#   bash bench/run_gpu.sh x2final # two GPUs: issue 32's rows on this session's code, the cross-node lane's GPU tests
#   bash bench/run_gpu.sh final28 # issue 28's missed rows repeated after the lean send path (one GPU)
#   bash bench/run_gpu.sh fast   # the lean send path (same node 2 GiB), cross-node 2 GiB on one GPU under MPS
#   bash bench/run_gpu.sh kern   # the lane kernel's shapes, pipelined TMA; the same-node lane's GPU tests
#   bash bench/run_gpu.sh shape  # the kernel's new shape: sweep, issue 28's missed rows (one GPU)
#   bash bench/run_gpu.sh shape2 # two block sizes: sweep, mixed TP on the lane, GPU tests of lane + mixed TP
#   bash bench/run_gpu.sh shape3 # GPU tests of the cross-node lane + transfers; same node and MPS once more
#   bash bench/run_gpu.sh shape4 # same node 2 GiB x3, cross-node 2 GiB on one GPU under MPS x4 (two-kernel code)
#   bash bench/run_gpu.sh ahead  # cross-node packs launched ahead: its GPU tests, 2 GiB on one GPU under MPS x4
#   bash bench/run_gpu.sh verify # the GPU tests of the lanes, abort and two GPUs (verbose log)
#   bash bench/run_gpu.sh open # one GPU, one device call (< 10 min): only the runs behind the goals
#                              # SUMMARY.md lists as missed or not measured, and the GPU tests they need
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
if [ "$1" = open ]; then
  # cross-node 2 GiB on one GPU (>= 30% of NIXL 1 desc): streamed through the lane, 64 MiB slot, then 256 MiB
  T=120 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag lane_stream
  KVSERVICE_LANE_CROSS_MB=1024 T=120 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --skip-baseline --tag lane_stream_1g
  # cross-node 64 MiB (<= 2x NIXL 1 desc + 0.5 ms) and same node 2 GiB (>= 85% of a copy)
  T=90 run bench/bench_transfer.py --device cuda --cross-node --paths auto --expect-lead-ms 3 --layers 32 --pages 32 --iters 100 --tag xlane_64m
  T=90 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl
  # cross-node one-page transfers/s, 64 senders (>= 1,000)
  T=100 run bench/bench_control.py --device cuda --cross-node --match-iters 10 --transfers 200 --sustain-s 5 --sustain-threads 1,8,64 --sustain-procs 8 --tag xlane_open
  # mixed TP 4->2 and 2->1, 2 GiB (>= 80% of a copy)
  T=120 run bench/bench_mixed_tp.py --device cuda --pages 1024 --pool-pages 1088 --configs 4:2,2:1 --skip-per-token --tag 2g
  echo "== GPU tests: the cross-node lane (one WRITE, streamed)" | tee -a "$LOG"
  timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_gpu_cross_lane.py 2>&1 | tail -5 | tee -a "$LOG"
elif [ "$1" = x2open ]; then
  # issue 32's missed or unmeasured goals on two GPUs (< 10 min): cross-node forced GPU0 -> GPU1
  # streamed through the cross-node lane (>= 85% of NIXL 1 desc), two services (>= 90% of the peer
  # copy), mixed TP 2->4 and 4->2 across the GPUs at 2 GiB (>= 80%), and the GPU tests across them
  T=120 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag lane_stream
  T=90 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --paths auto --iters 10 --skip-nixl --expect-lead-ms 3 --tag svc2_open
  T=120 run bench/bench_mixed_tp.py --device cuda --src-gpu 0 --dst-gpu 1 --pages 1024 --pool-pages 1088 --configs 2:4,4:2 --skip-per-token --tag 2g
  echo "== GPU tests across two GPUs" | tee -a "$LOG"
  timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_gpu_across.py tests/gpu/test_gpu_cross_lane.py 2>&1 | tail -8 | tee -a "$LOG"
elif [ "$1" = stream ]; then
  # the cross-node lane's streamed 2 GiB on a two-GPU host: lane_cross_parts 4 (default) / 8 / 2
  # with 1 GiB of GPU staging (default), both services on GPU 0 (issue 28), then GPU0 -> GPU1 (32)
  T=120 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag lane_stream_p4
  KVSERVICE_LANE_CROSS_PARTS=8 T=90 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --skip-baseline --tag lane_stream_p8
  KVSERVICE_LANE_CROSS_PARTS=2 T=90 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --skip-baseline --tag lane_stream_p2
  T=120 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag lane_stream_p4
  KVSERVICE_LANE_CROSS_PARTS=8 T=90 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --skip-baseline --tag lane_stream_p8
  echo "== GPU tests: the cross-node lane" | tee -a "$LOG"
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_gpu_cross_lane.py 2>&1 | tail -4 | tee -a "$LOG"
elif [ "$1" = stream2 ]; then
  # after `stream`: two services GPU0 -> GPU1 with the new defaults (issue 32's >= 90% row), the
  # forced cross-node route's staging/parts on two GPUs, and one GPU with the delta in one WRITE
  T=90 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --paths auto --iters 10 --skip-nixl --expect-lead-ms 3 --timeline --tag svc2_p4
  KVSERVICE_LANE_CROSS_PARTS=2 T=90 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --skip-baseline --tag lane_stream_p2
  KVSERVICE_LANE_CROSS_GPU_MB=2048 T=90 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --skip-baseline --tag lane_stream_p4_2g
  KVSERVICE_LANE_CROSS_GPU_MB=8192 T=120 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag lane_one_write_8g
elif [ "$1" = mixed ]; then
  # mixed TP on the same-node lane (one service, every rank; issue 28's >= 80% row) and the lane's
  # spin (lane_spin_us, service and SDK) on the one-page and 2 GiB same-node rows (>= 85%)
  T=150 run bench/sweep_lane_kernel.py --rounds 3
  PROBE_SPINS=0:0,200:0,0:100,200:100 OUT=$OUT T=300 run bench/probe_lane.py
  T=120 run bench/bench_mixed_tp.py --device cuda --same-node --pages 1024 --pool-pages 1088 --configs 4:2,2:1 --skip-per-token --iters 10 --tag 2g_lane
  KVSERVICE_LANE_SPIN_US=200 T=120 run bench/bench_mixed_tp.py --device cuda --same-node --pages 1024 --pool-pages 1088 --configs 4:2,2:1 --skip-per-token --iters 10 --tag 2g_lane_spin
  KVSERVICE_LANE_SPIN_US=200 T=90 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag spin
  echo "== GPU tests: the lane (mixed TP)" | tee -a "$LOG"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_lane.py 2>&1 | tail -4 | tee -a "$LOG"
elif [ "$1" = mixed2 ]; then
  # after `mixed`: launches pipelined (the lane thread takes the next SEND while a copy runs), the
  # TMA bulk-copy kernel variant, and lane_spin_us 5000 (service) with the SDK's 100 / 2000
  T=150 run bench/sweep_lane_kernel.py --rounds 3
  PROBE_SPINS=0:0,5000:100,5000:2000 OUT=$OUT T=240 run bench/probe_lane.py
  T=120 run bench/bench_mixed_tp.py --device cuda --same-node --pages 1024 --pool-pages 1088 --configs 4:2,2:1 --skip-per-token --iters 10 --tag 2g_lane_pipe
  KVSERVICE_LANE_SPIN_US=5000 T=120 run bench/bench_mixed_tp.py --device cuda --same-node --pages 1024 --pool-pages 1088 --configs 4:2,2:1 --skip-per-token --iters 10 --tag 2g_lane_pipe_spin
  KVSERVICE_LANE_SPIN_US=5000 T=90 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag spin5000
  echo "== GPU tests: the lane (pipelined launches)" | tee -a "$LOG"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_lane.py tests/gpu/test_gpu_abort.py 2>&1 | tail -4 | tee -a "$LOG"
elif [ "$1" = x2mixed ]; then
  # two GPUs: mixed TP 2->4 and 4->2 GPU0 -> GPU1 on the same-node lane (issue 32's >= 80% row),
  # the one-service GPU0 -> GPU1 2 GiB row again (pipelined launches), the one-GPU goal rows of
  # mixed TP and same node 2 GiB (GPU 0) with lane_spin_us 5000, and the GPU tests of the lane
  KVSERVICE_LANE_SPIN_US=5000 T=120 run bench/bench_mixed_tp.py --device cuda --same-node --src-gpu 0 --dst-gpu 1 --pages 1024 --pool-pages 1088 --configs 2:4,4:2 --skip-per-token --iters 10 --tag 2g_lane_spin
  KVSERVICE_LANE_SPIN_US=5000 T=90 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --same-node --paths auto --iters 20 --skip-nixl --tag lane_spin
  KVSERVICE_LANE_SPIN_US=5000 T=120 run bench/bench_mixed_tp.py --device cuda --same-node --pages 1024 --pool-pages 1088 --configs 4:2,2:1 --skip-per-token --iters 20 --tag 2g_lane_spin_final
  KVSERVICE_LANE_SPIN_US=5000 T=90 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag spin_final
  echo "== GPU tests: the lane, two GPUs" | tee -a "$LOG"
  timeout 240 python3 -m pytest -v -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_gpu_lane.py tests/gpu/test_gpu_across.py 2>&1 | grep -v -e "NIXL INFO" -e "eventfd error" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
elif [ "$1" = x2confirm ]; then
  # issue 32's rows once more at the defaults, one call (< 10 min): two services GPU0 -> GPU1 three
  # times (>= 90%, last measured at the edge), mixed TP across on the lane (>= 80%), the one-service
  # lane and the forced cross-node route (2 GiB)
  for i in 1 2 3; do
    T=90 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --paths auto --iters 10 --skip-nixl --expect-lead-ms 3 --tag svc2_confirm$i
  done
  T=120 run bench/bench_mixed_tp.py --device cuda --same-node --src-gpu 0 --dst-gpu 1 --pages 1024 --pool-pages 1088 --configs 2:4,4:2 --skip-per-token --iters 10 --tag 2g_lane
  T=90 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --same-node --paths auto --iters 20 --skip-nixl --tag lane_confirm
  T=120 run bench/bench_transfer.py --device cuda --src-gpu 0 --dst-gpu 1 --cross-node --paths auto --iters 5 --expect-lead-ms 3 --tag lane_stream_confirm
elif [ "$1" = reader ]; then
  # (2026-11-28f, first call) the SDK lane reader parked / polling / absent (probe_lane; parking
  # was reverted: no difference), the same-node 2 GiB row, the cross-node 2 GiB on one GPU under MPS
  PROBE_TAG=_none PROBE_NO_READER=1 PROBE_SPINS=5000:5000 OUT=$OUT T=200 run bench/probe_lane.py
  KVSERVICE_LANE_SPIN_US=5000 T=90 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag park
elif [ "$1" = fast ]; then
  # same node: the SDK's send path without numpy checks (i64 pages), the REPLY after the launch
  # (probe_lane's timeline, the 2 GiB goal row); cross-node 2 GiB on one GPU under MPS (CUDA's
  # multi-process service: both services' kernels run side by side) at the defaults, 2 / 8 parts,
  # 2 GiB of staging; then the abort GPU tests
  PROBE_TAG=_fast PROBE_SPINS=5000:5000 OUT=$OUT T=200 run bench/probe_lane.py
  KVSERVICE_LANE_SPIN_US=5000 T=90 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag fast
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog && nvidia-cuda-mps-control -d && echo "== MPS on" | tee -a "$LOG"
  T=120 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag mps_stream2
  for v in p2:2:1024 p8:8:1024 g2:4:2048; do
    IFS=: read -r tag parts mb <<< "$v"
    KVSERVICE_LANE_CROSS_PARTS=$parts KVSERVICE_LANE_CROSS_GPU_MB=$mb T=90 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --skip-baseline --skip-nixl --tag mps_$tag
  done
  echo quit | nvidia-cuda-mps-control
  timeout 150 python3 -m pytest -v -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_gpu_abort.py 2>&1 | grep -v -e "NIXL INFO" -e "eventfd error" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
elif [ "$1" = final28 ]; then
  # issue 28's missed rows after the lean send path, repeated: same node 2 GiB three times (the
  # row takes their median) and once at the defaults, the one-page delta, mixed TP on the lane;
  # cross-node 2 GiB on one GPU under MPS twice; the GPU tests of the lanes
  for i in 1 2 3; do
    KVSERVICE_LANE_SPIN_US=5000 T=90 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag final$i
  done
  T=90 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag final_nospin
  T=60 run bench/bench_transfer.py --device cuda --same-node --layers 1 --pages 1 --iters 20 --skip-nixl --paths auto --tag delta_64k
  KVSERVICE_LANE_SPIN_US=5000 T=120 run bench/bench_mixed_tp.py --device cuda --same-node --pages 1024 --pool-pages 1088 --configs 4:2,2:1 --skip-per-token --iters 20 --tag 2g_lane_fast
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog && nvidia-cuda-mps-control -d && echo "== MPS on" | tee -a "$LOG"
  for i in 1 2; do
    T=120 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag mps_final$i
  done
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  timeout 240 python3 -m pytest -v -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_gpu_lane.py tests/gpu/test_gpu_mixed_tp.py \
    tests/gpu/test_gpu_cross_lane.py 2>&1 | grep -v -e "NIXL INFO" -e "eventfd error" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
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
elif [ "$1" = kern ]; then
  # the lane kernel's launch shapes and the pipelined bulk-copy (TMA) kernel against a device copy,
  # then the GPU tests of the same-node lane and abort (the native code split into csrc/)
  T=240 run bench/sweep_lane_kernel.py --rounds 3
  timeout 330 python3 -m pytest -v -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_gpu_lane.py \
    tests/gpu/test_gpu_abort.py 2>&1 | grep -v -e "NIXL INFO" -e "eventfd error" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
elif [ "$1" = shape ]; then
  # the lane kernel at 512 threads, 32 KiB a block, its page pair read beside its region: the
  # kernel sweep, issue 28's missed rows (same node 2 GiB three times with spin and once at the
  # defaults, the one-page delta, mixed TP), cross-node 2 GiB on one GPU under MPS three times
  T=120 run bench/sweep_lane_kernel.py --rounds 2
  for i in 1 2 3; do
    KVSERVICE_LANE_SPIN_US=5000 T=80 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag shape$i
  done
  T=80 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag shape_nospin
  T=60 run bench/bench_transfer.py --device cuda --same-node --layers 1 --pages 1 --iters 20 --skip-nixl --paths auto --tag delta_64k_shape
  KVSERVICE_LANE_SPIN_US=5000 T=100 run bench/bench_mixed_tp.py --device cuda --same-node --pages 1024 --pool-pages 1088 --configs 4:2,2:1 --skip-per-token --iters 20 --tag 2g_lane_shape
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog && nvidia-cuda-mps-control -d && echo "== MPS on" | tee -a "$LOG"
  for i in 1 2 3; do
    T=100 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag mps_shape$i
  done
  echo quit | nvidia-cuda-mps-control
elif [ "$1" = shape2 ]; then
  # two block sizes (wide for whole pages of >= 32 KiB a block, 256 threads for head slices): the
  # kernel sweep, mixed TP on the lane (its 8 KiB slices lost 16 points at 512 threads), the GPU
  # tests of the lane and mixed TP
  T=120 run bench/sweep_lane_kernel.py --rounds 2
  KVSERVICE_LANE_SPIN_US=5000 T=100 run bench/bench_mixed_tp.py --device cuda --same-node --pages 1024 --pool-pages 1088 --configs 4:2,2:1 --skip-per-token --iters 20 --tag 2g_lane_shape2
  timeout 330 python3 -m pytest -v -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_gpu_lane.py \
    tests/gpu/test_gpu_mixed_tp.py 2>&1 | grep -v -e "NIXL INFO" -e "eventfd error" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
elif [ "$1" = shape3 ]; then
  # the GPU tests of the cross-node lane and the transfer paths; same node 2 GiB and cross-node
  # 2 GiB on one GPU under MPS once more
  KVSERVICE_LANE_SPIN_US=5000 T=80 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag shape4
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog && nvidia-cuda-mps-control -d && echo "== MPS on" | tee -a "$LOG"
  T=100 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag mps_shape4
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  timeout 400 python3 -m pytest -v -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_gpu_cross_lane.py \
    tests/gpu/test_gpu_transfer.py 2>&1 | grep -v -e "NIXL INFO" -e "eventfd error" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
elif [ "$1" = shape4 ]; then
  # issue 28's two rows once more on the two-kernel code (their JSONs come back in results.tar.gz):
  # same node 2 GiB twice with spin and once at the defaults, cross-node 2 GiB on one GPU under MPS
  # four times
  for i in 5 6; do
    KVSERVICE_LANE_SPIN_US=5000 T=80 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag shape$i
  done
  T=80 run bench/bench_transfer.py --device cuda --same-node --paths auto --iters 30 --skip-nixl --tag shape_nospin2
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog && nvidia-cuda-mps-control -d && echo "== MPS on" | tee -a "$LOG"
  for i in 5 6 7 8; do
    T=100 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag mps_shape$i
  done
  echo quit | nvidia-cuda-mps-control
elif [ "$1" = ahead ]; then
  # the streamed cross-node send packs chunk k + 1 while it waits for WRITE k - 1: the GPU tests of
  # the cross-node lane and abort, then cross-node 2 GiB on one GPU under MPS four times
  timeout 200 python3 -m pytest -v -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_gpu_cross_lane.py \
    tests/gpu/test_gpu_abort.py 2>&1 | grep -v -e "NIXL INFO" -e "eventfd error" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog && nvidia-cuda-mps-control -d && echo "== MPS on" | tee -a "$LOG"
  for i in 1 2 3 4; do
    T=80 run bench/bench_transfer.py --device cuda --cross-node --paths auto --iters 5 --expect-lead-ms 3 --timeline --tag mps_ahead$i
  done
  echo quit | nvidia-cuda-mps-control
elif [ "$1" = verify ]; then
  # the GPU tests of the paths a session changed (lane, cross-node lane, abort, two GPUs, mixed TP),
  # verbose, into $OUT/gpu_tests.log (copied to docs/gpu-verification/)
  timeout "${T:-480}" python3 -m pytest -v -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_gpu_lane.py \
    tests/gpu/test_gpu_cross_lane.py tests/gpu/test_gpu_abort.py tests/gpu/test_gpu_across.py \
    tests/gpu/test_gpu_transfer.py tests/gpu/test_gpu_mixed_tp.py 2>&1 | grep -v -e "NIXL INFO" -e "eventfd error" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
  # the lane's kernel text (csrc/kernel.h) through CuPy, against a device copy
  T=150 run bench/sweep_lane_kernel.py --rounds 1
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
