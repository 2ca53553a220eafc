#!/usr/bin/env bash
# From a fresh clone to a result, on a CPU:
#
#   bash demo.sh            install, prepare gutenberg_char, train five small byte-level models at a short
#                           training length (Kerple, DAPE-Kerple V1, DAPE-Kerple V2 1x3, ALiBi, RoPE), evaluate
#                           them up to 16x that length, and put the table and plot into README.md (~20 min)
#   bash demo.sh --smoke    the same pipeline in a minute: tiny models, a few steps, this repository's own
#                           text as data; writes out-demo-smoke/ and results/demo-smoke/ and leaves README alone
#
# Safe to re-run: prepared data is reused, finished checkpoints are kept (an interrupted run resumes from
# its last checkpoint), and every file is written whole or not at all.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1

step() { printf '\n=== %s\n' "$*"; }

if [ "${DEMO_SKIP_INSTALL:-0}" != 1 ]; then
    step "installing the requirements"
    bash install.sh
fi

if [ $SMOKE = 1 ]; then
    OUT=out-demo-smoke RESULTS=results/demo-smoke DATA_ROOT=out-demo-smoke/data
    step "preparing a tiny byte-level dataset from this repository's own text"
    mkdir -p $OUT/src
    for f in *.py *.md; do cp "$f" "$OUT/src/${f%.*}.txt"; done
    $PY data/gutenberg_char/prepare.py --src $OUT/src --out_dir $DATA_ROOT/gutenberg_char
    TRAIN_ARGS="--block_size=16 --n_layer=1 --n_head=2 --n_embd=16 --batch_size=4 --max_iters=6
                --lr_decay_iters=6 --warmup_iters=1 --eval_interval=3 --eval_iters=2 --log_interval=2"
    EVAL_ARGS="--num_windows=2 --eval_tokens=8"
else
    OUT=out-demo RESULTS=results/demo DATA_ROOT=data
    step "preparing data/gutenberg_char (18 public-domain books as bytes; reused when already there)"
    $PY data/gutenberg_char/prepare.py
    TRAIN_ARGS="" EVAL_ARGS=""
fi

# name  pos  dape
RUNS="kerple       kerple none
      dape_kerple  kerple v1
      dape2_kerple kerple v2
      alibi        alibi  none
      rope         rope   none"
n=$(echo "$RUNS" | wc -l) i=0
CKPTS=""
while read -r name pos dape; do
    i=$((i + 1))
    dir=$OUT/$name
    CKPTS="$CKPTS $dir"
    init=scratch
    [ -f "$dir/ckpt.pt" ] && init=resume  # finished: evaluates once and stops; interrupted: continues
    step "training $i/$n: $name (pos=$pos dape=$dape, $init)"
    $PY train.py config/demo_cpu.py --data_root=$DATA_ROOT --pos=$pos --dape=$dape --out_dir=$dir \
        --init_from=$init $TRAIN_ARGS
done <<< "$RUNS"

step "evaluating at 1, 2, 4, 8 and 16x the training length"
BLOCK=$($PY -c "import torch; print(torch.load('$OUT/kerple/ckpt.pt', weights_only=True)['model_args']['block_size'])")
$PY eval_extrapolate.py $CKPTS --max_length=$((16 * BLOCK)) --out_dir=$RESULTS $EVAL_ARGS

if [ $SMOKE = 0 ]; then
    step "writing the results into README.md"
    $PY demo_report.py $RESULTS
fi
step "done: table $RESULTS/results.md, data $RESULTS/results.json and results.csv, plot $RESULTS/ppl_vs_length.png"
