"""Tiny Mixture of Experts for CPU: 8 experts, top-2, every other layer's MLP is the MoE.

Playbook, "Expert parallelism". Every width is divisible by 8 and there are 8 KV heads, so
every 8-device mesh with expert <= 8 (and stage = 1) is valid, e.g.
`--config.mesh.data=2 --config.mesh.expert=4` or `--config.mesh.expert=8 --config.mesh.data=1`.
"""

from meshtrain.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/tiny_moe"
    c.steps = 100
    c.log_every = 10
    c.model.vocab_size = 264  # 256 bytes + BOS/EOS/PAD, padded to a multiple of 8
    c.model.d_model = 64
    c.model.n_layers = 4
    c.model.n_heads = 8
    c.model.n_kv_heads = 8
    c.model.head_dim = 8
    c.model.mlp_dim = 192
    c.model.num_experts = 8
    c.model.experts_per_token = 2
    c.model.moe_every = 2  # layers 2 and 4 are MoE
    c.model.moe_mlp_dim = 64
    c.model.capacity_factor = 1.25
    c.mesh.data = 1
    c.mesh.expert = -1  # all devices split the experts (and the batch outside the MoE layers)
    c.train.batch_size = 16
    c.train.seq_len = 128
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 10
    return c
