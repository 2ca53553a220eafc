# Passkey retrieval at CPU scale (docs/passkey_results.md): the demo's byte-level model with 16 heads of 8
# channels, trained at 128 bytes with 90% of the training rows passkey samples, for 4000 steps. Found by
# search: with 4 heads, half the rows or fewer steps, Kerple and DAPE-Kerple did not learn retrieval even at
# their training length; with 8 heads, whether they learned turned on the seed. Set pos, dape, seed and
# out_dir per run:
# $ OMP_NUM_THREADS=1 python train.py config/passkey_cpu.py --pos=kerple --dape=v1 --seed=1 --out_dir=out-passkey/dape_kerple_s1
dataset = 'gutenberg_char'
block_size = 128
batch_size = 16
gradient_accumulation_steps = 1
n_layer = 4
n_head = 16
n_embd = 128
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
