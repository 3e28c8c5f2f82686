set -u
for round in 1 2; do
  for side in old new; do
    if [ $side = old ]; then D=/tmp/old; else D=/work/main; fi
    cd $D
    PYTHONPATH=$D:$D/clients/python /work/main/.venv/bin/python bench/bench_control.py --cross-node --transfers 100 --match-iters 5 --sustain-s 3 --out /tmp/ab/$side$round 2>&1 | grep -E 'transfer_e2e|sustained|expect_delta' | sed "s/^/ctl $side$round /"
    PYTHONPATH=$D:$D/clients/python /work/main/.venv/bin/python bench/bench_transfer.py --cross-node --paths packed,auto --heads 2 --head-dim 64 --pool-pages 1024 --layers 32 --pages 256 --iters 5 --skip-nixl --out /tmp/ab/$side$round 2>&1 | grep -E 'kvservice path|contiguous' | sed "s/^/xfer $side$round /"
  done
done
