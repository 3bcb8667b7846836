"""Developer sessions: ``nox -s tests``, ``slow``, ``typecheck``, ``lint``, ``docs``,
``bench``, ``bench_gpu``, ``audit_gpu``, ``peers``.

Every session forwards ``session.posargs`` (``nox -s tests -- -k masks``). torch is
pinned to the CPU build that lies on this project's machines; an unpinned ``torch`` would
pull a multi-GB CUDA build.
"""

import nox

# slow, bench, bench_gpu, audit_gpu and peers on request
nox.options.sessions = ["tests", "typecheck", "lint", "docs"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"


def _install(session: nox.Session, extra: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extra}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The default tier, README's test command (Hypothesis profile from
    HYPOTHESIS_PROFILE, default ci)."""
    _install(session, "test")
    session.run("pytest", *session.posargs)


@nox.session
def slow(session: nox.Session) -> None:
    """The slow tier on every core: extra seeds and dtypes, full gradcheck, the tools."""
    _install(session, "test")
    session.run("pytest", "-m", "slow", *session.posargs)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over src, tests, benchmarks, tools and this file."""
    _install(session, "dev")
    session.run("mypy", "--strict", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    session.install("ruff")
    session.run("ruff", "check", *session.posargs)
    session.run("ruff", "format", "--check", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation strictly (warnings are errors)."""
    _install(session, "dev")
    session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """CPU benchmarks (pytest-benchmark) with median ratios side by side."""
    _install(session, "test")
    session.run("pytest", "benchmarks", *session.posargs)


@nox.session(venv_backend="none")
def bench_gpu(session: nox.Session) -> None:
    """The GPU sweep (tools/gpu_bench.py) into docs/gpu-bench, in the current environment.

    ``venv_backend="none"``: the GPU machine has no network, so it uses the torch already
    installed there. ``nox -s bench_gpu -- --budget-s 300`` forwards options.
    """
    session.run("python", "tools/gpu_bench.py", *session.posargs)


@nox.session(venv_backend="none")
def audit_gpu(session: nox.Session) -> None:
    """Audit every torch SDPA kernel forced, float16 and bfloat16, into docs/gpu-audit.

    Runs in the current environment (``venv_backend="none"``): a GPU machine has no
    network, so it uses the torch already installed there. ``nox -s audit_gpu -- --profile
    ci`` forwards options to tools/gpu_audit.py.
    """
    session.run("python", "tools/gpu_audit.py", *session.posargs)


@nox.session
def peers(session: nox.Session) -> None:
    """Install the third-party attention libraries of examples/adapters (pinned, torch
    included, by examples/adapters/constraints.txt), check the adapters, audit each.

    The reports go to ``peer-reports/``; docs/adapters.md lists what they find.
    ``nox -s peers -- --profile ci`` forwards options to the audits.
    """
    constraints = "examples/adapters/constraints.txt"
    session.install(TORCH)
    session.install("-c", constraints, "-e", ".[test]")
    session.install(
        "-c",
        constraints,
        "transformers",
        "x-transformers",
        "memory-efficient-attention-pytorch",
        "jax[cpu]",
        "local-attention",
        "torchtune",
        "torchao",
        "natten",
        "flash-attention-softmax-n",
        "onnx",
        "onnxruntime",
        "openvino",
        "keras",
        "ring-attention-pytorch",
    )
    # litgpt 0.5.13 pins huggingface-hub < 1.4, transformers 5.24 needs >= 1.31: no
    # environment holds both as declared. The adapter calls one method of litgpt's
    # model, which needs none of the hub: litgpt without its pins, and the two packages
    # its import needs
    session.install("-c", constraints, "--no-deps", "litgpt")
    session.install("-c", constraints, "lightning", "jsonargparse[signatures]")
    # GPU kernels run interpreted (docs/interpreted.md): triton, and SGLang's wheel
    # without its dependencies (it pins a CUDA torch), with the pure-Python packages its
    # sglang.srt.environ and sglang.srt.utils import
    session.install("-c", constraints, "-e", ".[interpret]")
    session.install("-c", constraints, "--no-deps", "sglang")
    session.install(
        "-c", constraints, "orjson", "psutil", "pybase64", "requests", "packaging", "pillow",
        "starlette", "msgspec", "pydantic", "pyzmq", "ipython", "aiohttp",
    )  # fmt: skip
    # fla-core without its dependencies (its extras pick a torch of their own), with the
    # one package its import needs (docs/linear.md)
    session.install("-c", constraints, "--no-deps", "fla-core")
    session.install("-c", constraints, "einops")
    # mlx-lm's gated delta rule on the CPU: mlx's CPU wheel, mlx-lm without its own
    # dependencies (importing its gated_delta module needs none of them)
    session.install("-c", constraints, "--no-deps", "mlx", "mlx-cpu", "mlx-lm")
    # vLLM's Triton kernels: its wheel without its dependencies (it pins a CUDA torch),
    # and the one package their import needs
    session.install("-c", constraints, "--no-deps", "vllm")
    session.install("-c", constraints, "regex")
    # FlashAttention's Triton backend: its source release built with no CUDA and nothing
    # compiled (examples/adapters/flash_attn_triton.py says how it is then imported), in
    # this environment (its setup.py imports torch, packaging and wheel)
    session.install("-c", constraints, "setuptools", "wheel", "packaging")
    session.install(
        "-c", constraints, "--no-deps", "--no-build-isolation", "flash-attn",
        env={
            "FLASH_ATTENTION_TRITON_AMD_ENABLE": "TRUE",
            "FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE",
            "FLASH_ATTENTION_FORCE_BUILD": "TRUE",
        },
    )  # fmt: skip
    session.run("pytest", "-m", "", "tests/test_adapters.py")
    session.run("python", "-m", "examples.adapters.audit_all", *session.posargs)
