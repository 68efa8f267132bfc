#!/usr/bin/env python3
"""Make the tokenizer test data with Hugging Face `tokenizers` as the reference implementation.

Writes into tests/data/ (or --out):
  tokenizer.json         byte-level BPE, 2048 trained tokens, configured like Qwen2/Qwen3's file:
                         NFC normalizer, Split(Qwen regex, Isolated) + ByteLevel(use_regex=False),
                         ByteLevel decoder, specials <|endoftext|> <|im_start|> <|im_end|> after the
                         trained vocab.
  tokenizer_llama3.json  1024 trained tokens, no normalizer, Llama-3's split regex, BPE with
                         ignore_merges (as Llama-3's file has), merges written as "a b" strings,
                         <|begin_of_text|> <|end_of_text|>, and a TemplateProcessing
                         post-processor that prepends <|begin_of_text|>.
  tokenizer_flags.json   tokenizer.json plus added tokens that use lstrip, rstrip, single_word
                         and normalized, to check how added tokens are matched.
  tokenizer_cases.json   [{"tokenizer", "text", "ids", "decoded"}]: ids from
                         encode(text, add_special_tokens=True), decoded from
                         decode(ids, skip_special_tokens=False); "decoded_skip_special" adds the
                         skip_special_tokens=True form.
  tokenizer_decode_cases.json  [{"tokenizer", "ids", "skip_special", "decoded"}]: decode of id
                         sequences that encode never produces (tokens cut inside a UTF-8 character,
                         random ids), to pin down U+FFFD replacement.

Both tokenizers are trained on the question and answer text of GSM8K train, read in file order;
the corpus and the random strings are fixed by a seed, so the output is the same on every run.
Another script can call main(["--out", dir]) after putting scripts/ on sys.path.
"""

import argparse
import json
import os
import random
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers
from tokenizers import AddedToken

QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_gsm8k(path):
    texts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            row = json.loads(line)
            texts.append(row["question"])
            texts.append(row["answer"])
    return texts


def build_tokenizer(texts, vocab_size, pattern, nfc, specials, ignore_merges, bos=None):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    # Specials go after the trained vocab, as in Qwen's and Llama-3's files.
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    return tok


# Qwen's file spells its ByteLevel decoder and post-processor (the latter adds no tokens) with
# every flag off; the Python constructors do not take all of these, so they are set in the JSON.
QWEN_BYTE_LEVEL = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": False,
    "use_regex": False,
}


