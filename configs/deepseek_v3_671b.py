"""DeepSeek-V3 (real shapes, 671B parameters, 37B active a token) in the layout it was trained with: for the
planner and ahead-of-time compilation (`python -m meshtrain.aot --config configs/deepseek_v3_671b.py --target
h100 --devices 2048`), not for a CPU run (`configs/tiny_deepseek.py` is the same architecture at a CPU's size).

Where each number comes from ("DeepSeek-V3 Technical Report", 2024, and the released config.json):
- shapes (section 4.2; config.json): 61 layers, hidden 7,168, 128 heads; multi-head latent attention with a
  query latent of 1,536 and a key / value latent of 512, per-head query / key dims 128 + 64 (RoPE) and value
  dim 128; the first 3 layers dense (intermediate 18,432), the other 58 with 256 routed experts of width 2,048
  and 1 shared expert, 8 routed a token within at most 4 of 8 groups, sigmoid scores normalised over the
  chosen experts and scaled by 2.5; vocabulary 129,280, RoPE base 10,000, RMSNorm eps 1e-6, untied head.
  (YaRN is the later long-context stage's, not pre-training's: no rope scaling here.)
- balancing (sections 2.1.2, 4.2): the bias that only selects, moved by 0.001 a step (the report's gamma for
  the first 14.3T tokens), and the sequence-wise balance loss at 0.0001.
- multi-token prediction (sections 2.2, 4.2): depth 1, its loss weighted 0.3 (the first 10T tokens).
- batch (section 4.2): sequences of 4,096, the batch ramped to 15,360 sequences; here its end, 15,360.
- optimizer (section 4.2): AdamW, beta1 0.9, beta2 0.95, weight decay 0.1, peak learning rate 2.2e-4 after
  2,000 warm-up steps, gradient clipping at 1.0 (the report's schedule holds the peak for 10T tokens and then
  decays it in steps; this config's cosine decays to 0.1 x over the run, 14.8T tokens / 63M a step).
- layout (section 3.2): 2,048 GPUs as 16 pipeline stages x 64-way expert parallelism (8 nodes) x ZeRO-1 data
  parallelism, no tensor parallelism. Here `stage` 16, `expert` 64 (the routed tokens' ragged all-to-all,
  the experts 4 a device), `fsdp` 2 (-1: what remains), `train.zero_stage` 1: the data-parallel size is
  expert x fsdp = 128, micro-batches of one sequence, 15,360 / 128 = 120 of them a step.
- stages: the 58 MoE layers as 0 + 14 x 4 + 2 (`pipeline.layers_per_stage`): stage 0 runs the embedding and
  the 3 dense layers (as wide as 4 MoE layers' expert GEMMs: 9 x 2,048 = 18,432), the last stage 2 MoE layers,
  the multi-token prediction block and two heads; in lock-step ticks this split modeled 5% faster than
  1 + 14 x 4 + 1 (docs/moe.md).
- schedule: DeepSeek-V3 trained with DualPipe, which meshtrain does not run (docs/pipeline.md); of those it
  runs, zero bubble (ZB-H1) with the weight GEMMs split off and each transfer beside the next tick's compute.
The Pallas kernels in the MoE stages (the grouped matmul, the flash kernel for head dims 192 / 128; `auto`
keeps both out of pipeline stages), full recomputation; the report's FP8 matmuls are not this config (bf16).
The H100 compile for 2,048 devices (kernel model, jax 0.10.2): peak 73.43 GiB a device, 18.0% modeled MFU
(docs/moe.md, "At real size": short of the 35% acceptance point).
"""

from meshtrain.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/deepseek_v3_671b"
    c.cpu_devices = 0
    c.steps = 235_000  # 14.8T tokens / (15,360 x 4,096) a step
    c.log_every = 10
    c.model.vocab_size = 129280
    c.model.d_model = 7168
    c.model.n_layers = 61
    c.model.n_heads = 128
    c.model.n_kv_heads = 128  # latent attention expands a key and a value per head
    c.model.head_dim = 192  # qk_nope_head_dim 128 + qk_rope_head_dim 64
    c.model.q_lora_rank = 1536
    c.model.kv_lora_rank = 512
    c.model.qk_rope_head_dim = 64
    c.model.v_head_dim = 128
    c.model.rope_theta = 10000.0
    c.model.norm_eps = 1e-6
    c.model.mlp_dim = 18432  # the dense first layers' width
    c.model.first_dense_layers = 3
    c.model.num_experts = 256
    c.model.experts_per_token = 8
    c.model.moe_every = 1
    c.model.moe_mlp_dim = 2048
    c.model.shared_expert = True
    c.model.moe_dropless = True
    c.model.moe_matmul = "pallas"  # the grouped matmul kernel in the stages (auto keeps ragged_dot there)
    c.model.moe_exchange_factor = 2.0  # a device takes up to twice its balanced load (the rest is dropped, counted)
    c.model.moe_router = "sigmoid"
    c.model.moe_router_bias = True
    c.model.moe_bias_rate = 0.001
    c.model.moe_groups = 8
    c.model.moe_topk_groups = 4
    c.model.moe_routed_scale = 2.5
    c.model.moe_balance_scope = "sequence"
    c.model.aux_loss_weight = 0.0001
    c.model.router_z_loss_weight = 0.0
    c.model.mtp_depth = 1
    c.model.mtp_loss_weight = 0.3
    c.train.seq_len = 4096
    c.train.batch_size = 15360
    c.train.learning_rate = 2.2e-4
    c.train.min_lr_ratio = 0.1
    c.train.warmup_steps = 2000
    c.train.b2 = 0.95
    c.train.weight_decay = 0.1
    c.train.grad_clip = 1.0
    c.train.zero_stage = 1
    c.remat.policy = "full"
    c.attention.impl = "pallas"  # the flash kernel (head dims 192 / 128) in the MoE stages (auto keeps einsum there)
    c.pipeline.schedule = "zero_bubble"
    c.pipeline.microbatches = 120
    c.pipeline.overlap_transfers = True
    c.pipeline.layers_per_stage = (0,) + (4,) * 14 + (2,)
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.expert = 64
    c.mesh.stage = 16
    return c
