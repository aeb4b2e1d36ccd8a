"""An OpenAI-compatible HTTP server over the engine (``pip install vmcache[server]``):
``python -m vmcache.server`` or ``vmcache-server``.

    protocol.py  the wire format: requests checked into a Job, OpenAI's error object
    text.py      incremental detokenization and stop strings
    loop.py      the engine thread: admits, steps, streams, aborts, releases
    metrics.py   /metrics through prometheus_client
    app.py       the Starlette routes, SSE streaming, the API key, sleep and wake
    streams.py   a request's events to its response: subscription, SSE, abort on close
    served.py    one served model: name, limits, engine loop, keeper
    keeper.py    a model's share of a KV budget: limits, yielding, sleep and wake
    fleet.py     several models' flags, the ledger they share, each model's floor
    kvctl.py     vmcache-kv: a ledger read, a model's limit changed while it serves
    cli.py       arguments → models, caches, engines, uvicorn

The library's core imports none of this; this package imports Starlette, uvicorn and
prometheus_client only in ``app``, ``streams``, ``cli`` and ``metrics``.
"""
