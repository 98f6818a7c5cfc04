"""What requantizing a GGUF type to b bits over groups of 32 adds to its error:

    python -m benchmarks.gguf_requant F32.gguf QUANTIZED.gguf TYPE [TYPE ...]

For each matrix of TYPE in QUANTIZED.gguf (llama-quantize's output from F32.gguf): the RMS
error of its values requantized to 4, 5, 6 and 8 bits by engine/models/gguf/affine.requantize,
against gguf-py's values, as a multiple of TYPE's own RMS error against the F32 weights.
"""

from __future__ import annotations

import sys

import numpy as np

from batchmlx.engine.models.gguf.affine import GROUP, requantize

BITS = (4, 5, 6, 8)


def main(argv: list[str]) -> int:
    import gguf

    f32, quantized, *types = argv
    orig = {t.name: np.asarray(t.data, np.float32) for t in gguf.GGUFReader(f32).tensors}
    for name in types:
        added = dict.fromkeys(BITS, 0.0)
        own = 0.0
        for t in gguf.GGUFReader(quantized).tensors:
            if t.tensor_type.name != name:
                continue
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, GROUP)
            own += float(np.sum((w - orig[t.name].reshape(-1, GROUP)) ** 2))
            for b in BITS:
                q, s, lo = requantize(w, b)
                added[b] += float(np.sum((q * s + lo - w) ** 2))
        ratios = "  ".join(f"{b} bits: {np.sqrt(added[b] / own):.3f}" for b in BITS)
        print(f"{name}: {ratios}" if own else f"{name}: no such matrix")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
