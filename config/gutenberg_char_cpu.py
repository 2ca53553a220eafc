# A byte-level model on the embedded Gutenberg books that trains in minutes on a 2-core CPU.
# $ python data/gutenberg_char/prepare.py
# $ python train.py config/gutenberg_char_cpu.py                          # Kerple, no DAPE
# $ python train.py config/gutenberg_char_cpu.py --dape=v1 --out_dir=out-gutenberg-char-kerple-dape
out_dir = 'out-gutenberg-char'
wandb_run_name = 'gutenberg_char_cpu'
dataset = 'gutenberg_char'
block_size = 128
batch_size = 16
gradient_accumulation_steps = 1
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
learning_rate = 2e-3  # a small model takes a larger learning rate
min_lr = 2e-4
max_iters = 1000
lr_decay_iters = 1000
warmup_iters = 50
eval_interval = 250
eval_iters = 20
log_interval = 50
device = 'cpu'
