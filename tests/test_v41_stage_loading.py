"""Per-stage loading: a V4.1 stage reads the bytes of its own layers (plus the embedding on the
first stage, norm and head on the last) and nothing else; the Engram memory reads only the
tables and wkv; together they read every tensor the text model needs and none of MTP's."""
import json

import pytest

from engramflow.model.backbones import make_backbone, split_blocks
from engramflow.io.checkpoint import Checkpoint
from engramflow.model.engram_memory import EngramMemory
from engramflow.model.v41.names import tensor_specs
from v41_golden import V41_SMALL

SPECS = tensor_specs(json.loads((V41_SMALL / "config.json").read_text()))


def stage_groups(blocks: range, first: bool, last: bool) -> set[str]:
    """The name groups (names.TensorSpec.group) a stage owning `blocks` should read."""
    return {f"layer.{i}" for i in blocks} | ({"embed"} if first else set()) | ({"head"} if last else set())


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_each_stage_reads_only_its_own_tensors(stages):
    n = 6
    read_by_all: set[str] = set()
    for blocks in split_blocks(n, stages):
        ckpt = Checkpoint(V41_SMALL)
        stage = make_backbone("v41", ckpt, blocks)
        own = {name for name, spec in SPECS.items()
               if spec.group in stage_groups(blocks, stage.first, stage.last)}
        assert set(ckpt.touched) == own, (blocks, sorted(set(ckpt.touched) ^ own)[:5])
        assert sum(ckpt.touched.values()) == sum(ckpt.info(name).nbytes for name in own)
        read_by_all |= set(ckpt.touched)
        ckpt.close()
    ckpt = Checkpoint(V41_SMALL)
    EngramMemory(ckpt, numerics="official").close()
    engram = set(ckpt.touched)
    assert engram == {name for name, spec in SPECS.items() if spec.group.startswith("engram.")}
    text_model = {name for name, spec in SPECS.items() if spec.group not in ("mtp", "vision")}
    assert read_by_all | engram == text_model
    assert not any(name.startswith("mtp.") for name in read_by_all | engram)
