"""One local Ray instance (2 CPUs, no dashboard) with Serve, shared by the tests that need a cluster.

Replicas import the test deployment (``tests.contrib.ray.engine_app``) by name, so the
repository root goes on the workers' ``PYTHONPATH``. Serve runs without its HTTP proxy: the tests
call deployments through handles, whose request router runs in this process. The fixture always
shuts Serve and Ray down, also when a test fails.
"""

from __future__ import annotations

import gc
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

# On a loaded 2-core machine replicas often miss Serve's 0.1 s deadline to report their queue length;
# Ray then treats them as unavailable and takes a later tier (for every router alike). A longer
# deadline keeps the routers' own choices visible. Read when Ray's constants are imported, so set first.
os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "0.5")
os.environ.setdefault("RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "2.0")

# Ray's own modules warn at import time (pydantic's deprecations): import them once here, where the
# suite's "warnings are errors" does not apply to code that is not ours.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import ray.serve
    import ray.serve.config
    import ray.serve.request_router

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def serve_cluster() -> Iterator[None]:
    """A local Ray with Serve started (proxy disabled); shut down after the session."""
    from ray import serve

    logging.getLogger("kvroute").setLevel(logging.WARNING)  # fleet changes are logged at info
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with warnings.catch_warnings():  # Ray's own start-up notices (2.55 warns about accelerator env vars)
        warnings.simplefilter("ignore")
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            serve.start(proxy_location="Disabled")
        yield
    finally:
        with warnings.catch_warnings():  # Ray 2.55 leaves a daemon's Popen behind (ResourceWarning when collected)
            warnings.simplefilter("ignore")
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
                gc.collect()
