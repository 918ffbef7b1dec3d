#!/usr/bin/env bash
# The map of bench/where_federation_pays.py on a lent GPU: several comparisons at once on the one GPU
# (the cross-device subnets are too small to fill it alone), every client on cuda (train.device=cuda,
# engine.workers=1 per comparison); a comparison that fails on the GPU is run again on the CPU and its
# log says so. Resumable: the same command skips the finished cells and resumes an interrupted one.
#
#   bench/gpu_map.sh DATA_ROOT [JOBS] [extra where_federation_pays.py arguments]
#
# JOBS (default 6): comparisons at once. Results: bench/results/where_federation_pays.{md,json,png};
# runs: runs/where-federation-pays/pool*-pc*/METHOD.
set -euo pipefail
if [ $# -lt 1 ] || [ ! -e "$1" ]; then
  echo "error: DATA_ROOT: give the CIFAR-10 data root (a folder or .tar.gz) as the first argument" >&2
  exit 2
fi
root=$1
jobs=${2:-6}
shift $(( $# >= 2 ? 2 : 1 ))
case $jobs in ''|*[!0-9]*|0) echo "error: JOBS: is '$jobs', allowed: an integer >= 1" >&2; exit 2;; esac
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "error: no CUDA device on this machine; run bench/where_federation_pays.py on the CPU instead" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
OMP_NUM_THREADS=1 exec python bench/where_federation_pays.py --data-root "$root" --jobs "$jobs" --device cuda "$@"
