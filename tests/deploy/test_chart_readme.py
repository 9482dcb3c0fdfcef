"""The chart's README lists every value with its default (kept in sync by
deploy/helm/values_table.py), and the schema knows every top-level key and refuses others."""

from __future__ import annotations

import importlib.util
import json

import yaml
from test_manifests import CHART, ROOT


def values_table():
    spec = importlib.util.spec_from_file_location(
        "values_table", ROOT / "deploy" / "helm" / "values_table.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_values_table_is_what_values_yaml_says():
    vt = values_table()
    readme = (CHART / "README.md").read_text()
    assert vt.readme_table(readme) == vt.table(), (
        "the values table is out of date: run python deploy/helm/values_table.py --write"
    )


def test_readme_table_has_a_row_per_leaf_value_with_its_default():
    vt = values_table()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rows = {}
    for line in vt.readme_table((CHART / "README.md").read_text()).splitlines()[2:]:
        key, default = line.split(" | ")[:2]
        rows[key.strip("| `")] = json.loads(default.strip("`"))
    assert rows == dict(vt.leaves(values))
    for key in (
        "talker.autoscaling.targetActiveStreams",
        "code2wav.replicaCount",
        "monitoring.podMonitor.enabled",
    ):
        assert key in rows


def test_schema_knows_every_top_level_key_and_refuses_others():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert schema["additionalProperties"] is False
    assert set(values) <= set(schema["properties"])
    for stage in ("gateway", "talker", "code2wav", "speakerCache"):
        assert schema["properties"][stage]["properties"]["replicaCount"]["minimum"] == 1
