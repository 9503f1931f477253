"""Hugging Face Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE checkpoints <-> meshtrain parameters.

Import reads `config.json` and `*.safetensors` (one `model.safetensors`, or shards listed in
`model.safetensors.index.json`) and builds every parameter directly in its mesh sharding with
`jax.make_array_from_callback`: each device reads only the rows and columns of its own shard
from the memory-mapped files, so no process ever holds a whole model (the playbook's "Shapes
before bytes" habit applied to loading, and what makes the ZeRO-3 / tensor-parallel layouts of
"ZeRO" and "Tensor Parallelism" reachable from a 70B checkpoint). Export writes sharded
safetensors and a `config.json` that `transformers` loads, into a temporary folder renamed into
place only when complete.

The layouts differ only by transposes and reshapes (meshtrain's RoPE is the rotate-half layout
of Hugging Face Llama, so q/k need no permutation):

    q_proj [H*Dh, D]  -> layers/attn/wq   [L, D, H, Dh]
    k_proj, v_proj    -> layers/attn/wk,v [L, D, K, Dh]
    o_proj [D, H*Dh]  -> layers/attn/wo   [L, H, Dh, D]
    gate/up_proj [F, D] -> layers/mlp/w_gate, w_up [L, D, F];  down_proj [D, F] -> w_down [L, F, D]
    embed_tokens [V, D] -> embedding [V, D];  lm_head [V, D] -> head [D, V]
    experts.{e}.gate/up [F, D] (Qwen3-MoE gate_proj, up_proj; Mixtral w1, w3) -> layers/moe/w_gate, w_up [L, E, D, F]
    experts.{e}.down [D, F] (down_proj; w2) -> layers/moe/w_down [L, E, F, D]
    the router, gate [E, D] (mlp.gate; block_sparse_moe.gate) -> layers/moe/router [L, D, E]

Modules: `formats` (config.json, safetensors), `convert` (config mapping, parameter layouts),
`io` (load into the mesh, initial train state, save), `__main__` (the CLI):

    python -m meshtrain.hf import HF_DIR            # prints the model config and parameter table
    python -m meshtrain.hf export HF_DIR OUT_DIR    # HF -> meshtrain -> HF (re-shards / casts)
"""

from meshtrain.hf.convert import (
    ARCHITECTURE_FIELDS,
    apply_model_config,
    hf_config_from_model,
    layouts,
    model_config_from_hf,
)
from meshtrain.hf.formats import DTYPE_NAMES, HFFormatError, SafetensorsStore, read_config
from meshtrain.hf.io import initial_state, load, param_shardings, save

__all__ = ["ARCHITECTURE_FIELDS", "DTYPE_NAMES", "HFFormatError", "SafetensorsStore", "apply_model_config",
           "hf_config_from_model", "initial_state", "layouts", "load", "model_config_from_hf", "param_shardings",
           "read_config", "save"]
