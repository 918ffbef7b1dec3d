#!/usr/bin/env bash
# The GPU check of issue 43, run on a lent CUDA machine (the `device` tool), from the repo root:
#   1. continue `rafl supernet train --resume training/cifar10-long` on CUDA (bf16 autocast,
#      channels_last: the trainer's CUDA path) for at most TRAIN_SECONDS, stopped by SIGINT at the
#      limit (the last finished epoch's resume.pt stays), and copy the run's files to $OUT;
#   2. bench/supernet_step.py on CUDA: a progressive-shrinking step against a bare PyTorch step of
#      the same static subnet, images/s of both (batch 128, 24-32 px, the recipe's width 0.35).
# Needs: the wheels of what the machine lacks in .whl/ (ofa, pydantic, ...) and the CIFAR-10 tarball in
# .devdata/ (both carried; the run's config.json records /work/shared/data as its data root).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
mkdir -p /work/shared/data && cp .devdata/cifar10-jpeg.tar.gz /work/shared/data/
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, ofa, pydantic; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
start=$(date +%s)
timeout --signal=INT "${TRAIN_SECONDS:-450}" python3 -m rafl supernet train --resume training/cifar10-long \
  --device cuda > "$OUT/train.log" 2>&1
echo "train exit $? after $(( $(date +%s) - start )) s"
tr '\r' '\n' < "$OUT/train.log" | grep -v "^\s*$" | grep -v "decoding\|reading" | awk 'NR % 157 == 0' | tail -20
for f in config.json metrics.json resume.pt supernet.json supernet.safetensors; do
  [ -f "training/cifar10-long/$f" ] && cp "training/cifar10-long/$f" "$OUT/"
done
python3 -c "import json; m=json.load(open('training/cifar10-long/metrics.json')); [print(p['phase'], [(e['epoch'], round(e['train_acc'], 4)) for e in p['epochs']][-3:], {k: v for k, v in p.items() if k.startswith('val')}) for p in m['phases']]; print('test', m.get('test'))"
timeout 60 python3 bench/supernet_step.py --device cuda --batch 128 --resolutions 24,28,32 --archs 6 --repeats 5 \
  --out "$OUT/supernet_step_cuda.txt" 2>&1 | tail -10
