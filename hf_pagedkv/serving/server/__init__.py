"""An OpenAI-compatible HTTP server on the `Engine` (``hf-pagedkv serve``; FastAPI and uvicorn, ``pip install
'hf_pagedkv[serve]'``). Importing `hf_pagedkv.serving` does not import it.

Files, one job each: `protocol.py` (request bodies, checked), `service.py` (prompts, limits, admission, drain),
`engine_runner.py` (steps the engine, hands out tokens), `generation.py` (one request's choices),
`text_stream.py` (detokenizing, stop strings), `responses.py` (OpenAI objects, server-sent events),
`server_metrics.py` (GET /metrics), `app.py` (the routes), `http_server.py` (uvicorn, SIGTERM drains).
"""

from hf_pagedkv.serving.server.app import create_app
from hf_pagedkv.serving.server.service import EngineService

__all__ = ["EngineService", "create_app"]
