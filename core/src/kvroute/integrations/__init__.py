"""Pieces for embedding kvroute in an existing Python gateway.

* `kvroute.integrations.asgi`: an ASGI middleware (Starlette, FastAPI, any ASGI framework)
  that picks a backend for each OpenAI-compatible request and holds the lease until the
  response has been sent.

The LiteLLM integration is its own distribution, ``kvroute-litellm``.
"""
