"""A Llama-2-7B config is advised from config.json alone, on the meta device, without allocating its weights."""

from __future__ import annotations

import json
import resource

import pytest

from ampdoctor.advice import advise

pytestmark = pytest.mark.slow   # builds a Llama-sized model's states on the meta device and a fake step: about a minute

pytest.importorskip("transformers")

LLAMA_2_7B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, torch_dtype="float16")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-2-7b")
    (folder / "config.json").write_text(json.dumps(LLAMA_2_7B))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    advice = advise(folder, batch_size=1, seq_len=256, budget="24GiB", devices=8)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    return advice, grown


def test_exact_parameter_count_without_allocating(llama):
    advice, grown = llama
    assert advice.parameters == advice.trainable == 6_738_415_616
    assert grown < 2 * 2**30  # its fp32 weights alone would be 25 GiB


def test_model_states_follow_the_bytes_per_parameter(llama):
    advice = llama[0]
    psi = advice.parameters
    assert advice.strategy("fp32")["bytes"]["weights"] == 4 * psi
    amp = advice.strategy("amp_bf16")["bytes"]
    assert amp["optimizer_state"] == 8 * psi + 4 * 291  # 291 parameter tensors, one fp32 step each
    assert advice.strategy("pure_bf16")["bytes"]["weights"] == 2 * psi
    assert advice.lora["parameters"] == 4_194_304  # r=8 on q_proj and v_proj: 32 layers * 2 * 8 * (4096 + 4096)


def test_the_json_has_every_component_and_a_fit_per_strategy(llama):
    data = json.loads(llama[0].to_json())
    assert data["parameters"] == 6_738_415_616 and data["trainable"] == 6_738_415_616
    for entry in data["strategies"]:
        assert set(entry["bytes"]) == {"weights", "gradients", "optimizer_state", "master_weights", "activations",
                                       "total"}
        assert entry["bytes"]["activations"] > 0 and isinstance(entry["fits"], bool)
    fits = {e["key"]: e["fits"] for e in data["strategies"]}
    assert not fits["amp_bf16"] and fits["lora"] and fits["zero3"]
    # autocast keeps a bf16 copy of every Linear weight for backward: about 2 B per parameter
    copies = llama[0].strategy("amp_bf16")["activation_detail"]["weight_copies"]
    assert 1.9 * 6.7e9 < copies < 2 * 6.74e9
    assert data["recommendation"]["strategy"] in ("fsdp", "zero3")
