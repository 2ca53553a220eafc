# CHE at the DAPE paper's scale (Table 2 / Appendix D): a GPU run.
# $ python che_tasks.py config/che_paper.py --task=reverse_string --pos=kerple --dape=v1
# $ python che_tasks.py config/che_paper.py --grid=True --grid_tasks=even_pairs,missing_duplicate \
#       --grid_pos=alibi,kerple --out_dir=out-che-paper     # resumable: re-run the same command
# The paper reports the max over seeds and learning rates: every cell is trained once per seed and rate
# below (9 runs). One H100 measured 16 ms per step for Kerple at this size (bf16), so a run of 200k
# steps is about an hour; the count of seeds is not stated in the paper.
n_layer = 5
n_head = 8
n_embd = 256
dape_width = 64          # D_DAPE
rand_pos = True
rand_pos_max = 2048      # maximum randomized position L
train_max_len = 40       # N ~ U{1..40}
max_iters = 200_000
batch_size = 128
learning_rates = '1e-4,3e-4,5e-4'
seeds = '0,1,2'
grad_clip = 1.0
eval_min_len = 41
eval_max_len = 500
eval_stride = 1          # every length 41..500
eval_samples = 512
eval_batch_size = 64
eval_draws = 8           # 8 batches of 64 per length, each with its own randomized positions
log_interval = 1000
resume = True
out_dir = 'out-che-paper'
learned_frac = 0.5       # CHE's rule for 'learned' in every table: ID accuracy this share of the way from chance to 100%
