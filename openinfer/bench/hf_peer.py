"""HF transformers as the reference peer: ``AutoModelForCausalLM.generate``, same checkpoint and prompts.

Run the way cpu_peers.md measured it: equal-length prompts stacked into one [B, L] tensor (no padding, so
no attention-mask work that openinfer would not do either), greedy, ``min_new_tokens == max_new_tokens`` so
EOS cannot end a row early, default dynamic KV cache, eager attention defaults of the installed version.
"""
from __future__ import annotations

import logging
import time

import torch

from openinfer.bench.results import IterationSample
from openinfer.platform import tune_malloc

logger = logging.getLogger(__name__)


class _FirstTokenClock:
    """A stopping criterion that never stops; ``generate`` calls it right after each new token, so its
    first call time is the batch's time to first token (prefill + first sample), measured the same way as
    openinfer's TTFT (from submission)."""

    def __init__(self) -> None:
        self.first_s: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if self.first_s is None:
            self.first_s = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class HFRunner:
    name = "hf"

    def __init__(self, model_path: str, dtype: torch.dtype, device: str = "cpu",
                 experts_implementation: str | None = None) -> None:
        from transformers import AutoModelForCausalLM, StoppingCriteriaList

        self._criteria_list = StoppingCriteriaList
        # the allocator settings openinfer's engine runs with (platform.py), so neither side gains from them
        self.malloc_tuning = tune_malloc() if device == "cpu" else False
        t0 = time.perf_counter()
        # Only MoE models take the kwarg; None leaves transformers' own default (grouped_mm in 5.22).
        extra = {"experts_implementation": experts_implementation} if experts_implementation else {}
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **extra).to(device).eval()
        self.experts_implementation = getattr(self.model.config, "_experts_implementation", None)
        self.load_time_s = time.perf_counter() - t0
        self.device = device
        self.dtype = dtype
        cfg = self.model.generation_config
        # Sampling knobs from the checkpoint's generation_config would only trigger "ignored when
        # do_sample=False" warnings; greedy needs none of them.
        for knob in ("temperature", "top_p", "top_k"):
            if hasattr(cfg, knob):
                setattr(cfg, knob, None)
        self.pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0

    def describe(self) -> dict:
        import transformers

        return {
            "runner": "transformers AutoModelForCausalLM.generate (e2e); forward loop with "
                      "past_key_values (decode mode)",
            "transformers": transformers.__version__,
            "experts_implementation": self.experts_implementation,
            "dtype": str(self.dtype).removeprefix("torch."),
            "sampling": "greedy (do_sample=False)",
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "load_time_s": self.load_time_s,
            "padding": "none: equal-length prompts in one [B, L] tensor",
            "malloc_tuning": self.malloc_tuning,
        }

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], output_len: int) -> IterationSample:
        input_ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        clock = _FirstTokenClock()
        t0 = time.perf_counter()
        out = self.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=output_len,
            min_new_tokens=output_len, do_sample=False, pad_token_id=self.pad_token_id,
            stopping_criteria=self._criteria_list([clock]),
        )
        self._sync()
        elapsed = time.perf_counter() - t0
        b, total = out.shape
        new = total - input_ids.shape[1]
        if new != output_len:
            raise RuntimeError(f"HF generated {new} tokens per row, expected {output_len}")
        ttft = None if clock.first_s is None else clock.first_s - t0
        return IterationSample(elapsed_s=elapsed, num_output_tokens=b * new,
                               num_input_tokens=input_ids.numel(), mean_ttft_s=ttft)

    @torch.inference_mode()
    def run_decode(self, prompts: list[list[int]], decode_steps: int) -> IterationSample:
        """Decode mode: one untimed prefill forward, then exactly ``decode_steps`` timed greedy steps, each
        one forward of the [B, 1] new tokens against ``past_key_values`` plus the argmax. A manual loop
        rather than ``generate``: it is the same per-step work (``generate`` runs this forward in its loop)
        without the prefill, which the timed window must exclude. Greedy argmax over all tokens, EOS
        included, as openinfer's ignore_eos samples, so both sides produce the same tokens."""
        input_ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        out = self.model(input_ids, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        window = []
        self._sync()
        t0 = time.perf_counter()
        for _ in range(decode_steps):
            out = self.model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            window.append(nxt)
        self._sync()
        elapsed = time.perf_counter() - t0
        self.last_window_tokens = torch.cat(window, dim=1).tolist()
        b, context = input_ids.shape
        return IterationSample(elapsed_s=elapsed, num_output_tokens=b * decode_steps, num_input_tokens=0,
                               kv_context=(context, context))

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def close(self) -> None:
        del self.model
