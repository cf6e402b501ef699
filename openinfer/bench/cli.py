"""``openinfer bench <kind>``. Each kind is a module exposing ``add_args(parser)`` and ``main(args) -> int``."""
from __future__ import annotations

import importlib

_KINDS = {
    "throughput": ("openinfer.bench.throughput", "offline throughput over a batch-size sweep"),
    "serve": ("openinfer.bench.serve", "load generator for any OpenAI-compatible server"),
    "compare": ("openinfer.bench.compare", "compare whole curves from several result files"),
    "peers": ("openinfer.bench.peers", "run the same offline workload on openinfer and installed peers"),
    "cost": ("openinfer.bench.cost", "dollars per million tokens from result files and a $/device-hour price"),
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks", description="Benchmarks whose numbers you can check.")
    kinds = p.add_subparsers(dest="bench_kind", metavar="KIND")
    for name, (mod, help_text) in _KINDS.items():
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name == mod:
                continue  # not built yet in this tree
            raise
        kp = kinds.add_parser(name, help=help_text, description=help_text)
        module.add_args(kp)
        kp.set_defaults(func=module.main)