def save(tok, path, qwen_style, merges_as_strings):
    """Write tok to path, adjusted to match the published files: Qwen's ByteLevel flags, and
    merges either as [a, b] lists (what tokenizers writes today) or as "a b" strings (what most
    published files still hold); the C loader reads both."""
    d = json.loads(tok.to_str())
    if qwen_style:
        d["decoder"] = dict(QWEN_BYTE_LEVEL)
        d["post_processor"] = dict(QWEN_BYTE_LEVEL)
    if merges_as_strings:
        d["model"]["merges"] = [" ".join(m) for m in d["model"]["merges"]]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(d, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


def random_strings(rng, n):
    """Random strings over code points that stress the byte-level path: controls, Latin-1,
    combining marks, surrogate-free BMP, astral planes, and the private use area."""
    ranges = [
        (0x01, 0x1F),
        (0x20, 0x7E),
        (0x7F, 0xFF),
        (0x300, 0x36F),
        (0x370, 0x3FF),
        (0x400, 0x4FF),
        (0x600, 0x6FF),
        (0x900, 0x97F),
        (0x2000, 0x206F),
        (0x3000, 0x30FF),
        (0x4E00, 0x9FFF),
        (0xAC00, 0xD7A3),
        (0xE000, 0xF8FF),
        (0xFFF0, 0xFFFD),
        (0x1F300, 0x1FAFF),
        (0x10000, 0x10FFFF),
    ]
    out = []
    for _ in range(n):
        length = rng.randint(1, 24)
        chars = []
        for _ in range(length):
            lo, hi = rng.choice(ranges)
            cp = rng.randint(lo, hi)
            if 0xD800 <= cp <= 0xDFFF:
                cp = 0xFFFD
            chars.append(chr(cp))
        out.append("".join(chars))
    return out


def corpus(gsm8k_texts, rng):
    cases = []
    # Plain GSM8K sentences (fixed positions, so the same on every run).
    for i in (0, 1, 2, 3, 100, 1001, 5000, 9999, 14000):
        if i < len(gsm8k_texts):
            cases.append(gsm8k_texts[i])
    cases += [
        "",
        " ",
        "a",
        "Hello world",
        "Hello, world! How are you today?",
        "The answer is #### 72",
        # Unicode: accents, NFC vs NFD, scripts.
        "café naïve résumé",
        "cafe\u0301",
        "e\u0301",
        "\u00e9",
        "A\u030a ring and \u212b angstrom",
        "\uac00\u1100\u1161 Hangul jamo",
        "中文字符测试，你好世界。",
        "日本語のテキストです。カタカナ",
        "한국어 텍스트",
        "مرحبا بالعالم",
        "Привет, мир! Ёжик",
        "Γειά σου Κόσμε αβγ",
        "हिन्दी पाठ",
        "ﬁ ligature and ｆｕｌｌｗｉｄｔｈ",
        # Emoji, ZWJ sequences, flags, skin tones, keycaps.
        "😀",
        "I love 🍕 and 🎉!",
        "👨\u200d👩\u200d👧\u200d👦 family",
        "🇺🇸🇫🇷🇯🇵",
        "👍🏽 thumbs",
        "1\ufe0f\u20e3 keycap",
        "🏳\ufe0f\u200d🌈",
        # Whitespace.
        "a  b   c    d",
        "     leading spaces",
        "trailing spaces     ",
        "tab\tseparated\tvalues",
        "\t\t\tindented",
        "line1\nline2\n\nline4",
        "windows\r\nline\r\nendings\r\n",
        "mixed \t \n \r\n  \n\t end",
        "\n\n\n",
        "   \n   ",
        "trailing newline\n",
        "x \n y",
        "\u00a0non-breaking\u00a0space\u3000ideographic",
        "\u2028line sep\u2029para sep\u0085next line",
        "\x0bvertical\x0cform feed",
        # Digits.
        "0",
        "12345678901234567890",
        "3.14159 and 2,718,281",
        "$1,000,000.00",
        "48/2 = <<48/2=24>>24",
        "١٢٣ Arabic-Indic digits ٤٥٦",
        "½ ¼ ² ³ Ⅻ",
        "x1y22z333w4444",
        # Contractions.
        "don't won't can't",
        "DON'T WON'T CAN'T",
        "they'll we've I'm she's it'd you're",
        "THEY'LL WE'VE I'M SHE'S IT'D YOU'RE",
        "They'Ll wE'Ve",
        "'s 't 're",
        "rock 'n' roll",
        # Punctuation.
        "!!!???...",
        "a+b=c; d-e*f/g",
        "(((nested))) [[brackets]] {{braces}}",
        "email@example.com http://x.y/z?q=1&r=2",
        "--- *** ___ ===",
        "''''\"\"\"```",
        "end.\n\n---\n",
        # Special tokens in text.
        "<|im_start|>user\nhi<|im_end|>",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n",
        "<|endoftext|>",
        "a<|endoftext|>b",
        "<|endoftext|><|endoftext|>",
        "<|im_start|",
        "< |im_start|>",
        "<|begin_of_text|>Hello<|end_of_text|>",
        "text <|begin_of_text|> more",
        # Outside the training data.
        "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich",
        "∀x∈ℝ: x²≥0 ∑∫∂√∞",
        "ᚠᛇᚻ᛫ᛒᛦᚦ runes",
        "\U0001d400\U0001d401 math bold",
        "\U00010348 gothic",
        "\ue000\uf8ff private use",
        "\ufeffBOM at start",
        "zero\u200bwidth\u200cjoiner\u200d",
        "\x01\x02\x03\x1f\x7f controls",
        "\u0080\u0081\u009f C1 controls",
        "\ufffd replacement char",
        "\U0010ffff last code point",
        # Where regex engines and Unicode versions can disagree: U+180E is not White_Space
        # (PCRE2's \s takes it, so "x  \u180eabc" splits differently unless \s is rewritten),
        # long s and Kelvin sign fold to s and k under (?i), letters and emoji newer than some
        # Unicode tables, NEL, and stacked combining marks that NFC reorders.
        "a\u180e b",
        "x  \u180eabc",
        "  \u180e1",
        "IT'\u017f it'S I'M he'\u212a",
        "\U00011f04\U00011f05 kawi \U0001fae8 shaking",
        "x\u0085y \u0085 z\u0085",
        "\u1e9e\u00df \u0149 \u0344 \u0f73\u0f75",
        "a\u0301\u0323 vs a\u0323\u0301",
        "\u2066\u2069 isolates \U000e0001\U000e0067 tags",
        "A" * 300,
        "ab" * 150,
        " " * 64,
        "word " * 40,
    ]
    cases += random_strings(rng, 16)
    return cases


FLAG_TEXTS = [
    "a <mask> b",
    "a   \t<mask>b",
    "<mask> at start",
    "x[SEP]   y",
    "x [SEP]\n\n  y [SEP]",
    "hello world",
    "say hello",
    "hellohello",
    "ahello hello!",
    "\u00e9hello hello\u00e9",
    "hello_there (hello)",
    "caf\u00e9 caf\u00e9s",
    "cafe\u0301 and CAF\u00c9",
    "<ab><abc><abcd>",
    "<a<ab>>",
    "  <mask>  [SEP]  hello  ",
    "<|im_start|>hello<|im_end|>",
]


def decode_id_cases(tok, rng, name, n_random=24):
    """Id sequences whose bytes may not be valid UTF-8: single tokens of the byte alphabet that
    are lone UTF-8 lead or continuation bytes, emoji cut after some of their bytes, and random
    ids (added tokens included)."""
    vocab_n = tok.get_vocab_size(with_added_tokens=True)
    byte_tok = {}
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2 byte-to-unicode table, to find the id of each single-byte token.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    for b, c in zip(bs, cs):
        assert chr(c) in alphabet
        byte_tok[b] = tok.token_to_id(chr(c))
    seqs = [
        [byte_tok[0xE4]],
        [byte_tok[0x80]],
        [byte_tok[0xF0], byte_tok[0x9F], byte_tok[0x98]],
        [byte_tok[0xF0], byte_tok[0x9F], byte_tok[0x98], byte_tok[0x80]],
        [byte_tok[0x41], byte_tok[0xC3], byte_tok[0x42]],
        [byte_tok[0xE2], byte_tok[0x82], byte_tok[0x41]],
        [byte_tok[0xED], byte_tok[0xA0], byte_tok[0x80]],
        [byte_tok[0xC0], byte_tok[0xAF]],
        [byte_tok[0xF4], byte_tok[0x90], byte_tok[0x80], byte_tok[0x80]],
        [byte_tok[0xFF], byte_tok[0xFE]],
        [byte_tok[0xE0], byte_tok[0x80], byte_tok[0x80]],
        [byte_tok[0xF0], byte_tok[0x90], byte_tok[0x41]],
    ]
    for _ in range(n_random):
        seqs.append([rng.randrange(vocab_n) for _ in range(rng.randint(1, 12))])
    out = []
    for ids in seqs:
        for skip in (False, True):
            out.append(
                {
                    "tokenizer": name,
                    "ids": ids,
                    "skip_special": skip,
                    "decoded": tok.decode(ids, skip_special_tokens=skip),
                }
            )
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--gsm8k",
        default=os.path.join(REPO_ROOT, "..", "shared", "data", "gsm8k", "train.jsonl"),
        help="GSM8K train.jsonl (default: ../shared/data/gsm8k/train.jsonl from the repo root)",
    )
    ap.add_argument("--out", default=os.path.join(REPO_ROOT, "tests", "data"))
    args = ap.parse_args(argv)

    texts = read_gsm8k(args.gsm8k)
    os.makedirs(args.out, exist_ok=True)
    toks = {
        "tokenizer.json": build_tokenizer(
            texts, 2048, QWEN_PATTERN, True, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            ignore_merges=False,
        ),
        "tokenizer_llama3.json": build_tokenizer(
            texts, 1024, LLAMA3_PATTERN, False, ["<|begin_of_text|>", "<|end_of_text|>"],
            ignore_merges=True, bos="<|begin_of_text|>",
        ),
    }
    save(toks["tokenizer.json"], os.path.join(args.out, "tokenizer.json"), True, False)
    save(toks["tokenizer_llama3.json"], os.path.join(args.out, "tokenizer_llama3.json"), False, True)

    # A copy of the Qwen-style file with added tokens that use every matching flag.
    flags = Tokenizer.from_str(toks["tokenizer.json"].to_str())
    flags.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True, normalized=False)])
    flags.add_special_tokens([AddedToken("[SEP]", rstrip=True, special=True, normalized=False)])
    flags.add_tokens([AddedToken("hello", single_word=True, normalized=False)])
    flags.add_tokens([AddedToken("caf\u00e9", normalized=True)])
    flags.add_tokens([AddedToken("<ab>", normalized=False)])
    flags.add_tokens([AddedToken("<abc>", normalized=False)])
    save(flags, os.path.join(args.out, "tokenizer_flags.json"), True, False)

    cases = []
    decode_cases = []
    for name in list(toks) + ["tokenizer_flags.json"]:
        # Reload from the written file so the cases come from exactly what the C side reads.
        tok = Tokenizer.from_file(os.path.join(args.out, name))
        rng = random.Random(1234)
        texts_for = corpus(texts, rng) if name in toks else FLAG_TEXTS
        for text in texts_for:
            ids = tok.encode(text, add_special_tokens=True).ids
            cases.append(
                {
                    "tokenizer": name,
                    "text": text,
                    "ids": ids,
                    "decoded": tok.decode(ids, skip_special_tokens=False),
                    "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
                }
            )
        if name in toks:
            decode_cases += decode_id_cases(tok, random.Random(99), name)
    with open(os.path.join(args.out, "tokenizer_cases.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=True, indent=0)
        f.write("\n")
    with open(os.path.join(args.out, "tokenizer_decode_cases.json"), "w", encoding="utf-8") as f:
        json.dump(decode_cases, f, ensure_ascii=True, indent=0)
        f.write("\n")
    print(f"wrote {len(cases)} encode cases and {len(decode_cases)} decode cases to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
