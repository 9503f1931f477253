"""meshtrain: 5D-parallel LLM training with JAX on one named device mesh."""

from setuptools import find_packages, setup

# The supported range, tested at both ends by .ci/run: the floor on Python 3.11 (the CPU suite and
# the H100 compiles), the ceiling (the newest releases) on Python 3.12 (the quick set, `tests/quick.txt`,
# and its H100 compiles). jax 0.11+ and flax 0.12.12 need Python >= 3.12, so 3.11 installs the floor
# exactly; on 3.12 and 3.13 pip takes the newest release in range, or keeps a JAX already installed in
# range (a GPU machine's own JAX for CUDA is never replaced).
# (Plain string literals: bench/gpu/run_all.sh reads this list without running setup.py.)
INSTALL_REQUIRES = [
    'jax==0.10.2; python_version < "3.12"',
    'jaxlib==0.10.2; python_version < "3.12"',
    'flax==0.12.8; python_version < "3.12"',
    'jax>=0.10.2,<=0.12.0.1; python_version >= "3.12"',
    'jaxlib>=0.10.2,<=0.12.0.1; python_version >= "3.12"',
    'flax>=0.12.8,<=0.12.12; python_version >= "3.12"',
    "optax==0.2.8",  # the newest release of each of these is the floor: one version, both ends
    "orbax-checkpoint==0.12.8",
    "chex==0.1.92",
    "ml-collections==1.1.0",
    "tensorflow-datasets==4.9.10",
    "grain==0.2.18",
    "array-record==0.8.6",
    "absl-py>=2.1",
    "numpy>=1.26",
    "tensorboardX==2.6.5",  # <workdir>/tb event files without TensorFlow
    "matplotlib==3.11.2",  # python -m meshtrain.report plots
]

# Hugging Face reference models for the import/export tests. torch is pinned to the CPU build
# that installs quickly; an unpinned torch pulls a multi-GB CUDA build.
HF_TEST = ["torch==2.13.0", "transformers==5.23.0", "safetensors==0.8.0"]

# data.source='hf:...' reads local Hugging Face datasets; python -m meshtrain.evaluate runs lm-eval tasks.
DATA = ["datasets==5.2.0"]
EVAL = ["lm-eval==0.4.13", *DATA]

TEST_CORE = ["pytest==9.0.3", "pytest-xdist==3.8.0", "tokenizers==0.23.3", "sentencepiece==0.2.3"]
LINT = ["ruff==0.17.6"]  # `ruff check .`, a leg of .ci/run (its rules: pyproject.toml)

EXTRAS = {
    # tokenizers / sentencepiece: the tokenizer.json and .model readers (data.tokenizer)
    # test-core: what the fast set on the newest JAX needs (no torch, no lm-eval); test: the whole suite
    "test-core": TEST_CORE,
    "test": [*TEST_CORE, *HF_TEST, *EVAL, *LINT],
    "data": DATA,
    "eval": EVAL,
    # XLA's GPU compiler and runtime: CUDA 12 builds (every version in range), CUDA 13 (jax >= 0.11,
    # Python >= 3.12). A machine whose JAX already sees its GPUs needs neither (bench/gpu/run_all.sh).
    "gpu": ['jax[cuda12]==0.10.2; python_version < "3.12"',
            'jax[cuda12]>=0.10.2,<=0.12.0.1; python_version >= "3.12"'],
    "gpu-cuda13": ['jax[cuda13]>=0.11.1,<=0.12.0.1; python_version >= "3.12"'],
}

setup(
    name="meshtrain",
    version="0.1.0",
    description="LLM training on one six-axis JAX device mesh (data, fsdp, tensor, sequence, expert, stage).",
    packages=find_packages(include=["meshtrain", "meshtrain.*"]),
    package_data={"meshtrain.targets": ["*.txtpb"]},  # GPU target descriptions (python -m meshtrain.aot)
    python_requires=">=3.11,<3.14",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
