"""One place decides how every op runs (after vLLM's ``CustomOp`` + ``Platform``).

``select(KernelConfig, device)`` runs once when a model is loaded: it resolves the backend (``auto`` -> the C++ CPU
kernels on a CPU with a C++ toolchain, else torch), builds the kernels (a failed build raises ``KernelBuildError``
naming the compiler's error and the opt-out, ``--kernel-backend torch``), and returns a frozen ``KernelSelection``.
The model runner makes it the active selection (``use``) while it loads and runs the model; the layers ask
``active()`` and never read the environment or probe the build themselves. Every decision that picks an
implementation lives on ``KernelSelection`` (``panels``, ``onednn_prepack``, ``gemv_max_rows``, ...), and
``implementations`` describes the outcome per op kind from the same methods, for the start-up report
(``report``) and ``openinfer env``.

What remains per call in the op wrappers (``cpu_ops.py``) is a shape / dtype / layout check: a kernel that was
chosen declines an input it does not take (a GPU tensor, a dtype mix, a strided view) and the layer runs torch for
that call. That is a property of the input, not of the machine, and is the same on every host.

Outside an engine (tests, scripts calling layers directly) no selection is active: ``active()`` then builds one
from ``KernelConfig.from_env()`` for the CPU, re-read when the environment switches change, so a test that sets
``OPENINFER_CPU_KERNELS=0`` around a layer call gets the torch path.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import platform as _platform
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from openinfer import envs
from openinfer.config import KernelConfig
from openinfer.layers import kernel_build
from openinfer.layers.kernel_build import KernelBuildError
from openinfer.platform import cpu_has_fast_bf16, cpu_info

logger = logging.getLogger(__name__)

__all__ = ["KernelBuildError", "KernelSelection", "active", "isa_summary", "report", "select", "use"]

# the GGUF int8 kernel's integer dot product per KernelSelection.gguf_int_dot
_INT_DOTS = {3: "AVX512-VNNI", 2: "AVX-VNNI", 1: "AVX2 maddubs", 0: "portable"}

# Up to this many activation rows a plain fp32 weight runs the gemv kernel (it matches or beats oneDNN up to 8:
# layers/linear.py's table); bf16 without native bf16 runs it at every M.
GEMV_MAX_M = 8


def isa_summary() -> str:
    """The CPU's vector / matrix extensions that the kernels use, e.g. ``AVX2 + FMA + F16C (no AVX-512, AMX)``."""
    flags = cpu_info()[1]
    names = [("avx2", "AVX2"), ("fma", "FMA"), ("f16c", "F16C"), ("avx512f", "AVX-512"),
             ("avx512_vnni", "AVX512-VNNI"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16"),
             ("amx_int8", "AMX-INT8"), ("asimd", "NEON"), ("sve", "SVE")]
    have = [label for flag, label in names if flag in flags]
    lacking = [label for flag, label in names if flag in ("avx512f", "avx512_bf16", "amx_bf16") and flag not in flags]
    text = " + ".join(have) or "no SIMD extensions the kernels use"
    return text + (f" (no {', '.join(lacking)})" if lacking and _platform.machine() in ("x86_64", "AMD64") else "")


@dataclass(frozen=True)
class KernelSelection:
    """What runs, decided once. ``ops`` is the built kernel namespace, None on the torch backend."""

    config: KernelConfig
    device_type: str
    backend: str  # resolved: "cpu" (the C++ kernels) or "torch"
    ops: object | None = None
    build: str = ""  # one line for the report: built / cached / not built and why
    build_isa: str = ""  # the kernels' build: "AVX-512" (16 lanes) or "AVX2" (8), "" when not built
    amx: bool = False  # the decode attention kernels run AMX tiles
    # the GGUF int8 kernel's integer dot product in this build (gguf_q8_gemm.cpp): 3 AVX512-VNNI, 2 AVX-VNNI,
    # 1 AVX2 maddubs, 0 a portable loop; -1 not built
    gguf_int_dot: int = -1
    fast_bf16: bool = False  # the CPU has bf16 matrix hardware (oneDNN's AMX / AVX512-BF16 GEMMs)
    cpu_amx: bool = False  # ... and it is AMX tiles (amx_bf16)
    # the build's bf16 routed-expert kernel has AVX512-BF16 dot products (moe_gemv.cpp); used when bf16_dot is on
    bf16_dot_built: bool = False
    # the build has the AVX512-BF16 pair-panel GEMM (pair_panel_gemm.cpp) for MLA's absorbed decode
    pair_panels_built: bool = False

    @property
    def kernels(self) -> bool:
        return self.ops is not None

    # -- the decisions ------------------------------------------------------------------------------------------
    def panels(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Weights that are only multiplied go into the 16-column panel layout (``Linear``'s prepacking, MLA's
        absorbed W_UK / W_UV, fp32 routed experts): fp32, or bf16 on a CPU without native bf16 (with it oneDNN's
        AMX / AVX-512 BF16 GEMM stays)."""
        if not (self.kernels and self.config.panels and self.config.prepack) or device.type != "cpu":
            return False
        return dtype == torch.float32 or (dtype == torch.bfloat16 and not self.fast_bf16)

    def pair_panels(self, device: torch.device, dtype: torch.dtype) -> bool:
        """bf16 weights that are only multiplied go into AVX512-BF16 pair panels (``pair_panel_gemm.cpp``) instead
        of oneDNN's layout: on a native-bf16 CPU without AMX (Zen 4, Cooper Lake) whose build has the instruction,
        unless ``bf16_dot`` is off. There it matched oneDNN at 32-512 rows (350-360 GFLOP/s at 128-512 on a Zen 4),
        was 7-8 % slower at prefill chunks of 1024-2048 rows, and streamed the weights faster at 1-4 rows (18-26
        against 13-17 GB/s at batch 1): decode is the larger share of a serving step. AMX Xeons keep oneDNN, whose
        AMX tiles a prefill needs."""
        return (self.kernels and self.pair_panels_built and self.config.bf16_dot and self.config.prepack
                and device.type == "cpu" and dtype == torch.bfloat16 and self.fast_bf16 and not self.cpu_amx)

    def onednn_prepack(self, device: torch.device, dtype: torch.dtype) -> bool:
        """oneDNN's blocked weight layout where panels do not apply: CPU fp32 always, bf16 only where the CPU has
        native bf16 (elsewhere torch's bf16 GEMMs are emulated and slow whatever the layout) and pair panels do not
        take it. Needs no kernels."""
        if not self.config.prepack or device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        return dtype == torch.float32 or (dtype == torch.bfloat16 and self.fast_bf16
                                          and not self.pair_panels(device, dtype))

    def gemv_max_rows(self, dtype: torch.dtype) -> float:
        """Up to how many activation rows a plain (unpacked) weight runs the gemv kernel: 0 = never; bf16 without
        native bf16 at every M (it beats torch's emulated GEMM there)."""
        if not (self.kernels and self.config.gemv):
            return 0
        return math.inf if dtype == torch.bfloat16 and not self.fast_bf16 else GEMV_MAX_M

    @property
    def moe_bf16_dot(self) -> bool:
        """bf16 routed experts on vdpbf16ps (32 bf16 pairs per instruction, the activations kept bf16) rather than
        weights widened to fp32 and FMAs: where the build has AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids
        on), unless ``bf16_dot`` is off. Same roundings either way (bf16 products are exact in fp32); the sums'
        order differs. scripts/moe_experts_bandwidth.py measures the two (docs/results/moe_bf16_avx512)."""
        return self.kernels and self.bf16_dot_built and self.config.bf16_dot

    def mla_pair_panels(self, device: torch.device, dtype: torch.dtype) -> bool:
        """MLA's absorbed decode GEMMs (W_UK, W_UV per head) on AVX512-BF16 pair panels (``pair_panel_gemm.cpp``):
        bf16 on a CPU where the fp32-widening panels are off (native bf16) and the build has the instruction,
        unless ``bf16_dot`` is off (then torch.bmm, oneDNN). Summation order differs from bmm, nothing else."""
        return (device.type == "cpu" and dtype == torch.bfloat16 and self.kernels and self.pair_panels_built
                and self.config.bf16_dot and not self.panels(device, dtype))

    @property
    def decode_blocks(self) -> bool:
        return self.kernels and self.config.decode_blocks

    @property
    def gguf_int8(self) -> bool:
        """GGUF linears quantise their activations to int8 per 32 columns and run integer dot products
        (``gguf_q8_gemm.cpp``, llama.cpp's arithmetic) rather than fp32 FMAs on decoded weights: ``int8`` asked
        for, or ``auto`` where the build has a SIMD integer dot product (VNNI or AVX2; the portable loop is no
        faster than the fp32 one)."""
        mode = self.config.gguf_activations
        return self.kernels and (mode == "int8" or (mode == "auto" and self.gguf_int_dot >= 1))

    @property
    def gguf_int8_everywhere(self) -> bool:
        """llama.cpp's arithmetic on every GGUF linear: prefill rows too (from GGUF_TILE_ROWS, through the tile
        kernel ``gguf_q8_tiles.cpp``) and the logits head: only when ``int8`` is asked for. ``auto`` keeps prefill
        on decoded rows + an fp32 GEMM and the head on fp32 activations: with int8 there as well, SmolLM2's greedy
        answer to the README's question becomes llama.cpp's own (French, no "Paris"), as near-tied first tokens
        flip under activation rounding."""
        return self.gguf_int8 and self.config.gguf_activations == "int8"

    @property
    def fp8_packed(self) -> bool:
        return self.config.fp8_weights == "packed"

    @property
    def mxfp4_packed(self) -> bool:
        return self.config.mxfp4_experts == "packed"

    # -- the description ----------------------------------------------------------------------------------------
    def implementations(self, dtype: torch.dtype) -> list[tuple[str, str]]:
        """(op kind, what runs it) for a model computing in ``dtype``, from the decisions above."""
        dev = torch.device(self.device_type)
        k = self.kernels
        isa = f" ({self.build_isa})" if self.build_isa else ""
        dname = str(dtype).removeprefix("torch.")
        if self.panels(dev, dtype):
            dense = f"C++ 16-column panel GEMM{isa}"
        elif self.pair_panels(dev, dtype):
            dense = "C++ pair-panel GEMM on AVX512-BF16 dot products"
        elif self.onednn_prepack(dev, dtype):
            dense = "oneDNN, prepacked" + (" (AMX / AVX512-BF16)" if dtype == torch.bfloat16 else "")
        else:
            rows = self.gemv_max_rows(dtype)
            dense = ("torch F.linear" if not rows else
                     f"C++ gemv{isa} at every M" if rows == math.inf else f"C++ gemv{isa} up to {rows} rows, "
                     "then torch F.linear")
        attn_kernel = f"C++ paged decode{isa}" + (", AMX tiles for bf16" if self.amx else "")
        out = [
            (f"linear {dname}", dense),
            ("linear int8 / int4 / w8a8 / w4a8", f"C++ low-bit kernels{isa}" if k else
             "torch reference (dequantised per call)"),
            ("linear GGUF Q4_0/1, Q5_0/1, Q8_0, Q4/5/6_K",
             (f"C++ GGUF block kernels{isa}, packed, "
              + (f"int8 activations per 32 columns, {_INT_DOTS.get(self.gguf_int_dot, 'integer')} dots"
                 if self.gguf_int8 else "fp32 activations")
              + (" (prefill: int8 tiles; logits head: int8)" if self.gguf_int8_everywhere
                 else " (prefill: decoded row chunks + GEMM; logits head: fp32 activations)"))
             if k else
             "torch reference, packed (dequantised per call)"),
            ("linear fp8 (block)", "dequantised at load (dense path)" if not self.fp8_packed else
             f"C++ fp8 kernel{isa}, packed" if k else "torch reference, packed (dequantised per call)"),
            ("attention (paged)", (attn_kernel if k else "gather + SDPA") + "; prefill: SDPA"),
            ("MLA", (f"decode: C++ MLA decode{isa}" + (", AMX tiles for bf16" if self.amx else "")
                     + (", absorbed GEMMs on AVX512-BF16 pair panels" if self.mla_pair_panels(dev, dtype) else "")
                     + "; prefill: C++ (fp32) else SDPA") if k else "decode: torch bmm; prefill: SDPA"),
            ("MoE routed experts", (f"C++ expert GEMM on panels{isa}" if self.panels(dev, dtype) else
                                    "C++ expert kernel on AVX512-BF16 dot products" if dtype == torch.bfloat16
                                    and self.moe_bf16_dot else
                                    f"C++ expert gemv{isa} (small row counts), torch grouped_mm") if k else
             "torch grouped_mm"),
            ("MoE MXFP4 experts", "dequantised at load" if not self.mxfp4_packed else
             f"C++ MXFP4 kernel{isa}, packed" if k else "torch reference, packed"),
            ("MoE routing / combine", "C++ noaux_tc top-k, fused combine" if k else "torch"),
            ("norms / activation / RoPE", "C++ fused add + RMSNorm, SiLU * mul, rotary + cache write" if k else
             "torch"),
            ("DeepSeek-V4 sparse attention / indexer / mHC", "C++ kernels" if k else "torch"),
            ("greedy sampling", "C++ argmax in the logits' dtype" if k else "torch argmax"),
            ("decode blocks", "off: the layers' Python path" if not self.decode_blocks else
             "C++ fused decode layers (Llama, DeepSeek MLA + MoE)" if self.panels(dev, dtype) else
             f"on, but {dname} weights here are not in panels: only low-bit Llama linears take them"),
        ]
        if self.device_type != "cpu":
            out = [(kind, "torch (CUDA)") for kind, _ in out]
        return out


def select(config: KernelConfig, device: torch.device | str = "cpu") -> KernelSelection:
    """The selection for one engine: builds the CPU kernels when they are to be used. Raises ``KernelBuildError``
    when they were asked for (``cpu``) or should run here (``auto`` on a CPU with a C++ toolchain) and did not
    build."""
    device = torch.device(device)
    fast_bf16 = device.type == "cpu" and cpu_has_fast_bf16()
    base = dict(config=config, device_type=device.type, fast_bf16=fast_bf16,
                cpu_amx=device.type == "cpu" and "amx_bf16" in cpu_info()[1])
    if config.backend == "torch":
        return KernelSelection(backend="torch", build="not built: --kernel-backend torch", **base)
    if device.type != "cpu":
        if config.backend == "cpu":
            raise ValueError(f"kernel_backend='cpu' needs the CPU device, the engine runs on {device}")
        return KernelSelection(backend="torch", build=f"not used on {device.type}", **base)
    missing = kernel_build.toolchain()
    if missing and config.backend == "auto":
        logger.warning("no %s found: the CPU kernels cannot be built, every op runs its torch path (slower); "
                       "install g++ and ninja for them", missing)
        return KernelSelection(backend="torch", build=f"not built: no {missing} found", **base)
    try:
        built = kernel_build.build(config.cflags, config.cache_dir)
    except KernelBuildError as e:
        raise KernelBuildError(f"{e}. Fix the toolchain, or run with --kernel-backend torch (torch's own ops, "
                               f"slower){' and unset OPENINFER_KERNEL_CFLAGS' if config.cflags else ''}") from None
    ops = built.ops
    amx = bool(ops.decode_attention_use_amx(config.amx)) and config.amx
    ops.mla_decode_use_amx(config.amx)
    int_dot = int(ops.gguf_int_dot())
    bf16_dot_built = bool(ops.moe_bf16_dot())
    pair_panels_built = bool(ops.pair_panels_built())
    lanes = int(ops.vector_lanes())
    build_isa = {16: "AVX-512", 8: "AVX2"}.get(lanes, f"{lanes}-lane") if _platform.machine() in (
        "x86_64", "AMD64") else f"{lanes}-lane"
    flags = " ".join(f for f in built.cflags if f.startswith("-m"))
    return KernelSelection(backend="cpu", ops=ops, build_isa=build_isa, amx=amx, gguf_int_dot=int_dot,
                           bf16_dot_built=bf16_dot_built, pair_panels_built=pair_panels_built,
                           build=f"{built.how}, loaded in {built.seconds:.1f} s ({built.name}, {flags})", **base)


# -- the active selection ------------------------------------------------------------------------------------------

_active: contextvars.ContextVar[KernelSelection | None] = contextvars.ContextVar("openinfer_kernels", default=None)
_defaults: dict[tuple, KernelSelection] = {}  # the environment's kernel switches -> their selection


@contextlib.contextmanager
def use(selection: KernelSelection) -> Iterator[KernelSelection]:
    """Make ``selection`` what ``active()`` returns in this thread for the block (the model runner wraps its
    load and every step in it)."""
    token = _active.set(selection)
    try:
        yield selection
    finally:
        _active.reset(token)


def active() -> KernelSelection:
    """The engine's selection inside ``use``; elsewhere the one the environment switches give for the CPU."""
    sel = _active.get()
    if sel is not None:
        return sel
    key = envs.kernel_switches()  # cheap: a scripted layer call must not pay for a config per call
    sel = _defaults.get(key)
    if sel is None:
        sel = _defaults[key] = select(KernelConfig.from_env(), "cpu")
    return sel


# -- the report ----------------------------------------------------------------------------------------------------

def report(selection: KernelSelection, dtype: torch.dtype) -> str:
    """The start-up block: platform, kernel build, and what runs each op kind."""
    model = cpu_info()[0]
    lines = ["kernels:",
             f"  platform    {selection.device_type}: {model} ({_platform.machine()}), {isa_summary()}",
             f"  backend     {selection.backend} (--kernel-backend {selection.config.backend})",
             f"  build       {selection.build}"]
    if selection.device_type == "cpu":
        lines.append(f"  bf16        {'native (oneDNN AMX / AVX512-BF16)' if selection.fast_bf16 else 'emulated by torch: the kernels carry it'}")
    off = [name for name, on in (("panels", selection.config.panels), ("gemv", selection.config.gemv),
                                 ("prepack", selection.config.prepack),
                                 ("decode blocks", selection.config.decode_blocks), ("AMX", selection.config.amx),
                                 ("bf16 dot", selection.config.bf16_dot))
           if not on]
    if off:
        lines.append(f"  turned off  {', '.join(off)} (environment switches, openinfer/envs.py)")
    width = max(len(kind) for kind, _ in selection.implementations(dtype))
    lines += [f"  {kind.ljust(width)}  {impl}" for kind, impl in selection.implementations(dtype)]
    return "\n".join(lines)
