# Passkey retrieval at half the width of config/passkey_cpu.py (8 heads of 8 channels, 64 wide): the setting of
# docs/passkey_results.md's test-retest over seeds, where each run costs a third of the 16-head model's, so
# that many seeds of every model fit under two roundings of one machine. Everything else is passkey_cpu.py,
# read from it, so that the two settings differ in the width alone. Set pos, dape, dape_init, seed and out_dir per run:
# $ OMP_NUM_THREADS=1 python train.py config/passkey_cpu_small.py --pos=kerple --dape=v1 --seed=0 --out_dir=out-passkey-small/dape_kerple_s0
import os

exec(open(os.path.join(os.path.dirname(__file__), 'passkey_cpu.py')).read())
n_head = 8
n_embd = 64
