"""A small byte-level BPE tokenizer trained locally, for models built from scratch (`policy.build`) and tests.

No hub downloads are possible on the project's machines, so a run that builds a random model (without the arith
task's character tokenizer, mrl.data.arith) trains this tokenizer on a fixed corpus with the `tokenizers` library:
deterministic, ~0.1 s, a ChatML chat template.
"""

from __future__ import annotations

from pathlib import Path

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
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, bos_token=IM_START
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out)
    return out
