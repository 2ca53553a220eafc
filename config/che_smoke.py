# CHE in seconds: checks the pipeline end to end (the accuracies are meaningless). CPU.
# $ python che_tasks.py config/che_smoke.py --task=parity_check --pos=alibi --dape=v1
n_layer = 1
n_head = 2
n_embd = 32
dape_width = 8
max_iters = 20
batch_size = 16
eval_min_len = 41
eval_max_len = 61
eval_stride = 10
eval_samples = 16
eval_batch_size = 16
log_interval = 10
out_dir = 'out-che-smoke'
learned_frac = 0.5       # CHE's rule for 'learned' in every table: ID accuracy this share of the way from chance to 100%
