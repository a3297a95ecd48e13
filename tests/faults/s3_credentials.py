"""The credentials moto's S3 server takes: set where the environment has none."""

from __future__ import annotations

import os

__all__ = ["use_test_credentials"]


def use_test_credentials() -> None:
    """Give boto3 / s3fs the test key and region moto accepts (existing values win)."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(name, value)
