"""Build a tiny random-weight Llama and a byte-level BPE tokenizer, offline and deterministic.

Run with the engine venv's python (``devkit.devengine build-model tiny``). The output is
gibberish by design: it exercises the engine's machinery (scheduling, KV blocks, streaming,
aborts) at thousands of tokens per second on two CPU cores.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch  # type: ignore[import-not-found, unused-ignore]
from tokenizers import (  # type: ignore[import-not-found, unused-ignore]
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    trainers,
)
from transformers import (  # type: ignore[import-not-found, unused-ignore]
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

SEED = 0
VOCAB_SIZE = 1024
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
# ChatML, as SmolLM2 and many instruct models use; vLLM's continue_final_message needs the
# final message's content to appear verbatim in the rendered prompt, which ChatML satisfies.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS_TEXT = (
    "the a an of to in for on with at by from as and or but not is are was were be been "
    "batch queue token tokens cache block blocks slack reserve lease engine worker item job "
    "deadline prompt output request requests model summary summarise text line file result "
    "priority interactive capacity pool memory server client stream chunk abort resume "
    "time first last next every each some many few more less all none one two three four "
    "five six seven eight nine ten hundred thousand quick brown fox jumps over lazy dog "
    "data value number list table record field name user system assistant message reply "
    "please write short long answer question why how what when where which who this that "
    "these those it its they them their we our you your he she his her make made run ran "
    "good bad new old big small high low fast slow early late open close start stop done"
)
_WORDS = _WORDS_TEXT.split()
_PUNCT = (".", ".", ".", ",", "?", "!", ":", ";")


def corpus(lines: int = 6000) -> list[str]:
    """Deterministic pseudo-English with digits, punctuation, code-ish and non-ASCII bits, so
    merges cover what tests send (byte-level BPE still encodes any byte)."""
    rng = random.Random(SEED)
    out: list[str] = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 100_000)))
        if rng.random() < 0.1:
            words.append(rng.choice(["déjà", "naïve", "café", "→", "{x: 1}", "f(x)", "a_b"]))
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice(_PUNCT))
        if i % 7 == 0:
            out.append("")
    return out


def build_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=PAD,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        # One KV head (GQA) so a capacity check can tell kv heads from attention heads.
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    if len(tokenizer) != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {len(tokenizer)} tokens, expected {VOCAB_SIZE}")
    model = build_model(tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out)
    model.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"tiny model: {params} parameters, vocab {len(tokenizer)}, saved to {args.out}")


if __name__ == "__main__":
    main()
