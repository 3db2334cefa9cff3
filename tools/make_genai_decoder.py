"""Make the tiny decoder that onnxruntime-genai's model builder writes, for the tests.

onnxruntime-genai's builder (``onnxruntime_genai.models.builder``) is the producer of most
GroupQueryAttention models people bring: it writes the attention mask chain that
``onnx_qrewrite/verify/attention_inputs.py`` follows (``seqlens_k`` and ``total_sequence_length``
computed from ``attention_mask``), the fused normalizations and, at ``-p int4``, MatMulNBits. This
script runs the builder itself, offline, on a Llama-shaped Hugging Face checkpoint it makes from a
local config with seeded random weights (no download), and writes the builder's ONNX model with its
weights inline (the builder writes them beside it, ``model.onnx.data``) plus a provenance file.

It needs onnxruntime-genai, torch and transformers, which the project's own environment does not
have (torch alone is several GB): run it in a separate one, e.g.

    python -m venv /tmp/genai && /tmp/genai/bin/pip install onnxruntime-genai==0.18.0 torch transformers
    /tmp/genai/bin/python tools/make_genai_decoder.py tests/data/genai

The output is checked in (tests/data/genai/, listed in its SHA256SUMS); tests read it and never
run this script. Float weights from torch's seeded generator and the builder's quantizer need not
give the same bytes on another machine or version: the provenance file records what made them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

#: The checkpoint's shape: 2 layers, 4 query heads of 16 over 2 key/value heads (GroupQueryAttention
#: needs a head size that is a multiple of 8), a vocabulary of 256 words.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}
SEED = 0
#: (output file stem, builder precision): float32 weights, and int4 MatMulNBits (block 32).
PRECISIONS = (("genai_llama_fp32", "fp32"), ("genai_llama_int4", "int4"))


def _checkpoint(folder: Path) -> None:
    """A Hugging Face checkpoint of CONFIG with torch's seeded random weights and a word-level
    tokenizer (the builder saves the tokenizer beside the model, so it must load one)."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    config = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
    config.architectures = CONFIG["architectures"]
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, CONFIG["vocab_size"])}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)


def _build(checkpoint: Path, precision: str, out: Path, cache: Path) -> Path:
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out)]
    command += ["-p", precision, "-e", "cpu", "-c", str(cache)]
    subprocess.run(command, check=True)
    return out / "model.onnx"


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("onnxruntime-genai", "onnxruntime", "torch", "transformers", "onnx")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for the models and provenance.json")
    args = parser.parse_args(argv)
    import onnx

    args.out.mkdir(parents=True, exist_ok=True)
    made = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "hf"
        _checkpoint(checkpoint)
        for stem, precision in PRECISIONS:
            built = _build(checkpoint, precision, Path(tmp) / stem, Path(tmp) / "cache")
            model = onnx.load(built)  # the external weights read in: one self-contained file
            target = args.out / f"{stem}.onnx"
            onnx.save(model, target)
            made[target.name] = {"precision": precision, "execution_provider": "cpu"}
    provenance = {
        "producer": "onnxruntime_genai.models.builder (python -m onnxruntime_genai.models.builder)",
        "command": "-i <checkpoint> -o <folder> -p <precision> -e cpu -c <cache>",
        "checkpoint": {
            "config": CONFIG,
            "weights": f"transformers LlamaForCausalLM(config), torch.manual_seed({SEED})",
        },
        "models": made,
        "versions": _versions(),
        "script": "tools/make_genai_decoder.py",
    }
    (args.out / "provenance.json").write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
