"""The request path: the ASGI app that parses and dispatches requests, and the forwarder that proxies them."""
