"""The config schema and its defaults: every key a run understands. A leaf: it imports no other
meshtrain module.

Every field has a default here; `configs/*.py` override a few and the command line
overrides any (`--config.mesh.tensor=2`). The rules live beside the code they protect, each
part's under the name `validate_config(config, sizes)`; this file holds the rules of its own
generic fields (choices, positive integers, shape divisibility) and `require`, the helper every
part raises through. `meshtrain.validate` gathers them all; they run before anything is traced
or compiled and raise one `ConfigError` naming the key, the value and the rule it broke.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os

import ml_collections


class Axis(enum.StrEnum):
    """The six mesh axes: the only place their names are spelled (`config.mesh.<axis>`)."""

    DATA = "data"
    FSDP = "fsdp"
    TENSOR = "tensor"
    SEQUENCE = "sequence"
    EXPERT = "expert"
    STAGE = "stage"


MESH_AXES: tuple[str, ...] = tuple(a.value for a in Axis)
# The axes that split the batch (outside MoE layers `expert` is one more data-parallel axis), in
# mesh order; `sharding_rules.RULES["batch"]` maps the logical batch dimension to them.
BATCH_AXES: tuple[str, ...] = (Axis.DATA.value, Axis.FSDP.value, Axis.EXPERT.value)
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "selective", "attention", "full", "offload")
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "pallas", "ring", "ulysses")
SCORES_DTYPES = ("float32", "compute")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # model.family: what `hf export` writes (mixtral with experts)
CONTEXT_PARALLEL_IMPLS = ("ring", "ulysses")  # the implementations that split the sequence over `sequence`
# `pipeline.schedule`'s choices: the names of `parallel.schedules.REGISTRY`, which defines each (the config
# imports nothing of meshtrain; tests/test_schedules.py checks the two agree)
PIPELINE_SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble")
DEFAULT_SCHEDULE = PIPELINE_SCHEDULES[0]  # `pipeline.schedule`'s default
BALANCE_SCOPES = ("batch", "sequence")
MOE_ROUTERS = ("softmax", "sigmoid")
MATMUL_PRECISIONS = ("bf16", "fp8")  # bf16: matmuls in model.dtype; fp8: e4m3 / e5m2 operands (fp8.py)


def cudnn_refusal(config: ml_collections.ConfigDict) -> tuple[str, object, str] | None:
    """Why cuDNN's fused attention cannot serve `config`'s model, as (key, value, rule), or None.

    cuDNN's flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`) takes bf16 or
    fp16 operands, head dims that are multiples of 8 up to 128 (256 on Hopper, but JAX checks against
    128 where it cannot see the GPU, as in an ahead-of-time compile), and an even sequence length
    when a mask is given (the document mask). Sliding windows stay the einsum path's. Its calls
    declare no variance inside a `shard_map` (as a Pallas kernel: `parallel.layout.uses_kernels`), so
    no MoE layer may share a pipeline stage with them.
    """
    m = config.model
    if m.dtype not in ("bfloat16", "float16"):
        return "model.dtype", m.dtype, "cuDNN's fused attention takes bfloat16 or float16 operands"
    if m.head_dim % 8 or m.head_dim > 128:
        return "model.head_dim", m.head_dim, "cuDNN's fused attention needs a multiple of 8 up to 128"
    if config.train.seq_len % 2:
        return "train.seq_len", config.train.seq_len, "cuDNN's masked (document) attention needs an even length"
    if m.sliding_window:
        return "model.sliding_window", m.sliding_window, "sliding-window attention runs in the einsum attention only"
    if m.v_head_dim and m.v_head_dim != m.head_dim:
        return ("model.v_head_dim", m.v_head_dim, f"cuDNN's call here takes one head width (model.head_dim="
                f"{m.head_dim}): the values would be padded to it")
    if m.num_experts and int(config.mesh.stage) != 1:
        return ("model.num_experts", m.num_experts, "cuDNN's attention is not run in an MoE pipeline stage (its "
                "calls declare no variance, as a Pallas kernel: the stage loop would go unchecked, which only the "
                "slot-table schedules take and which is tested with the Pallas kernels alone): use "
                "attention.impl='pallas' there")
    return None


# `attention.impl=auto` picks cuDNN for head dims from here up: the ones it was run, tested and timed at
# on a GPU (64 and 128: tests/test_cudnn_attention.py, bench/kernels.py). `cudnn` itself takes any
# multiple of 8 up to 128.
AUTO_CUDNN_MIN_HEAD_DIM = 64


def attention_impl(config: ml_collections.ConfigDict, platform: str) -> str:
    """`attention.impl` as a step on `platform`'s devices ('cpu', 'gpu', 'tpu') runs it: 'auto' becomes
    'cudnn' on a GPU where cuDNN serves the model (`cudnn_refusal`) at a head dim of at least
    AUTO_CUDNN_MIN_HEAD_DIM, 'pallas' for multi-head latent attention there (`_flash_serves_latent`),
    else 'xla'; any other value is itself. The Pallas flash kernel is not
    an automatic choice: measured on an H200 it was slower than cuDNN (docs/benchmarks.md, "GPU")."""
    impl = config.attention.impl
    if impl != "auto":
        return impl
    serves = cudnn_refusal(config) is None and config.model.head_dim >= AUTO_CUDNN_MIN_HEAD_DIM
    if platform == "gpu" and serves:
        return "cudnn"
    return "pallas" if platform == "gpu" and _flash_serves_latent(config) else "xla"


def _flash_serves_latent(config: ml_collections.ConfigDict) -> bool:
    """Whether `attention.impl=auto` takes the Pallas flash kernel for multi-head latent attention on a GPU,
    whose head widths cuDNN refuses (a query / key head of 192 against values of 128 in DeepSeek-V3): the
    einsum attention writes [B, H, T, T] scores, so the kernel model prices DeepSeek-V3's step shorter with
    the flash kernel (docs/moe.md). Not where the kernel cannot go:
    float32, a sliding window, an MoE pipeline stage (whose loop the automatic choices keep type-checked; the
    slot-table schedules take the kernels there when `attention.impl='pallas'` is set)."""
    m = config.model
    return bool(m.kv_lora_rank and m.dtype in ("bfloat16", "float16") and not m.sliding_window
                and not (m.num_experts and int(config.mesh.stage) != 1))


MOE_MATMULS = ("auto", "ragged_dot", "pallas")
MOE_EXCHANGES = ("auto", "all_to_all", "ragged")
MOE_FSDP = ("auto", "experts", "weights")


def moe_matmul(config: ml_collections.ConfigDict, platform: str) -> str:
    """`model.moe_matmul` as a step on `platform`'s devices runs it: 'auto' becomes 'pallas' (the grouped
    matmul kernel, `pallas_kernels/grouped_matmul.py`) on a GPU where it serves (no FP8: the expert
    matmuls' FP8 form is ragged_dot's; no pipeline stage: there a `pallas_call` makes the stage loop
    unchecked, which the slot-table schedules alone take: set 'pallas' for them), else 'ragged_dot'."""
    impl = config.model.moe_matmul
    if impl != "auto":
        return impl
    serves = config.model.matmul_precision != "fp8" and int(config.mesh.stage) == 1
    return "pallas" if platform == "gpu" and serves else "ragged_dot"


def moe_exchange(config: ml_collections.ConfigDict, platform: str) -> str:
    """`model.moe_exchange` as run: 'auto' becomes 'ragged' on a GPU (XLA:GPU's ragged all-to-all),
    'all_to_all' elsewhere (XLA:CPU has no ragged all-to-all)."""
    impl = config.model.moe_exchange
    if impl != "auto":
        return impl
    return "ragged" if platform == "gpu" else "all_to_all"


def moe_chunks(config: ml_collections.ConfigDict, platform: str) -> int:
    """`model.moe_chunks` as run: 'auto' (0) stays 0 on a GPU, where the layer makes it 2 under expert
    parallelism (one chunk's exchange beside the other's matmuls; `moe_dropless.chunks_for`), else 1;
    elsewhere 1."""
    chunks = int(config.model.moe_chunks)
    return chunks if chunks or platform == "gpu" else 1


def default_config() -> ml_collections.ConfigDict:
    """Every key a run understands, with its default.

    Long by design: the schema is one statement per key, read top to bottom, section by section.
    """
    c = ml_collections.ConfigDict()
    c.seed = 0  # parameter initialisation and data order
    c.steps = 100  # optimizer steps of the run
    c.workdir = "runs/default"  # checkpoints, metrics.jsonl, the run record; a run resumes from it
    c.cpu_devices = 8  # fake this many devices when the platform is CPU (0: leave JAX's default)
    c.log_every = 10  # steps between lines of metrics (stdout and metrics.jsonl)
    c.eval_every = 0  # 0: no evaluation
    c.eval_batches = 4  # validation batches at each evaluation
    c.eval_tasks = ""  # lm-eval tasks also run at each evaluation, comma-separated (needs lm-eval: evaluate.py)
    c.eval_tasks_include_path = ""  # a folder of lm-eval task YAMLs of your own
    c.eval_tasks_limit = 0  # documents per task at each evaluation (0: all)
    c.sample_every = 0  # 0: off; else the model continues `sample_prompt` every this many steps (generate.py)
    c.sample_prompt = "def "  # the text `sample_every` continues
    c.sample_max_new_tokens = 48  # tokens each sample adds
    c.sample_temperature = 0.8  # 0: greedy
    c.sample_top_k = 40  # 0: every token
    c.explain = False  # print the parameter sharding table and exit

    c.mesh = ml_collections.ConfigDict()
    for axis in MESH_AXES:  # one may be -1: filled with the remaining devices
        setattr(c.mesh, axis, 1)
    c.mesh.data = -1
    for axis in MESH_AXES:  # cross-node (DCN) part of each axis; the product is the node count
        setattr(c.mesh, f"dcn_{axis}", 1)

    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator_address = ""  # "host:port"; empty: auto-detect (SLURM, cloud) or single process
    c.distributed.num_processes = 0  # with coordinator_address: processes in the job (0: auto-detect)
    c.distributed.process_id = -1  # with coordinator_address: this process's index (-1: auto-detect)

    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 512  # token ids the embedding and head hold (padded up to a multiple of mesh.tensor)
    c.model.d_model = 128  # hidden width
    c.model.n_layers = 4  # transformer blocks
    c.model.n_heads = 8  # query heads
    c.model.n_kv_heads = 4  # key/value heads (grouped-query attention: divides n_heads)
    c.model.head_dim = 16  # width of each attention head
    c.model.mlp_dim = 384  # SwiGLU hidden width
    c.model.rope_theta = 10000.0  # RoPE base frequency
    # RoPE frequency scaling for long contexts: "none", "linear" (positions / rope_factor), "llama3"
    # (Llama 3.1: low frequencies / rope_factor, high ones kept, smoothed between rope_low_freq_factor and
    # rope_high_freq_factor of rope_original_max_positions) or "yarn" (YaRN as DeepSeek-V3 sets it: frequencies
    # interpolated between rope_beta_fast and rope_beta_slow rotations, cos / sin and the scores scaled)
    c.model.rope_scaling = "none"
    c.model.rope_factor = 1.0  # rope_scaling's factor (context extension)
    # llama3 scaling: wavelengths above rope_original_max_positions / this are divided by rope_factor
    c.model.rope_low_freq_factor = 1.0
    c.model.rope_high_freq_factor = 4.0  # llama3 scaling: wavelengths below rope_original_max_positions / this are kept
    c.model.rope_original_max_positions = 8192  # llama3 / yarn scaling: the context the model was trained at
    c.model.rope_beta_fast = 32.0  # yarn: frequencies turning more than this often in that context are kept
    c.model.rope_beta_slow = 1.0  # yarn: frequencies turning less than this often are divided by rope_factor
    # yarn: cos and sin times (0.1 m ln(rope_factor) + 1) for m = rope_mscale, over the same for m =
    # rope_mscale_all_dim where that is > 0; and then the attention scores times the latter squared
    c.model.rope_mscale = 1.0
    c.model.rope_mscale_all_dim = 0.0
    # the Hugging Face architecture an export writes: llama, mistral, qwen2, qwen3 (mixtral with experts)
    c.model.family = "llama"
    c.model.attention_bias = False  # biases on the q, k, v projections (Qwen2)
    c.model.qk_norm = False  # RMSNorm of each query and key head before RoPE (Qwen3)
    c.model.sliding_window = 0  # attend to at most this many tokens back (Mistral v0.1); 0: the whole context
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) when kv_lora_rank > 0: keys and values expanded
    # from one latent of this width a token (with its RMSNorm), what sampling caches; head_dim is the query /
    # key head width, qk_rope_head_dim of it the RoPE part (one key part shared by all heads)
    c.model.kv_lora_rank = 0
    c.model.q_lora_rank = 0  # with MLA: the queries through a latent of this width too (0: projected directly)
    c.model.qk_rope_head_dim = 0  # with MLA: the RoPE part of head_dim (even, less than head_dim)
    c.model.v_head_dim = 0  # the value head width (0: head_dim)
    c.model.norm_eps = 1e-5  # RMSNorm epsilon
    c.model.tie_embeddings = False  # the head is the embedding's transpose
    c.model.init_std = 0.02  # standard deviation of the normal initialisation
    c.model.dtype = "bfloat16"  # compute dtype
    c.model.param_dtype = "float32"  # storage dtype of parameters and optimizer state
    c.model.sequence_parallel = False  # Megatron SP: norm/residual regions split over `tensor`
    # with sequence_parallel: SP's gathers / scatters in pieces beside the matmuls (collective_matmul.py)
    c.model.collective_matmul = False
    c.model.fused_norm = False  # Pallas RMSNorm
    c.model.fused_loss = False  # Pallas output projection + cross-entropy
    # "fp8": the attention projections and MLP matmuls on e4m3 operands, e5m2 gradients (fp8.py);
    # "bf16": every matmul in model.dtype
    c.model.matmul_precision = "bf16"
    c.model.fp8_history = 16  # steps of amax history behind each FP8 scale (delayed scaling)
    # Mixture of experts (num_experts == 0: dense model).
    c.model.num_experts = 0  # experts per MoE layer (0: a dense model)
    c.model.experts_per_token = 2  # experts each token is routed to (top-k)
    # the k chosen experts' weights renormalised to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob); False: their
    # softmax probabilities over all experts as they are
    c.model.moe_norm_topk = True
    # the router's scores: softmax over the experts (Mixtral, Qwen3-MoE), or sigmoid each (DeepSeek-V3, Kimi K2;
    # their share of a token's sum is the probability the balance loss reads)
    c.model.moe_router = "softmax"
    c.model.moe_routed_scale = 1.0  # the chosen experts' weights times this (DeepSeek-V3's routed_scaling_factor)
    # a per-expert bias added to the scores for the choice only (DeepSeek-V3's auxiliary-loss-free balancing,
    # e_score_correction_bias): kept with the parameters, moved by the step, not by the gradient
    c.model.moe_router_bias = False
    # after each step every expert's bias moves by this toward balance: up for an expert that took fewer
    # tokens than the mean, down for one that took more (DeepSeek-V3's gamma; 0: frozen)
    c.model.moe_bias_rate = 0.001
    # group-limited routing (DeepSeek-V3's n_group / topk_group): the experts in this many equal groups, each
    # token choosing its top-k among the moe_topk_groups groups with the highest sum of their two best scores
    c.model.moe_groups = 1
    c.model.moe_topk_groups = 0  # 0: every group
    c.model.moe_every = 1  # every this many layers is an MoE layer (divides n_layers - first_dense_layers)
    # the first this many layers dense (model.mlp_dim wide), before the MoE layers (DeepSeek-V3's
    # first_k_dense_replace)
    c.model.first_dense_layers = 0
    # multi-token prediction (DeepSeek-V3): 1 adds one block predicting the token after next from the final
    # hidden state and the next token's embedding, sharing the embedding and the head; 0: none
    c.model.mtp_depth = 0
    c.model.mtp_loss_weight = 0.3  # its cross-entropy's weight in the training objective (DeepSeek-V3: 0.3, then 0.1)
    # tokens an expert takes per step, as a multiple of an even share (excess tokens are dropped)
    c.model.capacity_factor = 1.25
    c.model.moe_dropless = False  # no capacity: every routed token is computed (grouped expert matmuls)
    # dropless expert matmuls: auto (the Pallas grouped matmul on a GPU where it serves: no FP8, no pipeline
    # stage; else ragged_dot), ragged_dot (jax.lax.ragged_dot), pallas (the grouped matmul kernel)
    c.model.moe_matmul = "auto"
    # dropless token exchange over mesh.expert: auto (ragged on a GPU, else all_to_all), ragged
    # (jax.lax.ragged_all_to_all: each routed row once; GPU only), all_to_all (a buffer per destination)
    c.model.moe_exchange = "auto"
    # rows a device takes from the dropless exchange, as a multiple of its balanced load (tokens x k); rows
    # past it are dropped and counted (moe_dropped_fraction); 0: the worst case, which never drops
    c.model.moe_exchange_factor = 0.0
    # slices of a device's tokens routed and exchanged one after another, so that one slice's exchange
    # runs beside another's expert matmuls; 0: auto (2 on a GPU where the tokens travel: mesh.expert, or mesh.fsdp
    # under model.moe_fsdp's experts; else 1)
    c.model.moe_chunks = 0
    # the expert weights under mesh.fsdp: experts (each fsdp x expert device owns num_experts / (mesh.expert x
    # mesh.fsdp) whole experts and the routed tokens travel to them: expert parallelism over fsdp too), weights
    # (ZeRO shards every expert's model dimension over fsdp, gathered where used), auto (experts for dropless
    # MoE where the experts divide that way, else weights)
    c.model.moe_fsdp = "auto"
    c.model.moe_mlp_dim = 0  # 0: same as mlp_dim
    c.model.shared_expert = False  # one expert every token also runs (DeepSeek-style)
    # the shared expert's hidden width; 0: moe_mlp_dim (DeepSeek-V3's n_shared_experts x moe_intermediate_size)
    c.model.shared_expert_dim = 0
    c.model.aux_loss_weight = 0.01  # weight of the load-balancing loss
    c.model.moe_balance_scope = "batch"  # "batch" (Switch, over all tokens) or "sequence" (per row, DeepSeek-V3)
    c.model.router_z_loss_weight = 0.001  # weight of the router z-loss (keeps router logits small)

    c.attention = ml_collections.ConfigDict()
    # auto: cuDNN's fused attention on an NVIDIA GPU where it serves the model (bf16 / fp16, head_dim 64
    # to 128 and a multiple of 8, no sliding window), else einsum (`config.attention_impl`); xla: einsum;
    # cudnn: cuDNN's fused attention (GPU only); pallas: the Pallas flash kernel; ring / ulysses: context
    # parallelism over mesh.sequence
    c.attention.impl = "auto"
    c.attention.zigzag = True  # ring attention: zig-zag load balancing of the causal work
    # the einsum attention's scores (impl xla, and auto where it resolves to xla): float32, or compute
    # (model.dtype: in bf16 the [B,K,T,G,S] scores take half the bytes; the softmax still accumulates
    # in float32). docs/aot.md: the modeled step of each
    c.attention.scores_dtype = "float32"
    # attention.impl='ulysses': devices of mesh.sequence per all-to-all group; 0 = all of them. A divisor
    # U < mesh.sequence runs a ring across the mesh.sequence / U groups (ring x Ulysses)
    c.attention.ulysses_degree = 0
    # cuDNN's attention on a Hopper or later GPU: rows of up to this many runs of segment ids (documents, the
    # padding at a row's end one more) take its packed call, work proportional to the documents' squares; rows
    # of more take the document-masked fallback (the Pallas flash kernel from head dim 128, else a bias)
    c.attention.max_documents = 32

    c.remat = ml_collections.ConfigDict()
    # recomputation in the backward: none (a dense pipeline stage still remakes its dtype and layout copies,
    # its weights' bf16 copies among them), selective (keep matmul outputs), attention (keep q, k, v, the
    # attention's output and the mid-layer residual: rebuild the MLP's gate + up), full, offload (to host memory)
    c.remat.policy = "selective"

    c.train = ml_collections.ConfigDict()
    c.train.batch_size = 16  # global rows per optimizer step
    c.train.seq_len = 128  # tokens per row
    c.train.grad_accum_steps = 1  # micro-batches per step
    c.train.zero_stage = 1  # ZeRO: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters sharded over the batch axes
    c.train.learning_rate = 3e-3  # peak learning rate (AdamW)
    c.train.warmup_steps = 10  # linear warm-up steps before the cosine decay
    c.train.min_lr_ratio = 0.1  # the cosine decay ends at learning_rate x this
    c.train.weight_decay = 0.1  # AdamW's decoupled weight decay
    c.train.b1 = 0.9  # Adam's first-moment decay
    c.train.b2 = 0.95  # Adam's second-moment decay
    c.train.eps = 1e-8  # Adam's epsilon
    c.train.grad_clip = 1.0  # global-norm clip; 0 disables
    c.train.skip_nonfinite = False  # a step whose loss or gradients are not finite leaves the state unchanged
    # loss-spike guard (off at 0): spike_steps losses in a row above spike_factor x the running median of the
    # last spike_window roll back to the newest older checkpoint and skip those steps' data rows
    c.train.spike_factor = 0.0
    c.train.spike_steps = 3  # loss-spike guard: losses in a row above the threshold before a rollback
    c.train.spike_window = 32  # loss-spike guard: steps in the running median
    c.train.spike_max_rollbacks = 3  # loss-spike guard: rollbacks before the run stops
    # multi-process: a step or save with no progress this long ends the job (exit 5); below jax.distributed's
    # 100-s heartbeat timeout, whose abort of a job with a stopped peer says far less; 0: off
    c.train.hang_timeout_s = 90.0
    # JAX's persistent compile cache, which a restart reads its compiled step back from (a folder every host
    # can share: entries are written whole, by rename): "" the per-user folder (compile_cache.cache_dir()/jax,
    # or JAX_COMPILATION_CACHE_DIR where set); "off" compiles every time
    c.train.compile_cache_dir = ""
    # multi-process: every straggler_every steps the processes share the time they take to get a step's batch;
    # one above straggler_factor x the others' median is named in the log (process, host); 0: off
    c.train.straggler_every = 100
    c.train.straggler_factor = 1.5
    # XLA:GPU's latency-hiding scheduler budgets (80% of HBM - inputs - non-aliased outputs) x this / 100 for the
    # step's temporaries; above the budget it schedules to save memory and starts no collective early
    # (mesh.py). XLA's default 95; the compiled peak is what must fit (`meshtrain.aot` checks it).
    c.train.xla_gpu_memory_limit_slop_factor = 95

    c.data = ml_collections.ConfigDict()
    # text_files (data.files, or the Python standard library's sources), tfds:<name>, hf:<folder or glob>, synthetic
    c.data.source = "text_files"
    c.data.files = ""  # text_files: a glob of local files (empty: the Python standard library's sources)
    c.data.tokenizer = "bytes"  # bytes, a Hugging Face folder or tokenizer.json, or a sentencepiece .model
    c.data.data_dir = ""  # where datasets are prepared and read (empty: $TFDS_DATA_DIR, else <workdir>/datasets)
    c.data.text_field = "text"  # the text column of JSON lines and Hugging Face datasets
    # a binary or non-UTF-8 file, or a JSON line without a string text: "skip" (by name, counted: the run prints
    # the counts and metrics.jsonl's first record keeps them) or "error" (the first one stops the run)
    c.data.on_bad_data = "skip"
    c.data.cross_document_attention = False  # packed rows attend across document boundaries (off: a document mask)
    c.data.prefetch = 2  # batches the loader prepares ahead

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 0  # 0: only at the end
    c.checkpoint.keep = 2  # newest checkpoints kept
    c.checkpoint.async_save = True  # save in the background while training goes on
    # the local tier (meshtrain/local_tier.py): every local_every steps (0: off) each process's shards, and a
    # copy of its peer process's, in host-local storage; a restart takes the newest step complete there when
    # it is not older than the persistent tier's. local_dir "": host memory (/dev/shm/meshtrain-local-<uid>/<hash
    # of the workdir>), else the temporary folder; one folder per host, not shared
    c.checkpoint.local_every = 0
    c.checkpoint.local_dir = ""
    c.checkpoint.restore_from = ""  # a checkpoint folder to start from (else the workdir's newest)
    # a workdir whose checkpoints were all found damaged (and set aside) refuses to start over unless this is True
    c.checkpoint.restart_from_scratch = False
    # a checkpoint without checksums (a save killed before writing them) is restored only when this is True
    c.checkpoint.trust_unverified = False

    c.pipeline = ml_collections.ConfigDict()
    c.pipeline.schedule = DEFAULT_SCHEDULE  # gpipe, circular, 1f1b, interleaved_1f1b or zero_bubble (mesh.stage > 1)
    c.pipeline.microbatches = 4  # micro-batches each step's batch is cut into on the pipeline
    c.pipeline.repeats = 1  # circular / interleaved_1f1b: layer chunks per stage (virtual stages)
    # zero_bubble's W: "gemms" (the weight GEMMs from each matmul's kept input and
    # output gradient: W about one forward, more memory) or "pullback" (the stage's pullback again from
    # its residuals: 1F1B's memory, W about two forwards)
    c.pipeline.split_backward = "gemms"
    # zero_bubble with split_backward "gemms": W runs as this many operations, each the
    # weight GEMMs of a slice of the chunk's layers, so that a W tick lasts about as long as an F or B tick
    # (W reads and writes the float32 gradient sums: about two forwards on micro-batches of a few hundred
    # tokens, one on thousands); `bench/pipeline.py --modeled` prints the count the cost model picks
    c.pipeline.weight_parts = 1
    # zero_bubble (gemms) with overlap_transfers, where B hands W its records in the same loop step: each W
    # computes the weight gradients of this many micro-batches, the B's of one round of the loop (F, B, F, B,
    # then W's parts), reading and writing the float32 gradient sums once for them all; each record is held
    # until its round's W, one more than with 1. 2 is faster where W is bound by those sums (micro-batches
    # of a few hundred tokens) and costs a record (llama3_8b on 4 stages, jax 0.10.2: -0.5 to +1.3 GiB, 2%
    # faster; jax 0.12: +1.5 GiB, 0.3%; 405B zero bubble on 16 stages: 67.73 -> 83.97 GiB, over an H100);
    # `bench/pipeline.py --modeled` prints the span the model picks. The other tables run each W on its own
    c.pipeline.weight_span = 1
    # 1f1b, interleaved_1f1b, zero_bubble: send each tick's activations and gradients while the next tick
    # computes (they are read a tick later), so no transfer waits on the critical path; the price is a hop of
    # two ticks per stage: a deeper warm-up, more micro-batches in flight (1f1b: 2(p - s) - 1 on stage s);
    # interleaved_1f1b's ticks alternate forwards and backwards, its results are read two ticks on anyway: free;
    # zero_bubble (gemms) then runs each W in its B's loop step, handed B's records (pipeline.weight_span):
    # 1F1B's temporaries within one record (docs/pipeline.md)
    c.pipeline.overlap_transfers = False
    # layers of each stage, first to last (sum model.n_layers; multiples of model.moe_every under MoE), for a
    # pipeline of uneven stages; with pipeline.repeats = v > 1 chunks a stage (interleaved_1f1b, circular), of
    # each chunk in execution order (mesh.stage*v entries, chunk r of stage s at r*mesh.stage + s); () splits
    # evenly, or, when the stages (chunks) do not divide the layers, gives one layer fewer to the first and the
    # last (they also run the embedding and the head), then to the second and the second to last, ... (Llama 3
    # 405B: 126 layers on 16 stages, 7 + 14 x 8 + 7; in 2 chunks a stage, 3 + 30 x 4 + 3)
    c.pipeline.layers_per_stage = ()

    c.profile = ml_collections.ConfigDict()
    c.profile.steps = (0, 0)  # (first, last) step traced by jax.profiler into <workdir>/profile; (0, 0): off

    c.init = ml_collections.ConfigDict()
    c.init.from_hf = ""  # a Hugging Face Llama/Mistral/Mixtral folder: its weights (and shape) start the run
    return c


# ---------------------------------------------------------------------------------------------
# Validation. Each rule raises ConfigError(key, value, rule); all run before tracing.
# ---------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A config value broke a rule. The message names the key, the value and the rule."""

    def __init__(self, key: str, value, rule: str):
        self.key, self.value, self.rule = key, value, rule
        super().__init__(f"config.{key}={value!r}: {rule}")


def require(ok: bool, key: str, value, rule: str) -> None:
    """Raises ConfigError(key, value, rule) unless `ok`."""
    if not ok:
        raise ConfigError(key, value, rule)


def mesh_shape(config: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """The six axis sizes with a -1 filled in; raises ConfigError if they cannot fill `num_devices`."""
    sizes = {axis: int(config.mesh[axis]) for axis in MESH_AXES}
    fill = [axis for axis, size in sizes.items() if size == -1]
    require(len(fill) <= 1, f"mesh.{fill[-1] if fill else ''}", -1,
             f"at most one mesh axis may be -1 (fill); got -1 for {fill}")
    for axis, size in sizes.items():
        require(size == -1 or size >= 1, f"mesh.{axis}", size, "mesh axis sizes must be >= 1 (or -1 to fill)")
    known = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        require(num_devices % known == 0, f"mesh.{fill[0]}", -1,
                 f"cannot fill: the other axes multiply to {known}, which does not divide {num_devices} devices")
        sizes[fill[0]] = num_devices // known
    product = math.prod(sizes.values())
    require(product == num_devices, "mesh", dict(sizes),
             f"the mesh axes multiply to {product} but there are {num_devices} devices")
    for axis in MESH_AXES:
        dcn = int(config.mesh[f"dcn_{axis}"])
        require(dcn >= 1 and sizes[axis] % dcn == 0, f"mesh.dcn_{axis}", dcn,
                 f"the cross-node part must be >= 1 and divide mesh.{axis}={sizes[axis]}")
    return sizes


def data_parallel_size(sizes: dict[str, int]) -> int:
    """Number of ways the batch is split: the product of the BATCH_AXES sizes."""
    return math.prod(sizes[a] for a in BATCH_AXES)


def _divides(key: str, value: int, what: str, by: int, by_name: str) -> None:
    require(value % by == 0, key, value, f"{what} must be divisible by {by_name}={by}")


def _validate_choices(config) -> None:
    for key, choices in (("model.dtype", DTYPES), ("model.param_dtype", DTYPES),
                         ("remat.policy", REMAT_POLICIES), ("attention.impl", ATTENTION_IMPLS),
                         ("attention.scores_dtype", SCORES_DTYPES),
                         ("pipeline.schedule", PIPELINE_SCHEDULES), ("model.moe_balance_scope", BALANCE_SCOPES),
                         ("model.matmul_precision", MATMUL_PRECISIONS), ("model.rope_scaling", ROPE_SCALINGS),
                         ("model.family", FAMILIES), ("data.on_bad_data", ("skip", "error")),
                         ("model.moe_matmul", MOE_MATMULS), ("model.moe_exchange", MOE_EXCHANGES),
                         ("model.moe_fsdp", MOE_FSDP), ("model.moe_router", MOE_ROUTERS)):
        section, name = key.split(".")
        value = config[section][name]
        require(value in choices, key, value, f"must be one of {choices}")
    require(config.train.zero_stage in (0, 1, 2, 3), "train.zero_stage", config.train.zero_stage,
             "must be 0, 1, 2 or 3")


def _validate_positive(config) -> None:
    positive = ("model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads",
                "model.head_dim", "model.mlp_dim", "train.batch_size", "train.seq_len",
                "train.grad_accum_steps", "steps", "log_every", "checkpoint.keep",
                "pipeline.microbatches", "pipeline.repeats", "pipeline.weight_parts", "pipeline.weight_span",
                "model.fp8_history")
    for key in positive:
        value = config
        for part in key.split("."):
            value = value[part]
        require(isinstance(value, int) and value >= 1, key, value, "must be a positive integer")
    for key in ("eval_every", "eval_tasks_limit", "sample_every", "checkpoint.every", "checkpoint.local_every",
                "cpu_devices", "model.num_experts", "model.moe_mlp_dim", "model.sliding_window", "model.moe_chunks",
                "model.shared_expert_dim"):
        value = config
        for part in key.split("."):
            value = value[part]
        require(isinstance(value, int) and value >= 0, key, value, "must be a non-negative integer")
    for key in ("train.learning_rate", "model.norm_eps", "model.rope_theta", "model.init_std", "model.rope_factor",
                "model.rope_original_max_positions"):
        section, name = key.split(".")
        require(config[section][name] > 0, key, config[section][name], "must be > 0")
    m = config.model
    require(not m.shared_expert_dim or m.shared_expert, "model.shared_expert_dim", m.shared_expert_dim,
            "sets the shared expert's width: needs model.shared_expert=True")
    require(m.rope_scaling != "yarn" or m.rope_beta_fast > m.rope_beta_slow > 0, "model.rope_beta_fast",
            m.rope_beta_fast, f"must exceed model.rope_beta_slow={m.rope_beta_slow} > 0 (yarn RoPE scaling)")
    require(m.rope_scaling != "llama3" or m.rope_high_freq_factor > m.rope_low_freq_factor > 0,
            "model.rope_high_freq_factor", m.rope_high_freq_factor,
            f"must exceed model.rope_low_freq_factor={m.rope_low_freq_factor} > 0 (llama3 RoPE scaling)")
    require(0.0 <= config.train.min_lr_ratio <= 1.0, "train.min_lr_ratio", config.train.min_lr_ratio,
             "must be in [0, 1]")
    require(config.train.warmup_steps >= 0, "train.warmup_steps", config.train.warmup_steps, "must be >= 0")
    require(config.train.warmup_steps <= config.steps, "train.warmup_steps", config.train.warmup_steps,
            f"must be <= steps={config.steps} (the learning rate would never reach train.learning_rate)")
    for key in ("b1", "b2"):
        require(0.0 <= config.train[key] < 1.0, f"train.{key}", config.train[key],
                "must be in [0, 1) (an Adam moment's decay)")
    require(config.train.eps > 0, "train.eps", config.train.eps, "must be > 0")
    require(config.train.weight_decay >= 0, "train.weight_decay", config.train.weight_decay, "must be >= 0")
    require(config.train.grad_clip >= 0, "train.grad_clip", config.train.grad_clip,
            "must be >= 0 (the largest global gradient norm; 0: no clipping)")
    t = config.train
    require(t.spike_factor == 0 or t.spike_factor > 1, "train.spike_factor", t.spike_factor,
             "must be 0 (off) or > 1 (a multiple of the running median loss)")
    for key in ("spike_steps", "spike_window"):
        require(isinstance(t[key], int) and t[key] >= 1, f"train.{key}", t[key], "must be a positive integer")
    require(isinstance(t.spike_max_rollbacks, int) and t.spike_max_rollbacks >= 0, "train.spike_max_rollbacks",
             t.spike_max_rollbacks, "must be a non-negative integer")
    slop = t.xla_gpu_memory_limit_slop_factor
    require(isinstance(slop, int) and 1 <= slop <= 1000, "train.xla_gpu_memory_limit_slop_factor", slop,
            "must be an integer percentage in [1, 1000] (XLA's default: 95)")
    require(t.hang_timeout_s >= 0, "train.hang_timeout_s", t.hang_timeout_s, "must be >= 0 (0: off)")
    require(isinstance(t.straggler_every, int) and t.straggler_every >= 0, "train.straggler_every",
            t.straggler_every, "must be an integer >= 0 (0: off)")
    require(t.straggler_factor > 1, "train.straggler_factor", t.straggler_factor, "must be > 1")
    require(isinstance(t.compile_cache_dir, str), "train.compile_cache_dir", t.compile_cache_dir,
            "must be a folder, '' (the per-user cache) or 'off'")


def _validate_latent_attention(config) -> None:
    """Multi-head latent attention's rules (`model.kv_lora_rank` > 0)."""
    m = config.model
    for key in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        require(isinstance(m[key], int) and m[key] >= 0, f"model.{key}", m[key], "must be a non-negative integer")
    if not m.kv_lora_rank:
        for key in ("q_lora_rank", "qk_rope_head_dim"):
            require(m[key] == 0, f"model.{key}", m[key], "is multi-head latent attention's: set model.kv_lora_rank")
        return
    require(m.qk_rope_head_dim > 0 and m.qk_rope_head_dim % 2 == 0 and m.qk_rope_head_dim < m.head_dim,
            "model.qk_rope_head_dim", m.qk_rope_head_dim,
            f"must be even, > 0 and < model.head_dim={m.head_dim} (the RoPE part of a query / key head)")
    require(m.n_kv_heads == m.n_heads, "model.n_kv_heads", m.n_kv_heads,
            f"multi-head latent attention expands a key and a value per query head: must be model.n_heads={m.n_heads}")
    for key, off in (("attention_bias", False), ("qk_norm", False), ("sliding_window", 0)):
        require(m[key] == off, f"model.{key}", m[key], "multi-head latent attention has none (model.kv_lora_rank > 0)")
    require(m.matmul_precision == "bf16", "model.matmul_precision", m.matmul_precision,
            "multi-head latent attention's projections run in model.dtype: use 'bf16' (model.kv_lora_rank > 0)")
    require(not m.collective_matmul, "model.collective_matmul", True,
            "splits the fused QKV projection, which multi-head latent attention does not have (model.kv_lora_rank > 0)")


def _validate_multi_token(config, sizes: dict[str, int]) -> None:
    """Multi-token prediction's rules (`model.mtp_depth`)."""
    m = config.model
    require(m.mtp_depth in (0, 1), "model.mtp_depth", m.mtp_depth, "must be 0 or 1 (DeepSeek-V3's depth)")
    require(m.mtp_loss_weight >= 0, "model.mtp_loss_weight", m.mtp_loss_weight, "must be >= 0")
    if m.mtp_depth:
        require(not m.fused_loss, "model.fused_loss", True, "the fused loss serves the main head alone: set it "
                "False with model.mtp_depth=1")


def _validate_shapes(config, sizes: dict[str, int]) -> None:
    m, t = config.model, config.train
    _divides("model.n_heads", m.n_heads, "query heads", m.n_kv_heads, "model.n_kv_heads")
    _divides("model.n_heads", m.n_heads, "query heads", sizes["tensor"], "mesh.tensor")
    _divides("model.n_kv_heads", m.n_kv_heads, "KV heads", sizes["tensor"], "mesh.tensor")
    _divides("model.mlp_dim", m.mlp_dim, "the MLP width", sizes["tensor"], "mesh.tensor")
    _divides("model.vocab_size", m.vocab_size, "the vocabulary", sizes["tensor"], "mesh.tensor")
    if config.train.zero_stage > 0:  # ZeRO shards the `embed` dimension of parameter-sized state over both
        _divides("model.d_model", m.d_model, "d_model (sharded by ZeRO)",
                 sizes["sequence"] * sizes["fsdp"] * sizes["expert"], "mesh.sequence*mesh.fsdp*mesh.expert")
        for key in ("kv_lora_rank", "q_lora_rank"):  # the latents' up-projections: ZeRO shards their rank
            if m[key]:
                _divides(f"model.{key}", m[key], "the latent width (sharded by ZeRO)",
                         sizes["sequence"] * sizes["fsdp"] * sizes["expert"], "mesh.sequence*mesh.fsdp*mesh.expert")
    # model.n_layers over mesh.stage: any split (uneven stages: parallel/pipeline.py's rules)
    _divides("train.seq_len", t.seq_len, "the sequence length", sizes["sequence"], "mesh.sequence")
    if m.sequence_parallel:
        _divides("train.seq_len", t.seq_len, "the sequence length (model.sequence_parallel)",
                 sizes["sequence"] * sizes["tensor"], "mesh.sequence*mesh.tensor")
    if m.collective_matmul:  # collective_matmul.py
        require(m.sequence_parallel, "model.collective_matmul", True,
                "splits sequence parallelism's gathers and scatters: needs model.sequence_parallel=True")
        require(config.remat.policy != "offload", "model.collective_matmul", True,
                "remat.policy='offload' splits its shard_map into per-device residuals Shardy rejects: "
                "use none, selective or full")
        require(m.matmul_precision == "bf16", "model.collective_matmul", True,
                f"runs the matmuls in model.dtype: needs model.matmul_precision='bf16' (got {m.matmul_precision!r})")
    dp = data_parallel_size(sizes)
    _divides("train.batch_size", t.batch_size, "the global batch (micro-batch x accumulation x data-parallel)",
             t.grad_accum_steps * dp, f"train.grad_accum_steps*mesh.(data*fsdp*expert)={t.grad_accum_steps}*{dp}")


def _validate_profile_init(config) -> None:
    steps = tuple(config.profile.steps)
    require(len(steps) == 2 and all(isinstance(s, int) for s in steps), "profile.steps", steps,
             "must be two integers (first, last)")
    require(steps == (0, 0) or 1 <= steps[0] <= steps[1] <= config.steps, "profile.steps", steps,
             f"must be (0, 0) (off) or 1 <= first <= last <= steps={config.steps}")
    hf_dir = config.init.from_hf
    require(not hf_dir or os.path.isfile(os.path.join(hf_dir, "config.json")), "init.from_hf", hf_dir,
             "must be a Hugging Face checkpoint folder with a config.json")


def validate_fields(config: ml_collections.ConfigDict) -> None:
    """The rules that need no device count: choices and positive numbers. None of them relates a
    layout key (ZeRO stage, remat, accumulation, the pipeline's schedule) to another field: the
    planner's search checks them once a mesh, not once a layout (`plan.estimate._candidates`); a rule
    that does belongs in `validate_config`."""
    _validate_choices(config)
    _validate_positive(config)


def validate_config(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> None:
    """The generic rules on the resolved mesh: shapes divisible by their axes, profile, init."""
    _validate_latent_attention(config)
    _validate_multi_token(config, sizes)
    _validate_shapes(config, sizes)
    _validate_profile_init(config)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model's hyper-parameters as a hashable value (a static argument of traced code)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    family: str = "llama"
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: str = "float32"
    param_dtype: str = "float32"
    sequence_parallel: bool = False
    collective_matmul: bool = False
    remat_policy: str = "none"
    attention_impl: str = "xla"
    attention_scores_dtype: str = "float32"  # attention.scores_dtype (the einsum attention's scores)
    fused_norm: bool = False
    fused_loss: bool = False
    num_experts: int = 0
    experts_per_token: int = 2
    moe_norm_topk: bool = True
    moe_router: str = "softmax"
    moe_routed_scale: float = 1.0
    moe_router_bias: bool = False
    moe_bias_rate: float = 0.001
    moe_groups: int = 1
    moe_topk_groups: int = 0
    moe_every: int = 1
    first_dense_layers: int = 0
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    capacity_factor: float = 1.25
    moe_dropless: bool = False
    moe_matmul: str = "ragged_dot"  # model.moe_matmul resolved (`moe_matmul`)
    moe_exchange: str = "all_to_all"  # model.moe_exchange resolved (`moe_exchange`)
    moe_exchange_factor: float = 0.0
    moe_chunks: int = 1  # model.moe_chunks resolved (`moe_chunks`; 0: the layer's `moe_dropless.chunks_for`)
    moe_fsdp: str = "auto"  # model.moe_fsdp (resolved against the mesh: `experts_over_fsdp`)
    zero_stage: int = 0  # train.zero_stage: from 3 on a layer's weights arrive split and are gathered where used
    moe_mlp_dim: int = 0
    shared_expert: bool = False
    shared_expert_dim: int = 0
    aux_loss_weight: float = 0.01
    moe_balance_scope: str = "batch"
    router_z_loss_weight: float = 0.001
    matmul_precision: str = "bf16"
    fp8_history: int = 16
    # Not a config key: True in the program of FP8 training's first step (empty amax histories: each
    # operand scales by its own current amax); `train_step.build` compiles it beside the usual step.
    fp8_first_step: bool = False

    @property
    def stacked_layers(self) -> int:
        """The layers of the scanned stack (what a pipeline splits): all but the dense first ones."""
        return self.n_layers - self.first_dense_layers

    @property
    def moe_layers(self) -> int:
        """How many layers are MoE layers (0 for a dense model)."""
        return self.stacked_layers // self.moe_every if self.num_experts else 0

    @property
    def fp8(self) -> bool:
        """Whether the attention and MLP matmuls run in FP8 (`fp8.py`)."""
        return self.matmul_precision == "fp8"

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, platform: str = "gpu") -> ModelConfig:
        """The model section of `config` as the step on `platform`'s devices runs it (`attention.impl`
        resolved: `attention_impl`); the planner's default is the GPU it plans for."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in config.model.items() if k in fields}
        values.update(moe_matmul=moe_matmul(config, platform), moe_exchange=moe_exchange(config, platform),
                      moe_chunks=moe_chunks(config, platform))
        values.update(zero_stage=int(config.train.zero_stage))
        return cls(**values, remat_policy=config.remat.policy, attention_impl=attention_impl(config, platform),
                   attention_scores_dtype=config.attention.scores_dtype)
