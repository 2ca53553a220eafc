# The paper's 125M model on the Pile's ArXiv subset, training length 128.
# Appendix B, Table 3: 12 layers, 12 heads, 768 wide.
# $ python train.py config/arxiv_128.py --pos=kerple --dape=v1 --out_dir=out-arxiv_128-kerple-dape
# One step = batch_size x gradient_accumulation_steps = 256 sequences on any number of GPUs (the paper:
# 32 x 8 on 8 GPUs); lower batch_size and raise gradient_accumulation_steps if memory runs out.
out_dir = 'out-arxiv_128'
wandb_run_name = 'arxiv_128'
dataset = 'arxiv'  # python data/arxiv/prepare.py (offline stand-in: --dataset=texdoc)
block_size = 128
batch_size = 32
gradient_accumulation_steps = 8
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
learning_rate = 6e-4
min_lr = 6e-5
max_iters = 50000
lr_decay_iters = 50000
warmup_iters = 500  # 1%
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
eval_interval = 1000
eval_iters = 100
# the paper trained in float16; 'auto' is bfloat16 where the GPU has it (--dtype=float16 to match)
dtype = 'auto'
