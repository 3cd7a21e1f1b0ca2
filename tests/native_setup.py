"""Shared setup of the Gemini, Vertex AI and Bedrock tests: a service-account key file
whose token endpoint is the simulator's, the registry entries of the three kinds at
the simulator (:func:`tests.env_vars.environment` sets and undoes their
environment)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Dummy AWS credentials: boto3 signs with them, moto's server and the simulator accept any.
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIDBATCHGENTEST",
    "AWS_SECRET_ACCESS_KEY": "batchgen-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}
VERTEX_KEY_ENV = "BATCHGEN_TEST_VERTEX_KEY_FILE"
SIM_URL = "${BATCHGEN_SIMULATOR_URL:-http://127.0.0.1:8099}"
# Each kind's registry fields at the simulator (its credentials, location and prices).
KIND_FIELDS: dict[str, dict[str, Any]] = {
    "gemini": {
        "api_key_env": "BATCHGEN_SIMULATOR_KEY",
        "context_window": 1_000_000,
        "input_usd_per_1m": 0.30,
        "output_usd_per_1m": 2.50,
    },
    "vertex": {
        "api_key_env": VERTEX_KEY_ENV,
        "project": "sim-project",
        "region": "us-central1",
        "context_window": 1_000_000,
        "input_usd_per_1m": 1.25,
        "output_usd_per_1m": 10.00,
    },
    "bedrock": {
        "api_key_env": "AWS_BEARER_TOKEN_BEDROCK",
        "region": "us-east-1",
        "context_window": 200_000,
        "input_usd_per_1m": 3.00,
        "output_usd_per_1m": 15.00,
        "charge_policy": "actual",
    },
}
LIMITS = {
    "max_output_tokens": 8192,
    "tokens_per_min": 2_000_000,
    "requests_per_min": 10_000,
    "max_concurrency": 8,
}


def model_toml(name: str, provider: str, **fields: Any) -> str:
    """The registry table of a ``provider`` model at the simulator (``fields`` override
    the kind's and the limits' defaults; a field set to None is left out)."""
    values = {
        "provider": provider,
        "base_url": SIM_URL,
        "group": "sim",
        "budget_key": f"{name}-account",
        **KIND_FIELDS[provider],
        **LIMITS,
        **fields,
    }
    lines = [f"{key} = {json.dumps(value)}" for key, value in values.items() if value is not None]
    return f'\n[models."{name}"]\n' + "\n".join(lines) + "\n"


def service_account_file(folder: Path, token_uri: str) -> Path:
    """A service-account key file (a fresh RSA key) whose token endpoint is
    ``token_uri``: google-auth signs a real JWT with it and exchanges it there."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    account = {
        "type": "service_account",
        "project_id": "sim-project",
        "private_key_id": "sim-key",
        "private_key": pem,
        "client_email": "batchgen@sim-project.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": token_uri,
    }
    path = folder / "service-account.json"
    path.write_text(json.dumps(account))
    return path
