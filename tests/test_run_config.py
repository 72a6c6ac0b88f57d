"""The run configs (pipeline/config.py, serve/config.py): the keyword forms, the command line and
serve.yaml's args build equal configs; every bad value is refused by name; frozen; they pickle."""
import dataclasses
import pickle
from pathlib import Path

import pytest
import yaml

from engramflow.cli.app import build_parser
from engramflow.cli.options import pipeline_config, serve_config
from engramflow.errors import EngramflowError
from engramflow.pipeline.config import Emulation, EngineConfig, PipelineConfig, UnknownOption
from engramflow.pipeline.recovery import RecoveryPolicy
from engramflow.serve.config import ServeConfig

ROOT = Path(__file__).resolve().parent.parent


def test_keywords_build_the_nested_config():
    built = PipelineConfig.build("/ckpt", stages=2, block_ms=0.5, projection="stage", max_restarts=3,
                                 speculative="dspark:2", numerics="official")
    made = PipelineConfig(EngineConfig("/ckpt", speculative="dspark:2", numerics="official",
                                       emulation=Emulation(block_ms=0.5)),
                          stages=2, projection="stage", policy=RecoveryPolicy(max_restarts=3))
    assert built == made
    assert built.engine.spec.k == 2 and built.engine.checkpoint == str(Path("/ckpt").resolve())


def test_command_line_and_keywords_agree():
    args = build_parser().parse_args(["generate", "--checkpoint", "/ckpt", "--prompt", "hi", "--stages", "3",
                                      "--backbone", "emulated", "--block-ms", "0", "--projection", "auto"])
    assert pipeline_config(args) == PipelineConfig.build("/ckpt", stages=3, backbone="emulated", block_ms=0.0,
                                                         projection="auto")


def test_serve_yaml_and_the_serve_command_agree():
    doc = yaml.safe_load((ROOT / "serve.yaml").read_text())
    app_args = dict(doc["applications"][0]["args"])
    app_args.pop("replicas")
    from_yaml = ServeConfig.build(**app_args)
    argv = ["serve", "--checkpoint", app_args["checkpoint"], "--model", app_args["model"],
            "--stages", str(app_args["stages"]), "--projection", app_args["projection"],
            "--max-sessions", str(app_args["max_sessions"]), "--max-queue", str(app_args["max_queue"])]
    assert serve_config(build_parser().parse_args(argv)) == from_yaml
    assert from_yaml.pipeline.stages == 4 and from_yaml.engine.checkpoint == str(Path("/data/ckpt").resolve())


@pytest.mark.parametrize("options, words", [
    ({"stages": 0}, "stages"), ({"stages": True}, "stages"), ({"numerics": "fast"}, "numerics"),
    ({"speculative": "eagle:3"}, "speculative"), ({"projection": "gpu"}, "projection"),
    ({"block_ms": -1}, "block_ms"), ({"block_ms": float("nan")}, "block_ms"), ({"prefill_chunk": 0}, "prefill_chunk"),
    ({"in_flight": 0}, "in flight"), ({"placement_rates": {"warp": 1}}, "placement rates"),
    ({"backbone": "gpt"}, "backbone"), ({"projection_delay_ms": {"one": 1.0}}, "projection_delay_ms"),
    ({"projection_delay_ms": {1: -2.0}}, "projection_delay_ms[1]"), ({"threads": 0}, "threads"),
    ({"max_restarts": -1}, "max_restarts"), ({"warmup": "yes"}, "warmup"), ({"address": 5}, "address"),
])
def test_a_bad_value_is_refused_by_name(options, words):
    with pytest.raises(EngramflowError, match=words.replace("[", r"\[").replace("]", r"\]")):
        PipelineConfig.build("/ckpt", **options)


@pytest.mark.parametrize("options, words", [
    ({"max_sessions": 0}, "max_sessions"), ({"max_queue": -1}, "max_queue"), ({"max_n": 0}, "max_n"),
    ({"max_body_bytes": 10}, "max_body_bytes"), ({"prefix_cache_mb": -1}, "prefix-cache-mb"),
    ({"in_process": 1}, "in_process"), ({"model": None}, "model"), ({"prepare_workers": 0}, "prepare_workers"),
])
def test_a_bad_serve_value_is_refused_by_name(options, words):
    with pytest.raises(EngramflowError, match=words):
        ServeConfig.build("/ckpt", **options)


