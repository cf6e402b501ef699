"""A CPU model's weights collapsed into 2 MiB transparent huge pages after load (worker/huge_pages.py)."""
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from openinfer.worker import huge_pages as hp

M = 1 << 20
H = hp.HUGE_PAGE


def thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def huge_page_bytes(lo: int, hi: int) -> int:
    """How much of the mappings overlapping [lo, hi) /proc/self/smaps says is in anonymous huge pages."""
    total, cur = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                cur = (start, end) if start < hi and end > lo else None
            elif cur is not None and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def test_spans_join_neighbours_inside_their_mapping_and_keep_whole_huge_pages():
    mapping = (100 * H, 120 * H)
    # three weights side by side (small gaps), one far away, one in no mapping
    ranges = [(100 * H + 4096, 101 * H + 8192), (101 * H + 12288, 103 * H + 5), (103 * H + 4096, 104 * H + 100),
              (110 * H + 10, 112 * H + 20), (200 * H, 210 * H)]
    spans = hp.huge_page_spans(ranges, [mapping])
    assert spans == [(101 * H, 104 * H), (111 * H, 112 * H)]
    assert all(a % H == 0 and b % H == 0 and mapping[0] <= a < b <= mapping[1] for a, b in spans)
    # a weight running past its mapping's end is cut there
    assert hp.huge_page_spans([(118 * H + 1, 125 * H)], [mapping]) == [(119 * H, 120 * H)]
    assert hp.huge_page_spans([(100 * H + 1, 100 * H + 4096)], [mapping]) == []  # no whole huge page


class _Packed:
    """A quantized weight kept outside parameters (as GGUF and int8 linears keep theirs)."""

    def __init__(self, data):
        self.data = data
        self.parts = [data[: data.numel() // 2]]


def test_collector_finds_parameters_buffers_and_packed_weights():
    lin = nn.Linear(512, 512)  # 1 MiB weight
    lin.register_buffer("table", torch.zeros(64 << 10, dtype=torch.uint8))
    lin._quant = _Packed(torch.zeros(2 * M, dtype=torch.uint8))
    ranges = hp.weight_ranges([nn.Sequential(lin)])
    ptrs = {lo for lo, _ in ranges}
    assert {lin.weight.data_ptr(), lin.table.data_ptr(), lin._quant.data.data_ptr()} <= ptrs
    assert lin.bias.data_ptr() not in ptrs  # 2 KiB: under MIN_STORAGE
    assert len(ranges) == len(ptrs)  # the part shares its storage: counted once


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() in (None, "never"),
                    reason="transparent huge pages: Linux with THP not 'never'")
def test_weights_land_in_huge_pages_with_their_values():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 768, bias=False) for _ in range(8)])  # 3 MiB each, 24 MiB in all
    before = [m.weight.detach().clone() for m in model]
    lo = min(m.weight.data_ptr() for m in model)
    hi = max(m.weight.data_ptr() + m.weight.untyped_storage().nbytes() for m in model)
    moved = hp.weights_to_huge_pages(model)
    if moved == 0:
        pytest.skip("the kernel refused MADV_COLLAPSE (older than 6.1, or no huge page free)")
    assert moved >= 8 * M
    assert huge_page_bytes(lo, hi) >= moved
    assert all(torch.equal(m.weight, b) for m, b in zip(model, before))


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() in (None, "never"),
                    reason="transparent huge pages: Linux with THP not 'never'")
def test_the_engine_puts_a_cpu_models_weights_in_huge_pages(tmp_path, monkeypatch, caplog):
    from helpers import make_dense_checkpoint

    from openinfer import LLM, SamplingParams

    ckpt = make_dense_checkpoint(tmp_path / "m", vocab_size=4096, hidden_size=512, intermediate_size=1024)
    for switch in ("1", "0"):
        monkeypatch.setenv("OPENINFER_HUGE_PAGES", switch)
        caplog.clear()
        with caplog.at_level("INFO", logger="openinfer.worker.huge_pages"):
            llm = LLM(str(ckpt), dtype="float32", max_model_len=64, num_kv_blocks=8)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
        said = [r.getMessage() for r in caplog.records if "huge pages" in r.getMessage()]
        if switch == "0":
            assert said == []  # the switch turns it off
        elif not said or said[0].startswith("weights in huge pages: 0 MiB"):
            pytest.skip(f"the kernel refused MADV_COLLAPSE: {said}")
        else:
            emb = llm.engine.core.executor.driver_worker.model_runner.model.model.embed_tokens.weight
            assert huge_page_bytes(emb.data_ptr(), emb.data_ptr() + emb.untyped_storage().nbytes()) > 0
        del llm
