#!/usr/bin/env bash
# From a fresh clone to a result, on a CPU:
#
#   bash demo.sh            install, prepare gutenberg_char, train five small byte-level models at a short
#                           training length (Kerple, DAPE-Kerple V1, DAPE-Kerple V2 1x3, ALiBi, RoPE), evaluate
#                           them up to 16x that length (and RoPE with PI, NTK-aware and YaRN), train three
#                           passkey models and test their retrieval up to 16x their length, and put the
#                           tables and plots into README.md
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
    PK_ARGS="--block_size=128 --passkey_frac=0.5" PK_EVAL_ARGS="--trials=1 --depths=0,1 --lengths=128,256"
else
    OUT=out-demo RESULTS=results/demo DATA_ROOT=data
    step "preparing data/gutenberg_char (18 public-domain books as bytes; reused when already there)"
    $PY data/gutenberg_char/prepare.py
    TRAIN_ARGS="" EVAL_ARGS=""
    PK_ARGS="--block_size=128 --batch_size=16 --passkey_frac=0.5 --max_iters=1500 --lr_decay_iters=1500"
    PK_EVAL_ARGS="--trials=10"
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

step "RoPE read with PI, NTK-aware and YaRN beside Kerple, DAPE-Kerple and ALiBi, and the loss at every position"
$PY eval_extrapolate.py $OUT/rope $OUT/kerple $OUT/dape_kerple $OUT/alibi --rope_scaling=none,pi,ntk,yarn --position_loss=True \
    --max_length=$((16 * BLOCK)) --out_dir=$RESULTS/rope_scaling $EVAL_ARGS

# The passkey prompt takes 81 bytes, more than the models above are trained on: models of their own,
# trained at 128 bytes with half of the training rows passkey samples, are tested up to 16x that length.
PK_RUNS="kerple kerple none
         dape_kerple kerple v1
         rope rope none"
PK_CKPTS=""
while read -r name pos dape; do
    dir=$OUT/passkey_$name
    PK_CKPTS="$PK_CKPTS $dir"
    init=scratch
    [ -f "$dir/ckpt.pt" ] && init=resume
    step "training a passkey model: $name (pos=$pos dape=$dape, $init)"
    $PY train.py config/demo_cpu.py --data_root=$DATA_ROOT --pos=$pos --dape=$dape --out_dir=$dir \
        --init_from=$init $TRAIN_ARGS $PK_ARGS
done <<< "$PK_RUNS"
step "passkey retrieval at 1, 2, 4, 8 and 16x the passkey models' training length"
$PY eval_passkey.py $PK_CKPTS --rope_scaling=none,pi,ntk,yarn --out_dir=$RESULTS/passkey $PK_EVAL_ARGS

if [ $SMOKE = 0 ]; then
    step "writing the results into README.md"
    $PY demo_report.py $RESULTS
fi
step "done: table $RESULTS/results.md, data $RESULTS/results.json and results.csv, plot $RESULTS/ppl_vs_length.png;
$RESULTS/rope_scaling/ and $RESULTS/passkey/"
