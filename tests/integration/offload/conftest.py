"""The offload tests' fixtures (tests/integration/offload/support.py)."""

from tests.integration.offload.support import (  # noqa: F401  (fixtures of this folder)
    _admin,
    gcs_server,
    offloading,
    s3_server,
)
