"""An OpenAI-compatible HTTP server over the engine (``pip install vmcache[server]``):
``python -m vmcache.server`` or ``vmcache-server``.

    protocol.py  the wire format: requests checked into a Job, OpenAI's error object
    text.py      incremental detokenization and stop strings
    loop.py      the engine thread: admits, steps, streams, aborts, releases
    metrics.py   /metrics through prometheus_client
    app.py       the Starlette routes, SSE streaming, the API key
    cli.py       arguments → model, cache, engine, uvicorn

The library's core imports none of this; this package imports Starlette, uvicorn and
prometheus_client only in ``app``, ``cli`` and ``metrics``.
"""
