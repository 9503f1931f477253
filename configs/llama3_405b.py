"""Llama 3 405B (real shapes) in the layout it was trained with: for the planner and ahead-of-time
compilation (`python -m meshtrain.aot --config configs/llama3_405b.py --target h100 --devices 16384`),
not for a CPU run (the CPU tests cut its layers and widths).

Where each number comes from ("The Llama 3 Herd of Models", 2024):
- shapes (Table 3): 126 layers, model dimension 16,384, FFN dimension 53,248, 128 attention heads,
  8 key/value heads, vocabulary 128,000 (128,256 with the special tokens, as released), RoPE base
  500,000; pre-training sequences of 8,192 tokens (the long-context stage that adds the Llama 3.1
  RoPE scaling comes later and is not this config).
- layout (Section 3.3.2, Table 4): 16,384 H100s as TP 8 x PP 16 x DP 128, tensor parallel inside an
  8-GPU node, sequence parallel with it, the pipeline across nodes, and the first and the last stage
  one layer fewer (they also run the embedding, and the output head and the loss over the vocabulary:
  126 = 7 + 14 x 8 + 7, `pipeline.layers_per_stage`'s default for 126 on 16).
- batch (Section 3.4.1): 16M tokens a step at the end of the ramp, 2,048 sequences of 8,192; micro-batch
  1 per data-parallel rank, so 2,048 / 128 = 16 micro-batches per step.
- schedule (Section 3.3.2): interleaved 1F1B, as the paper's; here in 8 chunks a stage with each
  transfer beside the next tick's compute (126 layers as 128 chunks of one, the first and the last
  empty, so the first and the last stage again hold 7). The H100 compile's step by the kernel model:
  43.2% MFU (41.5% before the empty chunks were priced as skipped; then under full remat 40.8%, and 36.5% in
  4 chunks, 16.9% under 1F1B: docs/405b.md).
- optimizer (Section 3.4.1): peak learning rate 8e-5, 8,000 warm-up steps, cosine decay to 8e-7 over
  1,200,000 steps.
- checkpoints: the intervals that maximise modeled goodput with both tiers (`python -m meshtrain.plan
  --config configs/llama3_405b.py --devices 16384 --goodput`: the paper's failure rate, one interruption
  every 3.09 h, and its file system's 2 TB/s): a local-tier save every 2 steps (14 s; each blocks the step
  10.6 ms: its device-to-host copy and the exchange with the peer) and a persistent one every 392 (46 min):
  96.91% at a 300 s restart. The persistent tier alone, every 2 steps, models the same at Llama 3's 2 TB/s;
  below 55.6 GB/s of persistent bandwidth only the two tiers keep 95%.
The data-parallel axis is `fsdp` (-1: 128 on 16,384 devices) with ZeRO-1 (optimizer state sharded),
each layer's q, k, v, attention output and mid-layer residual kept for the backward, which reruns only
the MLP's gate + up matmul (`remat.policy=attention`; `full` fits with 12.5 GiB more to spare, 0.7 points
slower), attention and the norms and loss in the Pallas kernels on GPU: what fits the H100's 80 GB
(docs/405b.md).
"""

from meshtrain.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/llama3_405b"
    c.cpu_devices = 0
    c.steps = 1_200_000
    c.model.vocab_size = 128256
    c.model.d_model = 16384
    c.model.n_layers = 126
    c.model.n_heads = 128
    c.model.n_kv_heads = 8
    c.model.head_dim = 128
    c.model.mlp_dim = 53248
    c.model.rope_theta = 500000.0
    c.model.sequence_parallel = True
    c.model.fused_norm = True
    c.model.fused_loss = True
    c.attention.impl = "pallas"
    c.train.seq_len = 8192
    c.train.batch_size = 2048
    c.train.learning_rate = 8e-5
    c.train.min_lr_ratio = 0.01  # cosine to 8e-7
    c.train.warmup_steps = 8000
    c.train.zero_stage = 1
    # XLA:GPU's scheduler budgets (80% of HBM - inputs and outputs) x 95% = 40.5 GiB for the step's temporaries
    # and then starts fewer sequence-parallel gathers early: at that default, 12 of the 1,449 gathers a step
    # runs have compute beside them (37.6% MFU); 400 lifts the budget: 1,321 (41.5%), at 68.08 GiB against 67.85.
    c.train.xla_gpu_memory_limit_slop_factor = 400
    c.remat.policy = "attention"
    c.checkpoint.every = 392
    c.checkpoint.local_every = 2
    c.pipeline.schedule = "interleaved_1f1b"
    c.pipeline.repeats = 8
    c.pipeline.overlap_transfers = True
    c.pipeline.microbatches = 16
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 8
    c.mesh.stage = 16
    return c
