"""prefill-job's --share-prefix, in process (an Engine on v41-small, no Ray): rows that share a
long instruction give the same records bit for bit as without it, and the instruction is
prefilled for the first rows only (the tokens each step writes are counted on the runner)."""
import numpy as np
import pytest

from engramflow.data.prefill.prompts import RowSpec, prefill_rows
from engramflow.data.prefill.schema import output_schema
from engramflow.pipeline.engine import Engine

INSTRUCTION, OWN, ROWS, AT_ONCE = 96, 16, 12, 4


@pytest.fixture(scope="module")
def engine(v41_small_preset):
    e = Engine(v41_small_preset, prefill_chunk=32)
    yield e
    e.shutdown()


def run(engine, share: bool):
    rng = np.random.default_rng(0)
    instruction = rng.integers(300, 60000, INSTRUCTION).tolist()
    rows = [(f"r{i}", instruction + rng.integers(300, 60000, OWN).tolist(), None) for i in range(ROWS)]
    written = []
    submit = engine.submit

    def counting(requests):  # an observer: what each step writes
        written.extend(r.ids.size for r in requests)
        return submit(requests)

    engine.submit = counting
    try:
        spec = RowSpec("ids", True, "id", top_k=3, share_prefix=share)
        records = list(prefill_rows(engine, iter(rows), spec, output_schema(engine.cfg.engram_layer_ids), None,
                                    max_rows=AT_ONCE))
    finally:
        del engine.submit
    for r in records:
        r.pop("prefill_ms")
        for k in [k for k in r if k.startswith("wait_ms")]:
            r.pop(k)
    return records, sum(written)


def test_shared_instruction_is_prefilled_once_and_rows_are_unchanged(engine):
    cold, cold_tokens = run(engine, share=False)
    shared, shared_tokens = run(engine, share=True)
    assert shared == cold  # next token, its logprob, the top-k: bit for bit
    assert cold_tokens == ROWS * (INSTRUCTION + OWN)
    # the first AT_ONCE rows arrive together and each prefill the instruction; every later row
    # finds it in a finished row's session and prefills its own tokens only
    assert shared_tokens == AT_ONCE * (INSTRUCTION + OWN) + (ROWS - AT_ONCE) * OWN
    assert engine.sessions == []  # the job's cache closed what it kept
