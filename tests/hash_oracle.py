"""The hashing rule (docs/v41.md, "Engram") written per position with Python ints: the scalar oracle the
vectorized kernel is tested (and benchmarked) against."""
from engramflow.kernels.hashing import DEAD, HashTables


def hash_reference(hist: list[int], layout: HashTables, pad: int) -> list[list[list[int]]]:
    """The hashing rule written per position with Python ints: the scalar oracle."""

    def wrap64(v: int) -> int:
        v &= (1 << 64) - 1
        return v - (1 << 64) if v >= 1 << 63 else v

    hist = [int(v) for v in hist]
    out = []
    for p in range(len(hist)):
        blocked, toks = False, []
        for s in range(layout.max_ngram):
            src = hist[p - s] if p >= s else DEAD
            blocked = blocked or p < s or src == DEAD
            toks.append(pad if blocked else src)
        per_layer = []
        for li in range(len(layout.layer_ids)):
            mult = [int(m) for m in layout.multipliers[li]]
            rolling = wrap64(toks[0] * mult[0])
            row = []
            for i in range(1, layout.max_ngram):
                rolling = wrap64(rolling ^ wrap64(toks[i] * mult[i]))
                for h in range(layout.n_heads):
                    c = (i - 1) * layout.n_heads + h
                    row.append(rolling % int(layout.primes[li, c]) + int(layout.offsets[li, c]))
            per_layer.append(row)
        out.append(per_layer)
    return out
