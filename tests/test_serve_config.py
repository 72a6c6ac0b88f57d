"""The `serve run` config in the repository is one Ray Serve accepts, and its application
builder takes its args (bad ones are refused by name)."""
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from engramflow.serve.deployment import build

ROOT = Path(__file__).resolve().parent.parent


def test_serve_yaml_is_a_valid_serve_config():
    doc = yaml.safe_load((ROOT / "serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(doc)
    app = schema.applications[0]
    assert app.import_path == "engramflow.serve.deployment:build"
    assert doc["http_options"]["host"] == "127.0.0.1"
    built = build(app.args)  # the builder accepts exactly these args
    assert built is not None


def test_builder_refuses_unknown_options():
    with pytest.raises(ValueError, match="max_sesions"):
        build({"checkpoint": "/x", "max_sesions": 3})


def test_builder_checks_the_speculative_option():
    assert build({"checkpoint": "/x", "speculative": "dspark:2:adaptive=0.7"}) is not None
    with pytest.raises(Exception, match="speculative"):
        build({"checkpoint": "/x", "speculative": "eagle:3"})


def test_cluster_yaml_has_the_serve_commands():
    text = (ROOT / "cluster.yaml").read_text()
    assert "engramflow serve --address auto" in text and "serve deploy serve.yaml" in text
