"""Loading tokenizers (`load_tokenizer`, with the one workaround for a transformers bug), and a small byte-level
BPE tokenizer trained locally, for models built from scratch (`policy.build`) and tests.

No hub downloads are possible on the project's machines, so a run that builds a random model (without the arith
task's character tokenizer, mrl.data.arith) trains this tokenizer on a fixed corpus with the `tokenizers` library:
deterministic, ~0.1 s, a ChatML chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: Special tokens of the tiny tokenizer, in id order (ids 0, 1, 2).
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

#: ChatML-style template: `<|im_start|>role\ncontent<|im_end|>\n` per message, optional generation prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


#: Files that hold a tokenizer's vocabulary (fast, BPE, WordPiece, SentencePiece, tiktoken); config files alone do not.
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "merges.txt")
VOCABULARY_SUFFIXES = (".model", ".tiktoken")


def vocabulary_files(folder: str | Path) -> list[str]:
    """The vocabulary files in `folder`: none means no tokenizer, although transformers 5 then builds one anyway (an
    empty one of a single token, from tokenizer_config.json or config.json alone) and the error comes later, blaming
    something else (the chat template, the EOS token, or nothing: a loss of 0)."""
    return sorted(
        p.name
        for p in Path(folder).iterdir()
        if p.is_file() and (p.name in VOCABULARY_FILES or p.suffix in VOCABULARY_SUFFIXES)
    )


def load_tokenizer(name_or_path: str | Path) -> Any:
    """`AutoTokenizer.from_pretrained`, except for a tokenizer that transformers 5 silently breaks.

    Workaround (transformers 5.x, huggingface/transformers#45488 and #48206, open): a tokenizer whose config names
    `LlamaTokenizerFast` but whose tokenizer.json is byte-level BPE (DeepSeek-V3/R1, their distills) is loaded as
    `LlamaTokenizer`, which replaces the file's ByteLevel pre-tokenizer and decoder with SentencePiece's Metaspace:
    spaces vanish when encoding ("hello world" -> 3 wrong ids instead of 2) and when decoding. Such a tokenizer is
    loaded again as a plain `PreTrainedTokenizerFast` (TokenizersBackend), which runs tokenizer.json as written and
    keeps the special tokens and the chat template. Tested in tests/unit/data (and with the real DeepSeek-V3
    tokenizer in tests/real).

    The same bug's other face: a tokenizer whose config names the plain backend (`TokenizersBackend`, what
    `PreTrainedTokenizerFast.save_pretrained` writes, e.g. mrl's character tokenizer of the arithmetic task) beside a
    config.json of a model family (qwen2) is loaded as that family's class (`Qwen2Tokenizer`), whose own
    pre-tokenizer replaces the file's. Where that loses the spaces the file keeps ("1 - 7 =" -> "1-7="), it is loaded
    as the plain backend too; where it only splits differently and loses nothing (mrl's tiny BPE tokenizer), it is
    left as transformers loads it, which is how vLLM and a user's transformers load it too."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
    folder = Path(name_or_path)
    if _declares_byte_level(folder) and "ByteLevel" not in repr(_backend(tokenizer)):
        return PreTrainedTokenizerFast.from_pretrained(str(name_or_path))
    replaced = _declared_class(folder) == PLAIN_BACKEND and type(tokenizer).__name__ != PLAIN_BACKEND
    if replaced and not _keeps_spaces(tokenizer):
        as_written = PreTrainedTokenizerFast.from_pretrained(str(name_or_path))
        if _keeps_spaces(as_written):
            return as_written
    return tokenizer


def _keeps_spaces(tokenizer: Any) -> bool:
    """Whether "1 1" comes back from encoding and decoding with its space."""
    return tokenizer.decode(tokenizer("1 1", add_special_tokens=False)["input_ids"]) == "1 1"


#: The class name transformers 5 gives `PreTrainedTokenizerFast` (and writes as a saved tokenizer's class).
PLAIN_BACKEND = "TokenizersBackend"


def _declared_class(folder: Path) -> str | None:
    """The tokenizer class tokenizer_config.json names (None without one)."""
    file = folder / "tokenizer_config.json"
    if not file.is_file():
        return None
    return json.loads(file.read_text(encoding="utf-8")).get("tokenizer_class")


def _backend(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return (backend.pre_tokenizer, backend.decoder) if backend is not None else None


def _declares_byte_level(folder: Path) -> bool:
    """Whether the folder's tokenizer.json decodes byte-level BPE (its decoder is, or contains, ByteLevel)."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return False
    return "ByteLevel" in json.dumps(json.loads(file.read_text(encoding="utf-8")).get("decoder"))


def _corpus() -> list[str]:
    """A small fixed corpus: English filler, arithmetic and digits, so numbers tokenize sensibly."""
    lines = [f"The quick brown fox jumps over the lazy dog number {i}." for i in range(300)]
    lines += [f"Question: what is {i} plus {i + 7}? Answer: {2 * i + 7}" for i in range(300)]
    lines += [f"{a}+{b}={a + b}" for a in range(0, 100, 7) for b in range(0, 100, 11)]
    return lines


def build_tokenizer(out_dir: str | Path, *, vocab_size: int = 500) -> Path:
    """Train a byte-level BPE tokenizer and save it as a `PreTrainedTokenizerFast` in `out_dir`.

    eos = pad = `<|endoftext|>` (id 0), bos = `<|im_start|>` (id 1), with a ChatML chat template.
    `vocab_size` is an upper bound (the trainer stops when the corpus has no more merges); 500 is deliberately not
    a multiple of 128 so that Megatron vocab padding is exercised by default.
    Returns `out_dir`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, bos_token=IM_START)
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out)
    return out
