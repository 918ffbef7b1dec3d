#!/usr/bin/env bash
# The fair headline (issue 42, bench/fair_headline.py) on a lent GPU machine (the `device` tool), from
# the repo root: every (seed, method) comparison as its own process, JOBS at once, every client on
# the GPU (a job that fails there runs again on the CPU), stopped at SECONDS. What finished comes back
# as $OUT/headline_fair_runs.tar.gz (every comparison's json/md/jsonl, no checkpoints) with the log;
# `python bench/fair_headline.py --from FOLDER` summarizes it here.
# Needs: the wheels of what the machine lacks in .whl/ (ofa, pydantic, fvcore, ...) and the CIFAR-10
# tarball in .devdata/ (both carried). SMOKE=1 DEVICE=cpu runs the plumbing at smoke scale anywhere.
set -u
OUT=${OUT:-/tmp/gpu_headline_out}; mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import ofa, fvcore" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
  [ -e rafl/profiles ] || ln -s ../profiles rafl/profiles  # the package-data package rafl.profiles, uninstalled
fi
export PYTHONUNBUFFERED=1 RAFL_CACHE_DIR=${RAFL_CACHE_DIR:-/tmp/raflcache} OMP_NUM_THREADS=1
DATA=/work/shared/data/cifar10-jpeg.tar.gz
if [ ! -f "$DATA" ]; then mkdir -p /work/shared/data && cp .devdata/cifar10-jpeg.tar.gz "$DATA"; fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'cpus', __import__('os').cpu_count())"
RUNS=${RUNS:-/tmp/headline-fair}
start=$(date +%s)
timeout --signal=INT --kill-after=20 "${SECONDS_LIMIT:-480}" python3 bench/fair_headline.py --data-root "$DATA" \
  --out "$RUNS" --jobs "${JOBS:-27}" --device "${DEVICE:-cuda}" ${SMOKE:+--smoke} > "$OUT/headline_fair.log" 2>&1
echo "fair_headline exit $? after $(( $(date +%s) - start )) s"
pkill -INT -f "rafl compare" 2>/dev/null; sleep 2; pkill -KILL -f "rafl compare" 2>/dev/null
grep -E "exit|failed|again" "$OUT/headline_fair.log" | tail -60
(cd "$RUNS" && find . \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.log' -o -name '*.yaml' \) \
  -size -4M -print0 | tar -czf "$OUT/headline_fair_runs.tar.gz" --null -T -)
ls -la "$OUT"
