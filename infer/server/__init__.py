"""`specdec-serve`: OpenAI-compatible HTTP server over the specdec Engine.

* ``app.py``        FastAPI routes, auth, OpenAI error shape, SSE streaming
* ``protocol.py``   request validation and incremental detokenisation
* ``scheduler.py``  the engine thread: continuous batching, queue, abort, drain
* ``controller.py`` speculation policies (goodput / always / threshold / thompson)
* ``costmodel.py``  online step-cost model and per-request acceptance estimates
* ``metrics.py``    Prometheus metrics
* ``cli.py``        the command line (``build_app`` builds everything for tests too)
"""
