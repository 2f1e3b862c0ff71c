#!/usr/bin/env bash
# The CUDA paths of both tools, in one run on a GPU machine (the figures in README's "On a GPU").
#
#   bash bench/cuda_check.sh            # writes logs, the profile DB and two checkpoints under $OUT (out/cuda)
#
# Runs from this tree (PYTHONPATH=src) on the machine's own PyTorch and transformers, so it also runs on a
# GPU machine without network or the project's venv (PY=.venv/bin/python to use the venv). Each step has a
# time limit and the next one runs whatever the last one did:
#   1. the CUDA tests (dooly profiling and serving on CUDA, token models training on CUDA);
#   2. dooly: profile smollm2-135m on the GPU, validate forwards (MAPE beside the run-to-run noise floor),
#      then serve a queueing workload with the real HF engine on the GPU against the simulator;
#   3. tracesynth: the shipped checkpoint's recipe (scripts/train_models.py) trained on the GPU for
#      $TRAIN_S seconds, at the shipped size and at a larger one, side by side on the one GPU (0: skip).
set -u
OUT=${OUT:-out/cuda}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
TRAIN_S=${TRAIN_S:-180}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 COLUMNS=160

step() {  # step NAME LIMIT_S COMMAND...: run it with a time limit, log to $OUT/NAME.log, say how it ended
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
}

nvidia-smi -L 2>/dev/null
$PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__,
"cuda" if torch.cuda.is_available() else "no cuda", torch.cuda.get_device_name() if torch.cuda.is_available() else "")'

step tests 300 $PY -m pytest -q -p no:cacheprovider -k cuda tests/dooly/test_profiler.py tests/dooly/test_serving.py \
    tests/tracesynth/test_tokenmodel.py
step profile 300 $PY -m dooly profile smollm2-135m --device "$DEVICE" --db "$OUT/cuda.db"
step validate 240 $PY -m dooly validate smollm2-135m --device "$DEVICE" --db "$OUT/cuda.db"
step serving 240 $PY -m dooly validate-serving smollm2-135m --device "$DEVICE" --db "$OUT/cuda.db" \
    --workload "poisson:n=48,rate=24,prompt=32-384,output=16-48,seed=0" --real-runs 2

if [ "$TRAIN_S" = 0 ]; then  # TRAIN_S=0: the dooly part alone
    tar -C "$OUT" -czf "$OUT/logs.tar.gz" --exclude=logs.tar.gz . && echo "wrote $OUT/logs.tar.gz"
    exit 0
fi
# two trainings share the GPU (each is far from filling it); their steps/s are each other's company
$PY scripts/train_models.py --device "$DEVICE" --seconds "$TRAIN_S" --out "$OUT/d128/all" >"$OUT/train-d128.log" 2>&1 &
$PY scripts/train_models.py --device "$DEVICE" --seconds "$TRAIN_S" --d-model 192 --layers 4 --batch-size 64 \
    --out "$OUT/d192/all" >"$OUT/train-d192.log" 2>&1 &
wait
tail -n 4 "$OUT/train-d128.log" "$OUT/train-d192.log"
# three files in all (a lent GPU machine returns a few): one archive per checkpoint, one of the logs and the DB
for m in d128 d192; do tar -C "$OUT/$m" -cf "$OUT/$m.tar" all all.log 2>/dev/null && rm -rf "${OUT:?}/$m"; done
tar -C "$OUT" -czf "$OUT/logs.tar.gz" --exclude='*.tar' --exclude=logs.tar.gz . \
    && rm -rf "$OUT"/*.log "$OUT/cuda.db" "$OUT/cuda.results" && echo "wrote $OUT/d128.tar, d192.tar, logs.tar.gz"
