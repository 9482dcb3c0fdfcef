"""The tiny aligner fixtures of the model tests, shared with the service tests."""

from tests.qtts.model.aligner.conftest import tiny_aligner, tiny_aligner_dir  # noqa: F401
