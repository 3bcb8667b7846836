"""Audit every adapter of the cookbook: ``python -m examples.adapters.audit_all [--out DIR]``.

What ``nox -s peers`` runs once the libraries are installed. Each adapter gets the quick
audit on the CPU (JSON report and reproducers under ``--out``); a library that is not
installed is reported and left out. Exit code 0 when every installed adapter was audited
to the end (their FAILs are the findings of docs/adapters.md), 1 otherwise.
"""

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

#: (adapter, the module its library provides)
ADAPTERS = [
    ("examples.adapters.hf_transformers:sdpa", "transformers"),
    ("examples.adapters.hf_transformers:eager", "transformers"),
    ("examples.adapters.hf_transformers:gpt_oss", "transformers"),
    ("examples.adapters.x_transformers:attend", "x_transformers"),
    ("examples.adapters.x_transformers:attend_flash", "x_transformers"),
    ("examples.adapters.memory_efficient:chunked", "memory_efficient_attention_pytorch"),
    ("examples.adapters.memory_efficient:plain", "memory_efficient_attention_pytorch"),
    ("examples.adapters.jax_attention:attention", "jax"),
    ("examples.adapters.local_attention:attend", "local_attention"),
    ("examples.adapters.torchtune_attention:mha", "torchtune"),
    ("examples.adapters.torchtune_attention:mha_cached", "torchtune"),
    ("examples.adapters.litgpt_attention:sdpa", "litgpt"),
    ("examples.adapters.natten_attention:attend", "natten"),
    ("examples.adapters.softmax_n:slow", "flash_attention_softmax_n"),
    ("examples.adapters.softmax_n:flash", "flash_attention_softmax_n"),
    ("examples.adapters.onnxruntime_attention:attention", "onnxruntime"),
    ("examples.adapters.openvino_attention:attention", "openvino"),
    ("examples.adapters.keras_torch:attention", "keras"),
    ("examples.adapters.keras_jax:attention", "keras"),
    ("examples.adapters.ring_attention:ring", "ring_attention_pytorch"),
    ("examples.adapters.ring_attention:ring_buckets", "ring_attention_pytorch"),
    # GPU kernels, run through their interpreters on the CPU (docs/interpreted.md)
    ("examples.adapters.sglang_decode:decode", "sglang"),
    ("examples.adapters.sglang_extend:extend", "sglang"),
    ("examples.adapters.sglang_sparse:prefill", "sglang"),
    ("examples.adapters.sglang_sparse:packed", "sglang"),
    ("examples.adapters.sglang_sparse:decode", "sglang"),
    ("examples.adapters.sglang_sparse:single", "sglang"),
    ("examples.adapters.sglang_mla:mla_decode", "sglang"),
    ("examples.adapters.vllm_unified:unified", "vllm"),
    ("examples.adapters.vllm_mla:mla_decode", "vllm"),
    ("examples.adapters.flash_attn_triton:flash_attn_func", "flash_attn"),
    # the gated delta rule (docs/linear.md): fla's Triton kernels, interpreted, and
    # transformers' torch paths for Qwen3-Next
    ("examples.adapters.fla_gated_delta:chunk", "fla"),
    ("examples.adapters.fla_gated_delta:recurrent", "fla"),
    ("examples.adapters.hf_gated_delta:chunk", "transformers"),
    ("examples.adapters.hf_gated_delta:recurrent", "transformers"),
    ("examples.adapters.mlx_gated_delta:ops", "mlx_lm"),
    ("examples.adapters.vllm_gated_delta:decode", "vllm"),
    ("examples.adapters.vllm_gated_delta:kda", "vllm"),
    ("examples.adapters.pallas_flash:mha", "jax"),
]
#: the API family of an adapter that is not torch SDPA's (``--api``)
FAMILIES = {
    "examples.adapters.ring_attention:ring": "context-parallel",
    "examples.adapters.ring_attention:ring_buckets": "context-parallel",
    "examples.adapters.sglang_decode:decode": "flash-kvcache",
    "examples.adapters.sglang_extend:extend": "flash-kvcache",
    "examples.adapters.sglang_sparse:prefill": "sparse-mla",
    "examples.adapters.sglang_sparse:packed": "sparse-mla",
    "examples.adapters.sglang_sparse:decode": "sparse-mla",
    "examples.adapters.sglang_sparse:single": "sparse-mla",
    "examples.adapters.fla_gated_delta:chunk": "gated-delta",
    "examples.adapters.fla_gated_delta:recurrent": "gated-delta",
    "examples.adapters.hf_gated_delta:chunk": "gated-delta",
    "examples.adapters.hf_gated_delta:recurrent": "gated-delta",
    "examples.adapters.mlx_gated_delta:ops": "gated-delta",
    "examples.adapters.vllm_gated_delta:decode": "gated-delta-decode",
    "examples.adapters.vllm_gated_delta:kda": "gated-delta-decode",
    "examples.adapters.pallas_flash:mha": "flash",
    "examples.adapters.sglang_mla:mla_decode": "mla",
    "examples.adapters.vllm_unified:unified": "flash-kvcache",
    "examples.adapters.vllm_mla:mla_decode": "mla",
    "examples.adapters.flash_attn_triton:flash_attn_func": "flash",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="peer-reports", help="folder for the JSON reports")
    parser.add_argument("--profile", default="quick")
    args, extra = parser.parse_known_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    unfinished = []
    for spec, library in ADAPTERS:
        if importlib.util.find_spec(library) is None:
            print(f"{spec}: {library} is not installed, left out", flush=True)
            continue
        report = out / (spec.split(".")[-1].replace(":", "-") + ".json")
        cmd = [sys.executable, "-m", "attnref", "audit", "--backend", spec]
        if spec in FAMILIES:
            cmd += ["--api", FAMILIES[spec]]
        cmd += ["--profile", args.profile, "--json", str(report), *extra]
        print("$", " ".join(cmd), flush=True)
        code = subprocess.run(cmd, check=False).returncode
        if code not in (0, 1):  # 1: findings; anything else: the audit did not run
            unfinished.append(f"{spec} (exit {code})")
    if unfinished:
        print("not audited:", ", ".join(unfinished))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
