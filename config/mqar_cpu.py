# Multi-query associative recall at CPU scale (retrieval_data.py): causal models trained on up to 8
# key-value pairs (32 tokens), tested on 9 to 57 pairs (up to 228 tokens, 7x the longest training
# sequence). Seeds 0, 1, 2.
# $ OMP_NUM_THREADS=1 python che_tasks.py config/mqar_cpu.py --grid_pos=fox --grid_dape_pos=fox
task = 'mqar'
grid = True
grid_tasks = 'mqar'
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
max_iters = 3000
train_max_len = 8       # N ~ U{1..8} pairs
id_stride = 1
eval_min_len = 9
eval_max_len = 64       # with eval_stride 8: N = 9, 17, ..., 57
eval_stride = 8
eval_samples = 64
eval_draws = 1
log_interval = 250
out_dir = 'results_che/mqar'
resume = True
learned_frac = 0.9       # retrieval's rule for 'learned' in every table: ID accuracy this share of the way from chance to 100%
