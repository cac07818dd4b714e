"""HTTP plumbing with no routing in it: the server protocol, uvicorn runners, ASGI helpers, the upstream client.

Nothing here imports the proxy, the fleet or the operations packages; they build on it.
"""
