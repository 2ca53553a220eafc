# Passkey retrieval with 2 layers of config/passkey_cpu.py's 16 heads (8 channels each, 128 wide): the setting of
# docs/passkey_results.md's ten-seed test-retest. The 16 heads are what made retrieval reliable at this scale (with
# 8 heads, or 16 heads of 4 channels, whether a run learned turned on the seed); 2 layers are enough for it and
# halve the cost of a run. Everything else is passkey_cpu.py, read from it. Set pos, dape, dape_init, seed and
# out_dir per run:
# $ OMP_NUM_THREADS=1 python train.py config/passkey_cpu_2layer.py --pos=kerple --dape=v1 --seed=0 --out_dir=out-passkey-2layer/dape_kerple_s0
import os

exec(open(os.path.join(os.path.dirname(__file__), 'passkey_cpu.py')).read())
n_layer = 2
