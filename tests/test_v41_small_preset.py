"""`--preset v41-small`: the released format at toy size, on the Ray pipeline.

Engine and Pipeline agree token for token (greedy and seeded sampling) with 1, 3 and 4 stages; the
4-stage split [0,2) [2,4) [4,6) [6,8) cuts the ratio-2 source 2 from its consumer 4 and the
candidate source 5 from its consumer 6 and index source 7, and holds the 2-stage split's one cut
(before layer 4).
"""
import json

import pytest
import torch

from engramflow.io.checkpoint import Checkpoint
from engramflow.model.synth import make_checkpoint
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.pipeline import Pipeline
from engramflow.model.sampling import Sampling
from cli_run import engramflow_here

PROMPTS = ["Engram memory lets a model look things up", "The quick brown fox"]


@pytest.fixture(scope="module")
def engine(v41_small_preset):
    e = Engine(v41_small_preset)
    yield e
    e.shutdown()


def test_it_is_the_released_format_and_inspect_passes(v41_small_preset):
    out = engramflow_here("inspect", v41_small_preset)  # the command's main() in process
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["model"] == "deepseek-v4.1" and summary["groups"]["mtp"] > 0
    ckpt = Checkpoint(v41_small_preset)
    assert ckpt.config.vocab_size == 129_280 and ckpt.config.engram_compressed_vocab_size == 99_092
    dtypes = {info.dtype for info in ckpt.tensors.values()}
    assert {"F8_E4M3", "F8_E8M0", "I8", "BF16", "F32"} <= dtypes


def test_seeded(tmp_path, v41_small_preset):
    again = Checkpoint(make_checkpoint("v41-small", tmp_path / "again", seed=0, progress=False))
    other = Checkpoint(make_checkpoint("v41-small", tmp_path / "other", seed=1, progress=False))
    ckpt = Checkpoint(v41_small_preset)
    for name in ("layers.3.ffn.experts.5.w2.weight", "layers.5.attn.wq_b.scale", "head.weight"):
        assert torch.equal(ckpt.tensor(name), again.tensor(name))
        assert not torch.equal(ckpt.tensor(name), other.tensor(name))


def script(runner):
    """Two prompts, greedy; a fork that decodes its own way; seeded sampling."""
    greedy = [g.tokens for g in runner.generate(PROMPTS, max_new_tokens=8)]
    s = runner.open()
    runner.prefill(s, runner.encode(PROMPTS[0]))
    child = runner.fork(s)
    step = runner.decode_step({s: 100, child: 200})
    forked = [int(step[s].argmax()), int(step[child].argmax())]
    runner.close(s), runner.close(child)
    sampled = runner.generate(PROMPTS[:1], max_new_tokens=8, sampling=Sampling(temperature=0.9, top_k=50, seed=5))
    return greedy, forked, sampled[0].tokens


def test_engine_equals_pipeline_over_1_3_and_4_stages(ray_session, engine, v41_small_preset):
    want = script(engine)
    assert len(set(want[0][0])) > 1  # not a collapsed model
    for stages in (1, 3, 4):  # 4 stages cut before layers 2, 4, 6: the 2-stage split's one cut (4) too
        pipe = Pipeline.launch(v41_small_preset, stages=stages)
        try:
            assert script(pipe) == want, stages
        finally:
            pipe.shutdown()
