"""meshtrain: 5D-parallel LLM training with JAX on one named device mesh."""

from setuptools import find_packages, setup

# Versions tested together on Python 3.11 (CPU) and CUDA 12 GPUs.
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
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

EXTRAS = {
    # tokenizers / sentencepiece: the tokenizer.json and .model readers (data.tokenizer)
    "test": ["pytest==9.0.3", "pytest-xdist==3.8.0", "tokenizers==0.23.3", "sentencepiece==0.2.3", *HF_TEST, *EVAL],
    "data": DATA,
    "eval": EVAL,
    "gpu": ["jax[cuda12]==0.10.2"],
}

setup(
    name="meshtrain",
    version="0.1.0",
    description="LLM training on one six-axis JAX device mesh (data, fsdp, tensor, sequence, expert, stage).",
    packages=find_packages(include=["meshtrain", "meshtrain.*"]),
    package_data={"meshtrain.targets": ["*.txtpb"]},  # GPU target descriptions (python -m meshtrain.aot)
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
