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
        # The versions whose APIs the code uses: the pipeline schedules' step(return_outputs=False)
        # (apply/pipeline.py; new in 2.10, pytorch PR #165822) is the newest of them (FSDP2's public
        # torch.distributed.fsdp.fully_shard: 2.6; torch.distributed.tensor: 2.5; pipelining: 2.4).
        # Below 3: the next major is untested. The README's and CI's installs pin the tested version
        # (constraints.txt: torch==2.13.0, whose CPU wheel installs in seconds).
        "torch>=2.10,<3",
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
        # torchrun's etcd / etcd-v2 rendezvous backends (elastic jobs that survive the loss of any node)
        # import the etcd v2 API client `etcd`; the server is Debian's etcd-server (docs/runtime.md)
        "etcd": ["python-etcd>=0.4.5"],
        "dev": ["pytest>=7.4", "pytest-timeout>=2.1", "hypothesis>=6.80", "ruff>=0.5"],
    },
    entry_points={"console_scripts": ["nest-fx=nest_fx.cli:main"]},
)
