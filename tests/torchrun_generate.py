"""Run under torchrun by tests/test_torchrun.py: every rank runs the engine on the same prompts; each writes the
greedy tokens it got to OUT.rank<r>.json."""
import faulthandler
import json
import os
import sys

from openinfer import LLM, SamplingParams

# A hang shows where every rank waits (the test gives up at 240 s).
faulthandler.dump_traceback_later(150, exit=True)

model, out, tp, dp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompts = [[5, 6, 7, 8, 9], list(range(10, 44)), [77] * 17]
llm = LLM(model, dtype="float32", tensor_parallel_size=tp, data_parallel_size=dp,
          distributed_executor_backend="external_launcher", kv_cache_memory_gb=0.02)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
with open(f"{out}.rank{os.environ['RANK']}.json", "w") as f:
    json.dump([o.outputs[0].token_ids for o in outs], f)
llm.engine.shutdown()
