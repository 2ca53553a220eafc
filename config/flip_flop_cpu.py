# Flip-flop language modelling at CPU scale (retrieval_data.py): causal models trained on sequences of up
# to 32 instruction-bit pairs (64 tokens) of FFL(0.8), tested on 33 to 225 pairs (up to 450 tokens, 7x)
# of FFL(0.8) and of its sparse (p_ignore 0.98) and dense (0.1) distributions. Seeds 0, 1, 2.
# $ OMP_NUM_THREADS=1 python che_tasks.py config/flip_flop_cpu.py --grid_pos=fox --grid_dape_pos=fox
task = 'flip_flop'
grid = True
grid_tasks = 'flip_flop'
# +sb: stick-breaking attention; +logn: log-length scaling of the logits (docs/encodings.md)
grid_pos = 'nope,rope,alibi,kerple,fox,path,nope+sb,nope+logn,rope+logn,alibi+logn,kerple+logn,fox+logn'
grid_dape = 'none,v1'
grid_dape_pos = 'kerple,fox,path,nope+sb,alibi+logn,kerple+logn,fox+logn'  # DAPE V1 on these seven
seeds = '0,1,2'
rand_pos = False        # causal language models at positions 0..T-1
n_layer = 2
n_head = 4
n_embd = 64
dape_width = 32
batch_size = 32
learning_rate = 1e-3
max_iters = 1500
train_max_len = 32      # N ~ U{2..32} pairs
id_stride = 3
eval_min_len = 33
eval_max_len = 256      # with eval_stride 32: N = 33, 65, ..., 225
eval_stride = 32
eval_samples = 64
eval_draws = 1
log_interval = 250
out_dir = 'results_che/flip_flop'
resume = True
learned_frac = 0.9       # retrieval's rule for 'learned' in every table: ID accuracy this share of the way from chance to 100%
