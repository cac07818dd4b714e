"""Running the proxy in production: admin API, status page, metrics, shadow strategies, workers and their journal."""