def test_an_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="stagez"):
        PipelineConfig.build("/ckpt", stagez=2)
    with pytest.raises(UnknownOption, match="devcie"):
        EngineConfig.build("/ckpt", devcie="cpu")
    with pytest.raises(ValueError, match="max_sesions.*known: .*max_sessions"):  # serve.yaml's typo
        ServeConfig.build("/ckpt", max_sesions=3)
    with pytest.raises(EngramflowError, match="policy or max_restarts"):
        PipelineConfig.build("/ckpt", max_restarts=1, policy=RecoveryPolicy())


def test_a_config_is_complete(tiny_ckpt):
    """Variants come from dataclasses.replace: a config with keywords besides is refused before Ray."""
    from engramflow.pipeline.engine import Engine
    from engramflow.pipeline.pipeline import Pipeline

    with pytest.raises(TypeError, match="stages"):
        Pipeline.launch(PipelineConfig.build(tiny_ckpt), stages=2)
    with pytest.raises(TypeError, match="block_ms"):
        Engine(EngineConfig.build(tiny_ckpt), block_ms=0)


def test_frozen_and_replace():
    c = PipelineConfig.build("/ckpt", stages=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.stages = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.engine.emulation.block_ms = 0.0
    d = dataclasses.replace(c, stages=3)
    assert d.stages == 3 and d.engine == c.engine and c.stages == 2
    with pytest.raises(EngramflowError, match="stages"):
        dataclasses.replace(c, stages=-1)  # a variant is checked as the original was


def test_configs_pickle():
    s = ServeConfig.build("/ckpt", stages=2, block_ms=0.0, projection_delay_ms={14: 3.0}, max_n=4,
                          placement_rates={"margin": 0.1}, speculative="dspark:exact")
    assert pickle.loads(pickle.dumps(s)) == s
    assert pickle.loads(pickle.dumps(s.pipeline)) == s.pipeline


def test_numerics_resolve_once_where_the_config_is_made(monkeypatch):
    monkeypatch.setenv("ENGRAMFLOW_NUMERICS", "official")
    c = EngineConfig.build("/ckpt")
    monkeypatch.setenv("ENGRAMFLOW_NUMERICS", "batched")
    assert c.numerics == "official" and pickle.loads(pickle.dumps(c)).numerics == "official"
    monkeypatch.setenv("ENGRAMFLOW_NUMERICS", "fast")
    with pytest.raises(EngramflowError, match="ENGRAMFLOW_NUMERICS"):
        EngineConfig.build("/ckpt")


def test_threads_resolve_once_where_the_config_is_made(monkeypatch, ray_session, tiny_ckpt):
    """ENGRAMFLOW_THREADS fills `threads` where the config is made; the stage and projection
    actors get that count as an argument and compute with it."""
    from engramflow.pipeline.pipeline import Pipeline

    monkeypatch.setenv("ENGRAMFLOW_THREADS", "3")
    c = EngineConfig.build("/ckpt")
    monkeypatch.delenv("ENGRAMFLOW_THREADS")
    assert c.threads == 3 and EngineConfig.build("/ckpt").threads is None
    assert EngineConfig.build("/ckpt", threads=2).threads == 2
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("ENGRAMFLOW_THREADS", bad)
        with pytest.raises(EngramflowError, match=f"ENGRAMFLOW_THREADS.*{bad!r}"):
            EngineConfig.build("/ckpt")
    monkeypatch.delenv("ENGRAMFLOW_THREADS")
    pipe = Pipeline.launch(tiny_ckpt, threads=1)
    try:
        import ray

        stage_threads = ray.get(pipe.actor("stage0").__ray_call__.remote(lambda self: __import__("torch").get_num_threads()))
        projection = ray.get(pipe.actor("projection0").__ray_call__.remote(
            lambda self: [p.threads for p in self.memory.projections.values()]))
        assert stage_threads == 1 and projection and set(projection) == {1}
    finally:
        pipe.shutdown()


def test_the_engine_keeps_its_config(tiny_ckpt):
    from engramflow.pipeline.engine import Engine

    config = EngineConfig.build(tiny_ckpt, backbone="emulated", block_ms=0.0, prefill_chunk=8)
    e, f = Engine(config), Engine(tiny_ckpt, backbone="emulated", block_ms=0.0, prefill_chunk=8)
    try:
        assert e.config == f.config == config
        assert e.prefill_chunk == 8 and e.backbone == "emulated"
    finally:
        e.shutdown()
        f.shutdown()


@pytest.mark.parametrize("argv, flag", [(["--prefill-chunk", "0"], "--prefill-chunk"), (["--max-n", "0"], "--max-n"),
                                        (["--speculative", "eagle"], "speculative")])
def test_the_command_line_names_the_flag(capsys, tiny_ckpt, argv, flag):
    from engramflow.cli.app import main

    code = main(["serve", "--checkpoint", str(tiny_ckpt), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and flag in err and "\n" not in err
