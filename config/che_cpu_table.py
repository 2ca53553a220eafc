# The measured CPU-scale subset of the DAPE paper's Table 2 (README, "CHE"): the two tasks where the
# paper shows DAPE's effect most clearly, ALiBi and Kerple with and without DAPE V1, 3 seeds, ID and OOD.
# About 70 s per run on one core of a 2-core CPU (24 runs); resumable, and splittable by task:
# $ OMP_NUM_THREADS=1 python che_tasks.py config/che_cpu_table.py --grid_tasks=even_pairs &
# $ OMP_NUM_THREADS=1 python che_tasks.py config/che_cpu_table.py --grid_tasks=missing_duplicate &
# $ wait; python che_tasks.py config/che_cpu_table.py    # all runs reused: the combined table.md
# Far below the paper's scale (5x256x8, batch 128, 200k steps, lr 1e-4..5e-4): see config/che_paper.py.
grid = True
grid_tasks = 'even_pairs,missing_duplicate'
grid_pos = 'alibi,kerple'
grid_dape = 'none,v1'
seeds = '0,1,2'
learning_rates = '1e-3'  # above the paper's rates: at 2000 steps 3e-4 barely leaves chance level
n_layer = 2
n_head = 4
n_embd = 64
dape_width = 32
max_iters = 2000
batch_size = 32
id_stride = 3            # ID at N = 1, 4, ..., 40
eval_min_len = 41
eval_max_len = 100
eval_stride = 10         # OOD at N = 41, 51, ..., 91
eval_samples = 64
eval_draws = 4
log_interval = 500
resume = True
out_dir = 'results_che/cpu_table'
learned_frac = 0.5       # CHE's rule for 'learned' in every table: ID accuracy this share of the way from chance to 100%
