"""The backends the proxy routes to: the backend set, health, discovery and its providers, warm join."""
