# The paper's 2.7B model on the Pile's ArXiv subset, training length 512.
# Appendix H, Table 8. The paper gives no shape: GPT-3's 2.7B (32 layers, 32 heads, 2560 wide, lr 1.6e-4).
# $ torchrun --standalone --nproc_per_node=8 train.py config/arxiv_512_2.7b.py --pos=kerple --dape=v1 --out_dir=out-arxiv_512_2.7b-kerple-dape
# One step = batch_size x gradient_accumulation_steps = 256 sequences on any number of GPUs (the paper:
# 32 x 8 on 8 GPUs); lower batch_size and raise gradient_accumulation_steps if memory runs out.
out_dir = 'out-arxiv_512_2.7b'
wandb_run_name = 'arxiv_512_2.7b'
dataset = 'arxiv'  # python data/arxiv/prepare.py (offline: --dataset=texdoc); Tables 8/9 do not name theirs
block_size = 512
batch_size = 4
gradient_accumulation_steps = 64
n_layer = 32
n_head = 32
n_embd = 2560
dropout = 0.0
learning_rate = 1.6e-4
min_lr = 1.6e-5
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
# too large for one GPU's memory with AdamW: shard parameters, gradients and optimizer state
fsdp = True
