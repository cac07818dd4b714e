"""The fleet simulator: engine model, workloads and (later) the driver behind ``kvroute simulate``."""
