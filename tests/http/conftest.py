"""A real uvicorn server on 127.0.0.1 (free port) in a background thread, per configuration."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

import edgellm
from edgellm.entrypoints.http.app import create_app

MODEL_ID = "smollm2-135m"


class RunningServer:
    """create_app(model, model_id=MODEL_ID, **options), or create_app(**options) without a model
    (a catalog of models), served on a free port."""

    def __init__(self, model=None, model_id: str = MODEL_ID, **options):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = create_app(model, model_id=model_id, **options) if model is not None else create_app(**options)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.app.state.router.close()  # the models it loaded itself
        if self.app.state.service is not None:
            self.app.state.service.close()


@pytest.fixture(scope="session")
def served_model(smollm2_path):
    model = edgellm.load(smollm2_path)
    yield model
    model.close()


@pytest.fixture
def server_factory(served_model):
    servers = []

    def start(**options) -> RunningServer:
        servers.append(RunningServer(served_model, **options))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def server(server_factory) -> RunningServer:
    return server_factory()
