# CHE at CPU scale where the baselines learn the task: bucket_sort, which RoPE, ALiBi and Kerple learn
# in 5000 steps of the che_cpu_table model (the search and the results: docs/che_results.md), with and
# without DAPE V1, 10 seeds, ID and OOD. Resumable, and splittable by DAPE:
# $ OMP_NUM_THREADS=1 python che_tasks.py config/che_cpu_learned.py --grid_dape=none &
# $ OMP_NUM_THREADS=1 python che_tasks.py config/che_cpu_learned.py --grid_dape=v1 &
# $ wait; python che_tasks.py config/che_cpu_learned.py --save_runs=docs/results/che_bucket_sort.json   # runs reused
grid = True
grid_tasks = 'bucket_sort'
grid_pos = 'alibi,kerple,rope'
grid_dape = 'none,v1'
seeds = '0,1,2,3,4,5,6,7,8,9'
learning_rates = '1e-3'
max_iters = 5000         # che_tasks.py's model (2 layers, 4 heads, d=64, D_DAPE=32), batch 32
id_stride = 3            # ID at N = 1, 4, ..., 40
eval_stride = 10         # OOD at N = 41, 51, ..., 91; 64 samples and 4 position draws per length
log_interval = 500
resume = True
out_dir = 'results_che/cpu_learned'
learned_frac = 0.5       # CHE's rule for 'learned' in every table: ID accuracy this share of the way from chance to 100%
