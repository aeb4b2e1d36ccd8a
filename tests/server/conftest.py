"""The server tests' fixtures: the random 2-layer model with the embedded model's tokenizer
and chat template (``real``), and a server on it per cache (``srv``; a module may define its
own, as tests/server/test_server_abandon.py does). Both module-scoped."""

import pytest
from real_model import tiny_chat
from server_cases import start


@pytest.fixture(scope="module")
def real():
    return tiny_chat()


@pytest.fixture(scope="module", params=["vm", "paged"])
def srv(real, request):
    with start(real, "--cache", request.param) as running:
        yield running
