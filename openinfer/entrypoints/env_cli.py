"""``openinfer env``: what this machine runs, as ``vllm collect-env`` reports it: the platform, the kernel build, the
implementation of every op kind (the start-up report's block), versions, and the ``OPENINFER_*`` variables set."""
from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys

# Python packages whose presence changes what openinfer can do (module name for the report -> distribution).
_PACKAGES = [
    ("torch", "torch"), ("transformers", "transformers"), ("tokenizers", "tokenizers"),
    ("safetensors", "safetensors"), ("numpy", "numpy"), ("fastapi", "fastapi"), ("uvicorn", "uvicorn"),
    ("llguidance", "llguidance"), ("xgrammar", "xgrammar"), ("ray", "ray"), ("nixl", "nixl"),
    ("vllm-router", "vllm-router"), ("sglang-router", "sglang-router"), ("gguf", "gguf"),
    ("llama-cpp-python", "llama-cpp-python"), ("vllm", "vllm"),
]


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="print the platform, the kernel build, what runs each op, and versions",
                       description="Print what openinfer would run on this machine (like `vllm collect-env`).")
    p.add_argument("--kernel-backend", default="auto", help="auto | cpu | torch (as for generate / serve)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    p.add_argument("--dtype", default="auto", help="the model dtype to describe the ops for (auto: as the engine "
                                                    "would pick on this device)")
    p.set_defaults(func=run)


def versions() -> list[tuple[str, str]]:
    out = []
    for label, dist in _PACKAGES:
        try:
            out.append((label, importlib.metadata.version(dist)))
        except importlib.metadata.PackageNotFoundError:
            out.append((label, "not installed"))
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from openinfer.config import KernelConfig, resolve_dtype
    from openinfer.envs import set_in_environment
    from openinfer.layers import dispatch
    from openinfer.platform import resolve_device

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, {}, device)
    try:
        openinfer_version = importlib.metadata.version("openinfer")
    except importlib.metadata.PackageNotFoundError:
        openinfer_version = "not installed (source tree)"
    print(f"openinfer {openinfer_version}")
    print(f"python     {sys.version.split()[0]} ({platform.platform()})")
    cuda = torch.cuda.is_available()
    print(f"device     {device} (CUDA {'available: ' + torch.cuda.get_device_name(0) if cuda else 'not available'})")
    print(f"dtype      {str(dtype).removeprefix('torch.')} (for --dtype {args.dtype})")
    try:
        selection = dispatch.select(KernelConfig.from_env(args.kernel_backend), device)
    except dispatch.KernelBuildError as e:
        print(f"kernels:\n  platform    {dispatch.isa_summary()}\n  build       FAILED: {e}")
        rc = 1
    else:
        print(dispatch.report(selection, dtype))
        rc = 0
    print("versions:")
    for name, version in versions():
        print(f"  {name.ljust(17)} {version}")
    print(f"  {'torch threads'.ljust(17)} {torch.get_num_threads()}")
    set_vars = set_in_environment()
    print("environment:" + ("" if set_vars else " no OPENINFER_* variable set"))
    for k, v in set_vars.items():
        print(f"  {k}={v if 'API_KEY' not in k else '<set>'}")
    return rc
