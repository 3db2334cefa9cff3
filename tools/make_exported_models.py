"""Make the two small float networks that tests/data/exported holds: exported by torch itself.

onnxruntime's quantizers and its transformers optimizer are the producers of most quantized and
fused models people bring, and what they are given is usually a framework's export, with that
exporter's graph shapes (the attention's Reshape/Transpose chains, the mask's arithmetic, the
LayerNormalization and Gelu forms, the folded batch norms). The tests quantize and fuse these two
exports in their fixtures (tests/test_exported_models.py) and check that every producer's output
is rewritten to standard ONNX and verified. The networks:

* ``encoder``: a bert-tiny-shaped transformer encoder written as Hugging Face's BertModel computes
  it (word, position and token-type embeddings + LayerNorm; 2 layers of 2-head self-attention over
  a hidden size of 64 with the additive mask (1 - mask) * -10000, residual + LayerNorm, a GELU
  feed-forward of 128), inputs ``input_ids``, ``token_type_ids``, ``attention_mask``
  (batch, sequence), output ``last_hidden_state``;
* ``cnn``: Conv/BatchNorm/ReLU/MaxPool twice, global average pooling, Linear, input ``x``
  (batch, 3, 16, 16), output ``logits`` (batch, 10).

Weights come from torch's seeded generator (``torch.manual_seed(0)`` before each network); the
batch norms' running statistics are drawn from it too, so that folding them is not a no-op. Exported
with ``torch.onnx.export(..., dynamo=False, opset_version=17)``, the TorchScript exporter (torch
2.13 still ships it, deprecated): onnxruntime.transformers' optimizer fuses its BERT graph into
EmbedLayerNormalization and Attention, where on the dynamo exporter's graph it finds only
SkipLayerNormalization and BiasGelu. ``--dynamo`` writes the dynamo exporter's forms instead
(opset 18, files ``*_dynamo.onnx``), for comparison; they are not checked in. Batch and sequence
axes dynamic, weights inline (one file each).

It needs torch, which the project's environment does not have: run it in a separate one, e.g.

    python -m venv /work/venv-torch
    /work/venv-torch/bin/pip install "torch==2.13.0" onnx onnxruntime onnxscript onnx-ir -c constraints.txt
    /work/venv-torch/bin/python tools/make_exported_models.py tests/data/exported
    (cd tests/data/exported && sha256sum *.onnx provenance.json > SHA256SUMS)

The output is checked in (tests/data/exported/, listed in its SHA256SUMS); tests read it and never
run this script. The same script and versions wrote the same bytes twice here; another machine or
torch version may not: provenance.json records what made them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path
from typing import Any

SEED = 0
OPSET = 17
#: The encoder's shape (bert-tiny is 2 layers, 2 heads, hidden 128; this is half as wide).
ENCODER = {"vocab": 64, "positions": 32, "types": 2, "hidden": 64, "heads": 2, "layers": 2, "ffn": 128}
#: The dynamo exporter's opset with --dynamo: at 17, onnx's version converter failed on its graph here.
DYNAMO_OPSET = 18


def _encoder(torch: Any) -> Any:
    """A BertModel-shaped encoder built from torch.nn, as Hugging Face's BertModel computes it."""
    nn = torch.nn
    c = ENCODER

    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query, self.key, self.value = (nn.Linear(c["hidden"], c["hidden"]) for _ in range(3))
            self.dense = nn.Linear(c["hidden"], c["hidden"])
            self.norm = nn.LayerNorm(c["hidden"], eps=1e-12)
            self.head = c["hidden"] // c["heads"]

        def _split(self, x: Any) -> Any:
            batch, seq = x.shape[0], x.shape[1]
            return x.view(batch, seq, c["heads"], self.head).permute(0, 2, 1, 3)

        def forward(self, x: Any, mask: Any) -> Any:
            q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head) + mask
            context = torch.matmul(torch.softmax(scores, dim=-1), v).permute(0, 2, 1, 3).contiguous()
            context = context.view(x.shape[0], x.shape[1], c["hidden"])
            return self.norm(self.dense(context) + x)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = SelfAttention()
            self.intermediate = nn.Linear(c["hidden"], c["ffn"])
            self.output = nn.Linear(c["ffn"], c["hidden"])
            self.norm = nn.LayerNorm(c["hidden"], eps=1e-12)

        def forward(self, x: Any, mask: Any) -> Any:
            h = self.attention(x, mask)
            return self.norm(self.output(nn.functional.gelu(self.intermediate(h))) + h)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.words = nn.Embedding(c["vocab"], c["hidden"])
            self.positions = nn.Embedding(c["positions"], c["hidden"])
            self.types = nn.Embedding(c["types"], c["hidden"])
            self.norm = nn.LayerNorm(c["hidden"], eps=1e-12)
            self.layers = nn.ModuleList(Layer() for _ in range(c["layers"]))
            self.register_buffer("position_ids", torch.arange(c["positions"]).unsqueeze(0), persistent=False)

        def forward(self, input_ids: Any, token_type_ids: Any, attention_mask: Any) -> Any:
            positions = self.position_ids[:, : input_ids.shape[1]]
            x = self.words(input_ids) + self.types(token_type_ids) + self.positions(positions)
            x = self.norm(x)
            mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
            for layer in self.layers:
                x = layer(x, mask)
            return x

    return Encoder().eval()


