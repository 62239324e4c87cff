from setuptools import find_packages, setup

setup(
    name="fp8engine",
    version="0.1.0",
    description="Paged-attention LLM inference engine for RL rollouts, with in-place FP8 weight updates",
    python_requires=">=3.10",
    packages=find_packages(include=["fp8engine", "fp8engine.*"]),
    install_requires=[
        "torch>=2.4",
        "transformers>=4.45",
        "safetensors",
        "tokenizers",
        "numpy",
        "tqdm",
        "jinja2",
        "filelock",
        "ninja",
    ],
    extras_require={
        "gpu": ["triton", "flashinfer-python", "deep-gemm", "xformers"],
        "server": ["fastapi", "uvicorn[standard]", "uvloop", "prometheus-client", "httpx"],
        "ray": ["ray[default]>=2.10"],
        "dev": ["pytest", "pytest-randomly", "gguf", "accelerate", "matplotlib", "openai", "triton",
                "hypothesis", "schemathesis", "lm-eval[api]==0.4.13", "trl==1.16.*", "datasets", "peft",
                "ray[default]>=2.10"],
    },
    entry_points={"console_scripts": ["fp8engine=fp8engine.entrypoints.cli:main"]},
)
