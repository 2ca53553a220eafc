# Passkey retrieval at half the width of config/passkey_cpu.py (8 heads of 8 channels, 64 wide): the setting of
# docs/passkey_results.md's test-retest over seeds, where each run costs a third of the 16-head model's, so
# that many seeds of every model fit under two roundings of one machine. Everything else as passkey_cpu.py.
# Set pos, dape, dape_init, seed and out_dir per run:
# $ OMP_NUM_THREADS=1 python train.py config/passkey_cpu_small.py --pos=kerple --dape=v1 --seed=0 --out_dir=out-passkey-small/dape_kerple_s0
dataset = 'gutenberg_char'
block_size = 128
batch_size = 16
gradient_accumulation_steps = 1
n_layer = 4
n_head = 8
n_embd = 64
dropout = 0.0
learning_rate = 2e-3
min_lr = 2e-4
max_iters = 4000
lr_decay_iters = 4000
warmup_iters = 50
passkey_frac = 0.9
eval_interval = 250
eval_iters = 20
log_interval = 50
device = 'cpu'
