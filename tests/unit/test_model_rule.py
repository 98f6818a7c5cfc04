"""The one model rule (core/model_rule.py): which model answers a name, or why it is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchmlx.config import load_settings
from batchmlx.core.model_rule import (
    Chosen,
    ModelRule,
    Refused,
    Via,
    Why,
    choose_model,
    parse_aliases,
    split_aliases,
)

OPENAI_SENTENCE = "The provided model 'gpt-4o-mini' is not supported by the Batch API."


def fetchable(hub_id: str) -> None:
    return None


def offline(hub_id: str) -> str:
    return "no network"


@pytest.fixture
def folder(tmp_path: Path) -> str:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    return str(tmp_path / "m")


def test_openai_names_are_served_by_the_serving_model(folder: str) -> None:
    for rule in (ModelRule(), ModelRule(serving=folder), ModelRule(serving=folder, pinned=True)):
        got = choose_model("gpt-4o-mini", rule, hub_problem=offline)
        assert got == Chosen(rule.serving, Via.FALLBACK)


def test_names_of_the_serving_model_are_it() -> None:
    for name in ("default", "SmolLM2-135M-Instruct"):
        assert choose_model(name, ModelRule(), hub_problem=offline) == Chosen("default", Via.NAMED)


def test_other_local_models_are_loaded_unless_pinned(folder: str) -> None:
    assert choose_model(folder, ModelRule(), hub_problem=offline) == Chosen(folder, Via.NAMED)
    assert choose_model("org/model", ModelRule(), hub_problem=fetchable) == Chosen(
        "org/model", Via.NAMED
    )
    # serve runs one model: a client's name of another is answered by it, never loaded
    pinned = ModelRule(pinned=True)
    for name in (folder, "org/model", "./nowhere"):
        assert choose_model(name, pinned, hub_problem=offline) == Chosen("default", Via.FALLBACK)


def test_strict_refuses_unknown_names_as_openai_with_a_hint() -> None:
    got = choose_model("gpt-4o-mini", ModelRule(strict=True), hub_problem=offline)
    assert isinstance(got, Refused) and got.why is Why.UNKNOWN
    assert got.message.startswith(OPENAI_SENTENCE + " ")
    assert "'default' (SmolLM2-135M-Instruct)" in got.message
    assert "--model-alias" in got.message
    served = choose_model("gpt-4o-mini", ModelRule(strict=True, pinned=True), hub_problem=offline)
    assert isinstance(served, Refused)
    assert "This server serves 'default' (SmolLM2-135M-Instruct)" in served.message
    # names of models are still served in strict mode
    assert choose_model("default", ModelRule(strict=True), hub_problem=offline) == Chosen(
        "default", Via.NAMED
    )


def test_aliases_come_first(folder: str) -> None:
    rule = ModelRule(aliases={"gpt-4o-mini": folder, "gpt-4o": "default"}, strict=True)
    assert choose_model("gpt-4o-mini", rule, hub_problem=offline) == Chosen(folder, Via.ALIAS)
    assert choose_model("gpt-4o", rule, hub_problem=offline) == Chosen("default", Via.ALIAS)
    refused = choose_model("gpt-5", rule, hub_problem=offline)
    assert isinstance(refused, Refused) and "'gpt-4o'" in refused.message  # named in the hint
    # serve: an alias must name the one model it runs
    pinned = ModelRule(aliases={"gpt-4o-mini": folder}, pinned=True)
    bad = choose_model("gpt-4o-mini", pinned, hub_problem=offline)
    assert isinstance(bad, Refused) and bad.why is Why.BAD_ALIAS


def test_a_hub_id_that_cannot_be_fetched_is_refused_in_either_mode() -> None:
    for strict in (False, True):
        got = choose_model("org/model", ModelRule(strict=strict), hub_problem=offline)
        assert isinstance(got, Refused) and got.why is Why.UNFETCHABLE
        assert got.message.startswith(
            "The provided model 'org/model' is not supported by the Batch API. It names the "
            "Hugging Face hub model 'org/model', which is not in the local cache and cannot be "
            "fetched: no network."
        )
    via = choose_model("gpt-4o-mini", ModelRule(aliases={"gpt-4o-mini": "org/model"}),
                       hub_problem=offline)  # fmt: skip
    assert isinstance(via, Refused) and "Its alias names the Hugging Face hub model" in via.message


def test_a_path_with_no_model_is_refused_not_replaced(tmp_path: Path) -> None:
    for name in (str(tmp_path / "missing"), str(tmp_path), "./missing", "x.gguf"):
        got = choose_model(name, ModelRule(), hub_problem=offline)
        assert isinstance(got, Refused) and got.why is Why.NO_FILE, name


def test_aliases_parse_from_options_and_the_environment(folder: str) -> None:
    assert parse_aliases([f"gpt-4o-mini={folder}", "a=default", "a=SmolLM2-135M-Instruct"]) == {
        "gpt-4o-mini": folder, "a": "SmolLM2-135M-Instruct"}  # fmt: skip
    for bad in ("gpt-4o-mini", "=default", "x=", "x=./no/such/model"):
        with pytest.raises(ValueError, match="--model-alias"):
            parse_aliases([bad])
    assert split_aliases("a=default, b=default\nc=default\n") == ["a=default", " b=default",
                                                                  "c=default"]  # fmt: skip
    env = {"BATCHMLX_HOME": "/tmp/h", "BATCHMLX_STRICT_MODELS": "1",
           "BATCHMLX_MODEL_ALIASES": f"gpt-4o-mini={folder},gpt-4o=default"}  # fmt: skip
    s = load_settings(env)
    assert s.strict_models is True
    assert dict(s.model_aliases) == {"gpt-4o-mini": folder, "gpt-4o": "default"}
    assert load_settings({"BATCHMLX_HOME": "/tmp/h"}).strict_models is False
    with pytest.raises(ValueError, match=r"\$BATCHMLX_MODEL_ALIASES"):
        load_settings({**env, "BATCHMLX_MODEL_ALIASES": "oops"})
