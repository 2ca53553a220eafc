# CHE at the DAPE paper's scale (Table 2 / Appendix D): a GPU run.
# $ python che_tasks.py config/che_paper.py --task=reverse_string --pos=kerple --dape=v1
# $ python che_tasks.py config/che_paper.py --grid=True          # the whole table: days of GPU time
# The paper reports the max over seeds and learning rates (1e-4, 3e-4, 5e-4); one run is one seed/lr.
n_layer = 5
n_head = 8
n_embd = 256
dape_width = 64          # D_DAPE
rand_pos = True
rand_pos_max = 2048      # maximum randomized position L
train_max_len = 40       # N ~ U{1..40}
max_iters = 200_000
batch_size = 128
learning_rate = 3e-4
grad_clip = 1.0
eval_min_len = 41
eval_max_len = 500
eval_stride = 1          # every length 41..500
eval_samples = 512
eval_batch_size = 64
log_interval = 1000
out_dir = 'out-che-paper'
