"""`DrainingServer`: uvicorn's server with a graceful SIGTERM: the first SIGTERM (or Ctrl+C) drains (requests in
flight finish, new ones get 503), then the server exits and the app's lifespan saves the prefix cache; a second
signal stops at once (the requests left are cancelled, their blocks freed, and the prefix cache is still saved).
"""

from __future__ import annotations

import logging
import signal
import socket

import uvicorn

from hf_pagedkv.serving.server.service import EngineService

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A `uvicorn.Server` whose first shutdown signal drains `service` before exiting (module docstring).

    Args:
        config (`uvicorn.Config`): the app and its settings.
        service (`EngineService`): the service the app serves.
    """

    def __init__(self, config: uvicorn.Config, service: EngineService) -> None:
        super().__init__(config)
        self.service = service  # fixed

    def handle_exit(self, sig: int, frame) -> None:
        if self.service.draining:  # a second signal: stop now
            logger.warning("hf_pagedkv server: second signal %s, stopping without waiting", sig)
            self.service.runner.close()  # cancels the requests left: their streams end, their blocks are freed
            super().handle_exit(sig, frame)
            return
        logger.warning("hf_pagedkv server: signal %s: draining (new requests get 503; send it again to stop now)",
                       sig)
        self.service.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        if self.service.draining and self.service.is_idle:
            self.should_exit = True
        return await super().on_tick(counter)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`:`port` (0: a free port). Raises `OSError` when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(app, service: EngineService, sock: socket.socket, log_level: str = "warning") -> None:
    """Serve `app` on the bound socket `sock` until a shutdown signal and its drain."""
    config = uvicorn.Config(app, log_level=log_level, timeout_keep_alive=30, lifespan="on")
    DrainingServer(config, service).run(sockets=[sock])


__all__ = ["DrainingServer", "bind", "serve"]
