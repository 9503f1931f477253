"""Tiny Llama for CPU: trains in about a minute on 8 fake CPU devices and shows the loss falling.

Every width is divisible by 8, so every 8-device mesh with tensor <= 4 and stage <= 4 is valid.
"""

from meshtrain.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/tiny"
    c.steps = 100
    c.log_every = 10
    c.model.vocab_size = 264  # 256 bytes + BOS/EOS/PAD, padded to a multiple of 8
    c.model.d_model = 64
    c.model.n_layers = 4
    c.model.n_heads = 8
    c.model.n_kv_heads = 4
    c.model.head_dim = 8
    c.model.mlp_dim = 192
    c.train.batch_size = 16
    c.train.seq_len = 128
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 10
    return c
