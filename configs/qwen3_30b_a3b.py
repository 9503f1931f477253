"""Qwen3-30B-A3B (real shapes): 48 layers, 128 experts of width 768, 8 routed a token, dropless.

The shapes are those of the released checkpoint's config.json (Qwen/Qwen3-30B-A3B: hidden_size 2048,
num_hidden_layers 48, 32 query / 4 key-value heads of 128 with q/k RMSNorm, moe_intermediate_size 768,
num_experts 128, num_experts_per_tok 8, norm_topk_prob true, vocab 151,936, rope_theta 1e6, rms_norm_eps
1e-6, untied embeddings, router_aux_loss_coef 0.001); `python -m meshtrain.hf import` reads the same
fields from a downloaded copy. 30.5B parameters, 3.3B of them active a token.

For the planner and ahead-of-time compilation, not for a CPU run. On 8 H100s (one node): ZeRO-3 over
`fsdp`, whose devices also own 16 whole experts each (`model.moe_fsdp` auto: expert parallelism over
fsdp, playbook "Expert parallelism"), the routed tokens exchanged by the ragged all-to-all. On more
nodes set `--config.mesh.expert=8` (the exchange inside a node) and let `fsdp` fill the rest.
"""

from meshtrain.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/qwen3_30b_a3b"
    c.cpu_devices = 0
    c.steps = 10000
    c.model.family = "qwen3"
    c.model.vocab_size = 151936
    c.model.d_model = 2048
    c.model.n_layers = 48
    c.model.n_heads = 32
    c.model.n_kv_heads = 4
    c.model.head_dim = 128
    c.model.qk_norm = True
    c.model.mlp_dim = 6144  # the checkpoint's dense width; every layer is a mixture of experts (moe_every 1)
    c.model.rope_theta = 1000000.0
    c.model.norm_eps = 1e-6
    c.model.num_experts = 128
    c.model.experts_per_token = 8
    c.model.moe_norm_topk = True
    c.model.moe_every = 1
    c.model.moe_mlp_dim = 768
    c.model.moe_dropless = True
    c.model.moe_exchange_factor = 2.0  # a device takes up to twice its balanced load (the rest is dropped, counted)
    c.model.aux_loss_weight = 0.001
    c.model.router_z_loss_weight = 0.001
    c.train.seq_len = 4096
    c.train.batch_size = 512
    c.train.learning_rate = 3e-4
    c.train.warmup_steps = 2000
    c.train.zero_stage = 3
    c.remat.policy = "full"
    c.mesh.data = 1
    c.mesh.fsdp = -1
    return c
