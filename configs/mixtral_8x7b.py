"""Mixtral 8x7B (real shapes): 8 experts, top-2 in every layer, dropless (MegaBlocks-style).

For the planner and ahead-of-time compilation, not for a CPU run. The 8 experts split over
`expert` (expert parallelism, playbook "Expert parallelism"), attention and expert widths over
`tensor`, the rest over `fsdp` (ZeRO-3).
"""

from meshtrain.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/mixtral_8x7b"
    c.cpu_devices = 0
    c.steps = 10000
    c.model.vocab_size = 32000
    c.model.d_model = 4096
    c.model.n_layers = 32
    c.model.n_heads = 32
    c.model.n_kv_heads = 8
    c.model.head_dim = 128
    c.model.mlp_dim = 14336
    c.model.rope_theta = 1000000.0
    c.model.num_experts = 8
    c.model.experts_per_token = 2
    c.model.moe_every = 1
    c.model.moe_mlp_dim = 14336
    c.model.moe_dropless = True
    c.model.moe_exchange_factor = 2.0  # a device takes up to twice its balanced load (the rest is dropped, counted)
    c.model.aux_loss_weight = 0.02
    c.model.router_z_loss_weight = 0.001
    c.train.seq_len = 4096
    c.train.batch_size = 512
    c.train.learning_rate = 3e-4
    c.train.warmup_steps = 2000
    c.train.zero_stage = 3
    c.remat.policy = "full"
    c.mesh.data = 1
    c.mesh.expert = 8
    c.mesh.tensor = 8
    c.mesh.fsdp = -1
    return c