def _cnn(torch: Any) -> Any:
    """Conv/BatchNorm/ReLU/MaxPool twice, global average pooling, Linear: a small image classifier."""
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    with torch.no_grad():  # running statistics that are not the identity, so folding them matters
        for bn in (m for m in model if isinstance(m, nn.BatchNorm2d)):
            bn.running_mean.copy_(torch.randn(bn.num_features) * 0.1)
            bn.running_var.copy_(torch.rand(bn.num_features) + 0.5)
            bn.weight.copy_(torch.rand(bn.num_features) + 0.5)
            bn.bias.copy_(torch.randn(bn.num_features) * 0.1)
    return model.eval()


def _export(torch: Any, name: str, out: Path, dynamo: bool) -> dict[str, Any]:
    """Export one network; return what provenance.json records about it."""
    if name == "encoder":
        model = _encoder(torch)
        args = (
            torch.randint(0, ENCODER["vocab"], (2, 8)),
            torch.zeros(2, 8, dtype=torch.int64),
            torch.ones(2, 8, dtype=torch.int64),
        )
        inputs, outputs = ["input_ids", "token_type_ids", "attention_mask"], ["last_hidden_state"]
        dynamic = {n: {0: "batch", 1: "sequence"} for n in inputs} | {outputs[0]: {0: "batch", 1: "sequence"}}
    else:
        model = _cnn(torch)
        args = (torch.randn(1, 3, 16, 16),)
        inputs, outputs = ["x"], ["logits"]
        dynamic = {"x": {0: "batch"}, "logits": {0: "batch"}}
    opset = DYNAMO_OPSET if dynamo else OPSET
    path = out / f"exported_{name}{'_dynamo' if dynamo else ''}.onnx"
    # dynamic_axes: the dynamo exporter turns them into its dynamic_shapes (it warns, and does).
    extra = {"external_data": False} if dynamo else {}
    torch.onnx.export(
        model,
        args,
        str(path),
        dynamo=dynamo,
        opset_version=opset,
        input_names=inputs,
        output_names=outputs,
        dynamic_axes=dynamic,
        do_constant_folding=True,
        **extra,
    )
    exporter = "dynamo (torch.export)" if dynamo else "TorchScript"
    return {"exporter": exporter, "opset": opset, "inputs": inputs, "outputs": outputs, "dynamic_axes": dynamic}


def _versions() -> dict[str, str]:
    import platform
    from importlib.metadata import version

    names = ("torch", "onnx", "onnxruntime", "onnxscript", "onnx-ir", "numpy")
    return {"python": platform.python_version(), **{name: version(name) for name in names}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for the models and provenance.json")
    parser.add_argument("--dynamo", action="store_true", help="the dynamo exporter instead (not checked in)")
    args = parser.parse_args(argv)
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    made = {}
    for name in ("encoder", "cnn"):
        torch.manual_seed(SEED)  # each network from the same seed, whatever the other's draws
        entry = _export(torch, name, args.out, args.dynamo)
        made[f"exported_{name}{'_dynamo' if args.dynamo else ''}.onnx"] = entry
    provenance = {
        "producer": f"torch.onnx.export(dynamo={args.dynamo})",
        "command": "python tools/make_exported_models.py <folder>" + (" --dynamo" if args.dynamo else ""),
        "seed": f"torch.manual_seed({SEED}) before each network",
        "encoder": ENCODER,
        "models": made,
        "versions": _versions(),
        "script": "tools/make_exported_models.py",
        "script_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }
    (args.out / "provenance.json").write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
