# The paper's 350M model on the Pile's ArXiv subset, training length 128.
# Appendix B, Table 3: 24 layers, 16 heads, 1024 wide, lr 3e-4 (Figure 4).
# $ python train.py config/arxiv_128_350m.py --pos=kerple --dape=v1 --out_dir=out-arxiv_128_350m-kerple-dape
# One step = batch_size x gradient_accumulation_steps = 256 sequences on any number of GPUs (the paper:
# 32 x 8 on 8 GPUs); lower batch_size and raise gradient_accumulation_steps if memory runs out.
out_dir = 'out-arxiv_128_350m'
wandb_run_name = 'arxiv_128_350m'
dataset = 'arxiv'  # python data/arxiv/prepare.py (offline stand-in: --dataset=texdoc)
block_size = 128
batch_size = 32
gradient_accumulation_steps = 8
n_layer = 24
n_head = 16
n_embd = 1024
dropout = 0.0
learning_rate = 3e-4
min_lr = 3e-5
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
