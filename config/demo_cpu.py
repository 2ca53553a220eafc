# The CPU demo (demo.sh): small byte-level models on the embedded Gutenberg books, trained at a short
# length so that evaluating at 16x that length stays cheap. demo.sh sets pos, dape and out_dir per run.
dataset = 'gutenberg_char'
block_size = 64
batch_size = 32
gradient_accumulation_steps = 1
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
learning_rate = 2e-3  # a small model takes a larger learning rate
min_lr = 2e-4
max_iters = 350  # what the headline's 20 minutes allow for its 20 models (docs/demo_setting.md)
lr_decay_iters = 350
warmup_iters = 50
eval_interval = 250
eval_iters = 10  # the loss printed while training: its own batches (train.py), read by no table
log_interval = 50
device = 'cpu'
