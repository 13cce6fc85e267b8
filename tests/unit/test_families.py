"""The model-family interface: every registered family fills every field of
:class:`jaxcolossal.models.family.Family`, and a family folder that lacks a function of the
interface is refused by name when its record is built. The KV-cached decode path is optional
(:data:`~jaxcolossal.models.family.DECODE_FUNCTIONS`); every registered family has it. So are a PEFT
adapter's B-row conversions (:data:`~jaxcolossal.models.family.HF_LORA_FUNCTIONS`), which DeepSeek has."""

import dataclasses
import types

import pytest

from jaxcolossal.config import ModelConfig
from jaxcolossal.models import FAMILIES, get_family
from jaxcolossal.models.family import (DECODE_FUNCTIONS, HF_FUNCTIONS, HF_LORA_FUNCTIONS, MODEL_FUNCTIONS, Family,
                                      family_from)
from jaxcolossal.models.llama import hf, model


def test_every_registered_family_fills_the_interface():
    assert sorted(FAMILIES) == ["deepseek", "gemma", "gpt2", "gpt_oss", "llama"]
    for name, fam in FAMILIES.items():
        assert fam.name == name
        for f in MODEL_FUNCTIONS + HF_FUNCTIONS:
            assert callable(getattr(fam, f)), (name, f)
        assert fam.hf_architectures and all(isinstance(a, str) for a in fam.hf_architectures.values())
    assert {f.name for f in dataclasses.fields(Family)} == {
        "name", "module", "hf_architectures", "embedding", "init_from_keys", *MODEL_FUNCTIONS, *HF_FUNCTIONS,
        *DECODE_FUNCTIONS, *HF_LORA_FUNCTIONS}
    assert all(callable(getattr(fam, f)) for fam in FAMILIES.values() for f in DECODE_FUNCTIONS)
    # PEFT's LoRA B rows: DeepSeek's are permuted and fused; the others' are the weights' flattened outputs
    assert [n for n, fam in FAMILIES.items() if fam.lora_b_from_hf and fam.lora_b_to_hf] == ["deepseek"]
    partial = types.ModuleType("jaxcolossal.models.mistral.model")
    for f in MODEL_FUNCTIONS:
        setattr(partial, f, getattr(model, f))
    assert family_from("mistral", partial, hf, object, "embed_tokens").forward_cached is None  # optional


def test_a_family_lacking_a_function_is_refused_by_name():
    partial = types.ModuleType("jaxcolossal.models.mistral.model")
    for f in MODEL_FUNCTIONS:
        if f != "pipeline_stages":
            setattr(partial, f, getattr(model, f))
    with pytest.raises(TypeError, match=r"'mistral' lacks jaxcolossal\.models\.mistral\.model\.pipeline_stages"):
        family_from("mistral", partial, hf, object, embedding="embed_tokens")


def test_get_family_refuses_an_unknown_type():
    with pytest.raises(Exception,
                       match=r"model.type='mistral': allowed values are \['deepseek', 'gemma', 'gpt2', 'gpt_oss', 'llama'\]"):
        get_family(dataclasses.replace(ModelConfig(), type="mistral"))
