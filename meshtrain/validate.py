"""Every config rule, gathered: only the commands (and tests) import this module.

Each part of meshtrain keeps its rules beside its code as `validate_config(config, sizes)` and
raises `config.ConfigError` through `config.require`; this module runs them in order, before
anything is traced or compiled, so a bad config ends with one message naming the key, the value
and the rule.
"""

from __future__ import annotations

import ml_collections

from meshtrain import attention, checkpoint, config as config_lib, data, eval_tasks, generate, moe
from meshtrain.parallel import layout, pipeline, ulysses

# Rules of the step's layout: pure functions of the config and the mesh shape.
LAYOUT_RULES = (config_lib.validate_config, attention.validate_config, ulysses.validate_config, moe.validate_config,
                pipeline.validate_config, layout.validate_config, generate.validate_config)
# Rules that look at files: the data source and the checkpoint to restore.
INPUT_RULES = (data.validate_config, checkpoint.validate_config, eval_tasks.validate_config)


def validate(config: ml_collections.ConfigDict, num_devices: int, *, inputs: bool = True) -> dict[str, int]:
    """Checks every rule; returns the resolved mesh shape (axis -> size). Raises ConfigError.

    `inputs=False` skips the rules that read files (the planner validates hypothetical runs).
    """
    config_lib.validate_fields(config)
    sizes = validate_layout(config, num_devices)
    for rule in INPUT_RULES if inputs else ():
        rule(config, sizes)
    return sizes


def validate_layout(config: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """The mesh shape and LAYOUT_RULES alone, for a config whose fields passed
    `config.validate_fields` and that changed since only in layout keys to valid choices (the
    planner's search, which tries thousands of layouts of one config)."""
    sizes = config_lib.mesh_shape(config, num_devices)
    for rule in LAYOUT_RULES:
        rule(config, sizes)
    return sizes
