"""Deployment settings from the environment: a bad value fails the code location's load with
the variable's name, what was expected and what was found; secrets stay EnvVars."""

import re

import dagster as dg
import pytest

from eagle3_assets.definitions import RESOURCES, Automation, defs, resources_from_env
from eagle3_assets.env_settings import SettingsError
from eagle3_assets_tests.conftest import REPO


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("EAGLE3_BATCH_SIZE", "abc", "EAGLE3_BATCH_SIZE: expected a valid integer.*found 'abc'"),
        (
            "EAGLE3_BATCH_SIZE",
            "0",
            "EAGLE3_BATCH_SIZE: expected greater than or equal to 1, found '0'",
        ),
        ("EAGLE3_TEMPERATURE", "-1", "EAGLE3_TEMPERATURE: expected greater than or equal to 0"),
        (
            "EAGLE3_CHAT_TEMPLATE_KWARGS",
            '{"thinking": fals}',
            "EAGLE3_CHAT_TEMPLATE_KWARGS: "
            r"expected a JSON object \(Expecting value.*found '\{\"thinking\": fals\}'",
        ),
        (
            "EAGLE3_CHAT_TEMPLATE_KWARGS",
            "[1]",
            "EAGLE3_CHAT_TEMPLATE_KWARGS: expected a JSON object, found '\\[1\\]'",
        ),
        (
            "EAGLE3_HIDDEN_BACKEND",
            "sglang",
            "EAGLE3_HIDDEN_BACKEND: expected 'hf' or 'vllm', found 'sglang'",
        ),
        (
            "EAGLE3_HIDDEN_FORMAT",
            "fp8+fp4",
            "EAGLE3_HIDDEN_FORMAT: final: expected bf16, fp8 or top<k>",
        ),
        ("EAGLE3_TRUST_REMOTE_CODE", "maybe", "EAGLE3_TRUST_REMOTE_CODE: expected a valid boolean"),
        ("EAGLE3_HOLDOUT_FRACTION", "1.5", "EAGLE3_HOLDOUT_FRACTION: expected less than 1"),
    ],
)
def test_a_bad_value_is_refused_by_variable_expected_and_found(variable, value, message):
    with pytest.raises(SettingsError, match=message):
        resources_from_env({variable: value})


def test_every_bad_variable_of_a_resource_is_named_at_once():
    with pytest.raises(SettingsError) as refused:
        resources_from_env({"EAGLE3_MAX_TOKENS": "lots", "EAGLE3_CONCURRENCY": "0"})
    lines = str(refused.value).splitlines()
    assert [line.split(":")[0 if i else 1].strip() for i, line in enumerate(lines)] == [
        "EAGLE3_MAX_TOKENS",
        "EAGLE3_CONCURRENCY",
    ]


def test_the_code_location_does_not_load_with_a_bad_value(monkeypatch):
    monkeypatch.setenv("EAGLE3_AUTOMATION", "sometimes")
    with pytest.raises(SettingsError, match="EAGLE3_AUTOMATION: expected a valid boolean"):
        defs()


def test_values_are_parsed_by_the_fields_type():
    resources = resources_from_env(
        {
            "EAGLE3_VLLM_URLS": "http://127.0.0.1:8000, http://127.0.0.1:8001",
            "EAGLE3_EXTRACT_VLLM_ARGS": "--enforce-eager --max-num-seqs 8",
            "EAGLE3_CHAT_TEMPLATE_KWARGS": '{"thinking": false}',
            "EAGLE3_TRUST_REMOTE_CODE": "1",
            "EAGLE3_HIDDEN_CAP_GB": "",  # empty: the default
        }
    )
    assert resources["vllm"].base_urls == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert resources["hidden"].vllm_args == ["--enforce-eager", "--max-num-seqs", "8"]
    assert resources["generation"].config().chat_template_kwargs == {"thinking": False}
    assert resources["target"].trust_remote_code is True
    assert resources["hidden"].cap_gb is None


def test_secrets_are_env_vars_never_values():
    resources = resources_from_env({"VLLM_API_KEY": "sk-secret", "HF_TOKEN": "hf_secret"})
    held = [
        getattr(resources[key], field)
        for key, field in [("vllm", "api_key"), ("prompt_pool", "token"), ("drafter_hub", "token")]
    ]
    assert held == [dg.EnvVar("VLLM_API_KEY"), dg.EnvVar("HF_TOKEN"), dg.EnvVar("HF_TOKEN")]
    assert all(isinstance(value, dg.EnvVar) for value in held)


def test_every_variable_names_a_field_and_no_two_fields_share_one_by_accident():
    for name, settings in {**RESOURCES, "automation": Automation}.items():
        fields = set(settings.model_fields)
        assert set(settings.variables()) <= fields, name
    # a variable shared across resources means the same thing in each (one setting, one value)
    owners: dict[str, set[str]] = {}
    for settings in RESOURCES.values():
        for field, variable in settings.variables().items():
            owners.setdefault(variable, set()).add(field)
    assert {v: f for v, f in owners.items() if len(f) > 1} == {}


def test_the_readme_documents_exactly_the_variables_the_code_reads():
    table = (REPO / "README.md").read_text().split("| variable | meaning | default |")[1]
    table = table.split("\n\n")[0]
    documented = set(re.findall(r"`((?:EAGLE3|VLLM|HF)_[A-Z0-9_]+\*?)`", table))
    read = {v for s in [*RESOURCES.values(), Automation] for v in s.variables().values()}
    prefixes = [d.rstrip("*") for d in documented if d.endswith("*")]
    assert {v for v in read if not any(v.startswith(p) for p in prefixes)} == {
        d for d in documented if not d.endswith("*")
    }
