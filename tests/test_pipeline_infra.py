"""Configuration objects validate at construction; the pipeline surfaces an actor constructor's
user error as that error. (What it asks of Ray and its metrics: test_batched_forward.py, on that
module's pipeline.)"""
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engramflow.errors import EngramflowError
from engramflow.io.config import ModelConfig
from engramflow.io.presets import preset
from engramflow.pipeline.pipeline import Pipeline
from engramflow.pipeline.recovery import RecoveryPolicy
from v41_golden import V41_SMALL


@pytest.mark.parametrize("kwargs,key", [({"max_retries": -1}, "max_retries"), ({"max_restarts": 1.5}, "max_restarts"),
                                        ({"ping_timeout_s": 0}, "ping_timeout_s"),
                                        ({"step_timeout_s": float("inf")}, "step_timeout_s")])
def test_recovery_policy_validates(kwargs, key):
    with pytest.raises(EngramflowError, match=key):
        RecoveryPolicy(**kwargs)


@pytest.mark.parametrize("change,key", [({"dim": 0}, "dim"), ({"norm_eps": float("nan")}, "norm_eps"),
                                        ({"engram_layer_ids": (14, 1)}, "engram_layer_ids"),
                                        ({"engram_pad_token_id": 10**9}, "engram_pad_token_id")])
def test_model_config_validates_at_construction(change, key):
    import dataclasses

    base = dataclasses.asdict(preset("deepseek-v4.1-flash"))
    with pytest.raises(EngramflowError, match=key):
        ModelConfig(**(base | change))


def test_an_actor_constructor_error_comes_back_as_itself(ray_session, tmp_path):
    out = tmp_path / "bad"
    shutil.copytree(V41_SMALL, out, ignore=shutil.ignore_patterns("golden*"))
    tensors = load_file(str(out / "model.safetensors"))
    tensors["layers.4.attn.wkv.weight"] = tensors["layers.4.attn.wkv.weight"][:32].contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(EngramflowError, match=r"^model.safetensors: tensor 'layers.4.attn.wkv.weight' expected"):
        Pipeline.launch(out, stages=2)
    assert json.loads((out / "config.json").read_text())["n_layers"] == 6
