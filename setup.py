"""nest-fx: network- and memory-aware auto-parallelization for PyTorch."""
from setuptools import find_packages, setup

setup(
    name="nest-fx",
    version="0.1.0",
    description="Trace a PyTorch model, plan data/tensor/pipeline/expert parallelism with the "
    "NEST dynamic program, and run the plan under torchrun.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["nest_fx", "nest_fx.*", "profiler", "profiler.*"]),
    install_requires=[
        # Exact pin: this version has a local CPU wheel; a range pulls GBs of CUDA packages.
        "torch==2.13.0",
        "networkx>=3.0",
        "numpy>=1.24",
        "tabulate>=0.9",
        "pyyaml>=6.0",
        "tqdm>=4.60",
        "safetensors>=0.4",  # weights= reads HF checkpoints slice by slice
    ],
    extras_require={
        "hf": ["transformers>=4.45"],
        "plot": ["matplotlib>=3.7"],
        # Float8 linears (plan.float8): used only on NVIDIA GPUs with fp8 tensor cores
        "float8": ["torchao"],
        "dev": ["pytest>=7.4", "pytest-timeout>=2.1", "hypothesis>=6.80"],
    },
    entry_points={"console_scripts": ["nest-fx=nest_fx.cli:main"]},
)
