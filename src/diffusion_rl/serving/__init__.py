"""An OpenAI-compatible server on the project's sampling loops (docs/serving.md).

:mod:`.settings` (``ServeSettings``), :mod:`.errors` (``RequestError``), :mod:`.engine`
(``Engine``, ``ServedModel``: batching, versioned weight updates, metrics), :mod:`.app`
(``create_app``), :mod:`.routing` (helpers the route modules share), :mod:`.text` (the
completion routes), :mod:`.generation` (completions as ``diffusion-rl generate`` makes them;
no web imports). FastAPI and uvicorn (the ``serve`` extra) are imported only by the modules
that need them, so importing this package needs neither.
"""
