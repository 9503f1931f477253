"""Llama 3 8B (real shapes): for the planner and ahead-of-time compilation, not for a CPU run."""

from meshtrain.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/llama3_8b"
    c.cpu_devices = 0
    c.steps = 10000
    c.model.vocab_size = 128256
    c.model.d_model = 4096
    c.model.n_layers = 32
    c.model.n_heads = 32
    c.model.n_kv_heads = 8
    c.model.head_dim = 128
    c.model.mlp_dim = 14336
    c.model.rope_theta = 500000.0
    c.train.seq_len = 8192
    c.train.batch_size = 512
    c.train.learning_rate = 3e-4
    c.train.warmup_steps = 2000
    c.train.zero_stage = 3
    c.remat.policy = "full"
    c.mesh.data = 1
    c.mesh.fsdp = -1
    return c
