"""The config a command starts from without `--config`: `config.default_config()`.

`python -m meshtrain.sample --config.workdir=runs/x` needs no config file: the run's checkpoints
describe its model and tokenizer (`run_record`), and the defaults fill the rest (the mesh fills the
devices over `data`).
"""

import os

from meshtrain.config import default_config

PATH = os.path.abspath(__file__)


def get_config():
    return default_config()
