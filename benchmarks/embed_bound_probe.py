"""How close EmbedLayerNormalization's and QEmbedLayerNormalization's rewrites come to their stated
bound, over many random draws of the tests' batteries (tests/test_unfuse_attention.py's models), at
the battery's hidden size 48 and at BERT-base's 768.

    python benchmarks/embed_bound_probe.py [DRAWS]         # default 60 draws x 4 cases x 2 sizes per op
    python benchmarks/embed_bound_probe.py --fma [DRAWS]   # default 20 draws x 2 table types x 2 sizes

Prints, per op, the worst max|rewrite - kernel| / (2^-24·(|γ·x̂| + |β| + 1)) found, x̂ the
normalized embedding sum (float64), with the draw it came from, and how many cases were bit-exact:
the figures the contract's bound (builders/contracts.py, unfuse_embed_layer_norm) quotes.

``--fma``: the same ratio against QEmbedLayerNormalization's kernel as a build that contracts
multiply-adds computes it (tests/_embed_kernel.py, emulated: the uncontracted emulation is checked to
be the kernel bit for bit first), per contraction site, with how many elements the contraction
changes; and, where the dequantization is contracted, the worst excess over the first term in units of
2^-24·|γ|·(1 + |x̂|)·M/σ (M the row's largest |w| + |p| + |s| dequantized, σ its standard deviation).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import _embed_kernel as K
import test_unfuse_attention as T
from conftest import run

import onnx_qrewrite


def _ratio(got: np.ndarray, want: np.ndarray, total: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> float:
    total = total.astype(np.float64)
    centred = total - total.mean(-1, keepdims=True)
    normalized = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-12)
    unit = 2.0**-24 * (np.abs(gamma * normalized) + np.abs(beta) + 1)
    return float(np.max(np.abs(got.astype(np.float64) - want) / unit))


def _feeds(model, scale: float = 1.0) -> dict[str, np.ndarray]:
    names = {i.name for i in model.graph.input}
    return {k: v for k, v in T.embed_feeds(scale).items() if k in names}


def embed(draws: int) -> tuple[float, object, int]:
    worst: tuple[float, object] = (0.0, None)
    exact = 0
    for seed in range(draws):
        T.RNG = np.random.default_rng(1000 + seed)
        for segment in (True, False):
            for scale in (1.0, 100.0):
                model = T.embed_model(segment, True, False, attrs={"epsilon": 1e-5})
                feeds = _feeds(model, scale)
                want, got = run(model, feeds), run(onnx_qrewrite.rewrite(model).model, feeds)
                r = _ratio(got["y"], want["y"], want["sum"], feeds["gamma"], feeds["beta"])
                worst = max(worst, (r, (seed, segment, scale, T.EMB["hidden"])), key=lambda w: w[0])
                exact += int(np.array_equal(got["y"], want["y"]))
    return (*worst, exact)


def qembed(draws: int) -> tuple[float, object, int]:
    worst: tuple[float, object] = (0.0, None)
    exact = 0
    for seed in range(draws):
        T.RNG = np.random.default_rng(seed)
        for table_type in (np.uint8, np.int8):
            for segment in (True, False):
                model = T.qembed_model(table_type, segment, True)
                feeds = _feeds(model)
                want, got = run(model, feeds), run(onnx_qrewrite.rewrite(model).model, feeds)
                t = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}

                def dq(name: str, t: dict = t) -> np.ndarray:
                    return (t[f"{name}_q"] - t[f"{name}_zp"]) * t[f"{name}_s"]

                total = dq("words")[feeds["ids"]] + dq("positions")[: T.EMB["seq"]]
                if segment:
                    total = total + dq("segments")[feeds["seg"]]
                r = _ratio(got["y"], want["y"], total, dq("gamma"), dq("beta"))
                worst = max(worst, (r, (seed, table_type.__name__, segment, T.EMB["hidden"])), key=lambda w: w[0])
                exact += int(np.array_equal(got["y"], want["y"]))
    return (*worst, exact)


FUSED = (("out",), ("beta",), ("var",), ("out", "var"), ("deq",), ("deq", "var", "out"))


def fma(draws: int) -> tuple[dict, dict, float]:
    """Per contraction: the worst ratio and the elements changed; the worst dequantization term ratio."""
    worst = dict.fromkeys(FUSED, 0.0)
    changed = dict.fromkeys(FUSED, 0)
    term_worst = 0.0
    for seed in range(draws):
        T.RNG = np.random.default_rng(5000 + seed)
        for table_type in (np.uint8, np.int8):
            model = T.qembed_model(table_type, True, True)
            feeds = _feeds(model)
            got = run(onnx_qrewrite.rewrite(model).model, feeds)["y"].astype(np.float64)
            plain = K.qembed_kernel(model, feeds)
            assert np.array_equal(plain.view(np.uint32), run(model, feeds)["y"].view(np.uint32)), "not the kernel"
            total, gamma, beta = T._qembed_total(model, feeds, True)
            term = T._dequantize_fma_term(model, feeds, total, gamma)
            for fused in FUSED:
                kernel = K.qembed_kernel(model, feeds, fused)
                changed[fused] += int(np.count_nonzero(kernel.view(np.uint32) != plain.view(np.uint32)))
                worst[fused] = max(worst[fused], _ratio(got, kernel, total, gamma, beta))
                if "deq" in fused:
                    excess = np.abs(got - kernel) - 4 * _unit(total, gamma, beta)
                    with np.errstate(divide="ignore", invalid="ignore"):  # γ = 0: 0/0, no excess there
                        ratios = np.where(term > 0, excess / term, 0.0)
                    term_worst = max(term_worst, float(ratios.max()))
    return worst, changed, term_worst


def _unit(total: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
    centred = total - total.mean(-1, keepdims=True)
    normalized = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-12)
    return 2.0**-24 * (np.abs(gamma * normalized) + np.abs(beta) + 1)


def main_fma(n: int) -> None:
    for hidden in (48, 768):
        T.EMB["hidden"] = hidden
        worst, changed, term = fma(n)
        for fused in FUSED:
            print(f"hidden {hidden}, {'+'.join(fused)}: worst {worst[fused]:.2f}, {changed[fused]} elements changed")
        print(f"hidden {hidden}, dequantization contracted: worst excess {term:.2f} of 2^-24·|γ|·(1 + |x̂|)·M/σ")


if __name__ == "__main__" and "--fma" in sys.argv:
    main_fma(int(sys.argv[2]) if len(sys.argv) > 2 else 20)
elif __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    for op, probe in (("EmbedLayerNormalization", embed), ("QEmbedLayerNormalization", qembed)):
        results = []
        for hidden in (48, 768):
            T.EMB["hidden"] = hidden
            results.append(probe(n))
        ratio, draw, _ = max(results, key=lambda r: r[0])
        exact = sum(r[2] for r in results)
        print(f"{op}: worst {ratio:.1f} (draw {draw}) over {8 * n} cases, {exact} bit-exact")
