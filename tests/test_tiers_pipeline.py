"""Storage tiers under generation: a remote-RAM tier that dies degrades as configured."""
import pytest

from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import Checkpoint
from engramflow.pipeline.engine import Engine
from engramflow.tiers.server import TableServer

PROMPT = "Engram memory lets a model look things up"
SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def server(tiny_ckpt):
    srv = TableServer.from_checkpoint(Checkpoint(tiny_ckpt), 14, SECRET).start()
    yield srv
    srv.stop()


def _tiers(server, secret_file, policy):
    host, port = server.address
    return {"14": {"tiers": [{"kind": "remote", "host": host, "port": port, "secret_file": str(secret_file),
                              "timeout": 0.5, "policy": policy}, {"kind": "host"}]}}


def test_fallback_gives_the_same_tokens_and_reject_a_clear_error(tiny_ckpt, server, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    (plain,) = Engine(tiny_ckpt).generate([PROMPT], max_new_tokens=6)

    tiered = Engine(tiny_ckpt, tiers=_tiers(server, secret_file, "fallback"))
    (served,) = tiered.generate([PROMPT], max_new_tokens=6)
    assert served.tokens == plain.tokens
    stack = tiered.memory.tables[14]
    assert stack.tier_stats()["remote"]["rows"] > 0

    rejecting = Engine(tiny_ckpt, tiers=_tiers(server, secret_file, "reject"))
    server.stop()  # the remote table host goes away mid-life
    (degraded,) = tiered.generate([PROMPT], max_new_tokens=6)
    assert degraded.tokens == plain.tokens
    assert stack.tier_stats()["remote"]["fallbacks"] > 0
    with pytest.raises(EngramflowError):
        rejecting.generate([PROMPT], max_new_tokens=2)
    assert rejecting.sessions == []  # the failed request left no session behind
    (again,) = Engine(tiny_ckpt).generate([PROMPT], max_new_tokens=6)
    assert again.tokens == plain.tokens
