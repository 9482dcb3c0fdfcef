"""The tiny aligner fixtures of the model tests, for the word-timestamp tests."""

from tests.qtts.model.aligner.conftest import tiny_aligner, tiny_aligner_dir  # noqa: F401
