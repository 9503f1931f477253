"""Tiny DeepSeek-V3 for CPU: every piece of the architecture at a size that trains in seconds.

Multi-head latent attention (a 32-wide key / value latent and a 24-wide query latent, heads of 16 + 8
RoPE for queries and keys and 16 for values), the sigmoid router with its balancing bias moved by the
step (no auxiliary loss but DeepSeek-V3's small sequence-wise one), 8 experts in 4 groups of which a
token's top-2 come from the best 2, one shared expert, the first layer dense, and multi-token prediction
at depth 1. Every width divides by 8, so `--config.mesh.expert=4 --config.mesh.data=2` and the other
8-device meshes with expert <= 8 are valid (`docs/moe.md`, "DeepSeek-V3 and Kimi K2").
"""

from meshtrain.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/tiny_deepseek"
    c.steps = 100
    c.log_every = 10
    c.model.vocab_size = 264  # 256 bytes + BOS/EOS/PAD, padded to a multiple of 8
    c.model.d_model = 64
    c.model.n_layers = 4
    c.model.n_heads = 8
    c.model.n_kv_heads = 8  # latent attention expands a key and a value per head
    c.model.head_dim = 24  # 16 + qk_rope_head_dim
    c.model.kv_lora_rank = 32
    c.model.q_lora_rank = 24
    c.model.qk_rope_head_dim = 8
    c.model.v_head_dim = 16
    c.model.mlp_dim = 192  # the dense first layer's width
    c.model.first_dense_layers = 1
    c.model.num_experts = 8
    c.model.experts_per_token = 2
    c.model.moe_every = 1
    c.model.moe_mlp_dim = 32
    c.model.shared_expert = True
    c.model.moe_dropless = True
    c.model.moe_router = "sigmoid"
    c.model.moe_router_bias = True
    c.model.moe_bias_rate = 0.01  # DeepSeek-V3's 0.001 moves the bias too little over a short CPU run
    c.model.moe_groups = 4
    c.model.moe_topk_groups = 2
    c.model.moe_routed_scale = 2.5
    c.model.moe_balance_scope = "sequence"
    c.model.aux_loss_weight = 0.0001
    c.model.router_z_loss_weight = 0.0
    c.model.mtp_depth = 1
    c.model.mtp_loss_weight = 0.3
    c.mesh.data = 1
    c.mesh.expert = -1  # all devices split the experts (and the batch outside the MoE layers)
    c.train.batch_size = 16
    c.train.seq_len = 128
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 10
    return c
