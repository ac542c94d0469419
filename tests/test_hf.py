"""epmoe.hf on one process: the "epmoe" experts backend against transformers' eager experts for every family
(fp32, bf16, fp8 checkpoints' FP8Experts), what it refuses, checkpoints read by the slice in every format,
save_pretrained round trips, expert parallelism on one rank, presets at the real shapes; and the configs and
state-dict helpers for epmoe's own FusedMoE."""
import copy
import gc
import json
import os
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F_

pytest.importorskip("transformers", reason="epmoe.hf needs transformers (pip install 'epmoe[hf]')")

import epmoe  # noqa: E402
import epmoe.hf  # noqa: E402
import hf_models  # noqa: E402
from epmoe.hf import config_from_hf, expert_weights  # noqa: E402
from epmoe.hf.checkpoint import (SIGMOID_MODEL_TYPES, SOFTMAX_MODEL_TYPES, UNNORMALIZED_MODEL_TYPES,  # noqa: E402
                                 UNSUPPORTED_ROUTERS, Checkpoint, read_experts)
from epmoe.hf.fp8 import dequantize_experts, quantize_experts  # noqa: E402
from epmoe.hf.parallel import EPOptions, experts_modules  # noqa: E402
from epmoe.hf.run import TOLERANCES, ExpertsCalls  # noqa: E402
from epmoe.testing import rel_error  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

NEW = 5


def _epmoe_copy(model):
    out = copy.deepcopy(model)
    out.set_experts_implementation("epmoe")
    return out


@pytest.mark.parametrize("family,batch,length", [(f, 3, 7) for f in hf_models.FAMILIES] +
                         [("qwen3_moe", 1, 1), ("deepseek_v3", 1, 1)])
def test_backend_fp32_matches_eager(family, batch, length):
    """fp32: the logits of every generated position within 1e-5 of transformers' eager experts, the same
    greedy tokens."""
    model = hf_models.tiny_model(family)
    ids = hf_models.prompts(0, batch, length)
    ref_tokens, ref_logits = hf_models.greedy(model, ids, NEW)
    tokens, logits = hf_models.greedy(_epmoe_copy(model), ids, NEW)
    assert rel_error(logits, ref_logits) <= TOLERANCES["fp32"]
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("family", hf_models.FAMILIES)
def test_backend_bf16_layers_match_eager(family):
    """bf16: every MoE layer's output, on the inputs it was given, within the bf16 tolerance of transformers'
    eager experts on the same inputs (computed in fp32 on the same bf16 weights)."""
    model = hf_models.tiny_model(family, dtype=torch.bfloat16)
    ours = _epmoe_copy(model)
    calls = ExpertsCalls(ours)
    hf_models.greedy(ours, hf_models.prompts(0, 3, 6), NEW)
    calls.close()
    reference = copy.deepcopy(model).float()
    modules = dict(reference.named_modules())
    with torch.no_grad():
        errors = [rel_error(out, modules[name](x.float(), ids, w.float())) for name, x, ids, w, out in calls.calls]
    assert len(errors) == (NEW) * len(experts_modules(model))
    assert max(errors) <= TOLERANCES["bf16"]


def test_backend_edge_calls_and_aliasing():
    """0 tokens, an odd count with skewed routing (every token's first expert the same); the experts view the
    module's tensors (no copy), see in-place updates, and are rebuilt when a parameter is replaced."""
    model = hf_models.tiny_model("qwen3_moe")
    name, module = experts_modules(model)[0]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 64, generator=g)
    ids = torch.full((9, 2), 3)
    ids[:, 1] = torch.arange(9) % 12
    w = torch.rand(9, 2, generator=g)
    eager = lambda: type(module).forward.__wrapped__(module, x, ids, w)  # noqa: E731 - the class's own loop
    with torch.no_grad():
        assert epmoe.hf.experts_forward(module, x[:0], ids[:0], w[:0]).shape == (0, 64)
        torch.testing.assert_close(epmoe.hf.experts_forward(module, x, ids, w), eager(), rtol=1e-5, atol=1e-6)
        moe = module.__dict__["_epmoe_experts"][1]
        assert moe.experts.w13.data_ptr() == module.gate_up_proj.data_ptr()
        module.gate_up_proj.mul_(2)
        torch.testing.assert_close(epmoe.hf.experts_forward(module, x, ids, w), eager(), rtol=1e-5, atol=1e-6)
        module.down_proj = torch.nn.Parameter(module.down_proj * -1, requires_grad=False)
        torch.testing.assert_close(epmoe.hf.experts_forward(module, x, ids, w), eager(), rtol=1e-5, atol=1e-6)
        assert module.__dict__["_epmoe_experts"][1] is not moe
    with pytest.raises(ValueError, match="inference only"):
        epmoe.hf.experts_forward(module, x.requires_grad_(), ids, w)


def test_backend_refuses_gradients_for_the_experts_weights():
    """A fine-tune of the experts alone (their weights require gradients; the hidden states and router weights
    do not) is refused like any call that needs a backward, and runs under no_grad."""
    model = hf_models.tiny_model("qwen3_moe")
    model.requires_grad_(False)
    _, module = experts_modules(model)[0]
    module.gate_up_proj.requires_grad_(True)
    g = torch.Generator().manual_seed(2)
    x, ids = torch.randn(5, 64, generator=g), torch.randint(0, 12, (5, 2), generator=g)
    w = torch.rand(5, 2, generator=g)
    with pytest.raises(ValueError, match="inference only"):
        epmoe.hf.experts_forward(module, x, ids, w)
    with torch.no_grad():
        want = type(module).forward.__wrapped__(module, x, ids, w)
        torch.testing.assert_close(epmoe.hf.experts_forward(module, x, ids, w), want, rtol=1e-5, atol=1e-6)


def test_backend_follows_in_place_changes_to_the_scales_it_converts():
    """UE8M0 block scales (float8_e8m0fnu powers of two, as DeepSeek-V3.1's checkpoint ships them) are
    converted to float32 once; an in-place change to them (what load_state_dict does) rebuilds the layer,
    which then computes what a layer built afresh computes; calls with nothing changed keep the layer."""
    model = quantize_experts(hf_models.tiny_model("qwen3_moe", hidden=160, inter=128))
    _, module = experts_modules(model)[0]
    with torch.no_grad():
        for name in ("gate_up_proj_scale_inv", "down_proj_scale_inv"):
            scale = getattr(module, name)
            setattr(module, name, torch.nn.Parameter(torch.exp2(scale.log2().ceil()).to(torch.float8_e8m0fnu),
                                                     requires_grad=False))
    g = torch.Generator().manual_seed(0)
    x, ids = torch.randn(6, 160, generator=g), torch.randint(0, 12, (6, 2), generator=g)
    w = torch.rand(6, 2, generator=g)
    with torch.no_grad():
        before = epmoe.hf.experts_forward(module, x, ids, w)
        moe = module.__dict__["_epmoe_experts"][1]
        assert torch.equal(epmoe.hf.experts_forward(module, x, ids, w), before)
        assert module.__dict__["_epmoe_experts"][1] is moe
        module.down_proj_scale_inv.copy_((module.down_proj_scale_inv.float() * 4).to(torch.float8_e8m0fnu))
        after = epmoe.hf.experts_forward(module, x, ids, w)
        assert module.__dict__["_epmoe_experts"][1] is not moe
        del module.__dict__["_epmoe_experts"]
        assert torch.equal(after, epmoe.hf.experts_forward(module, x, ids, w))
        assert rel_error(after, 4 * before) < 1e-2  # the down's scales, times 4


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_backend_fp8_experts(family):
    """transformers' FP8Experts (float8_e4m3fn weights, 128x128 float32 scales) run on epmoe's fp8_block
    experts as they are: every MoE layer within the fp8 tolerance of eager experts holding the same weights
    dequantized, the weights never copied."""
    fp8 = quantize_experts(hf_models.tiny_model(family, hidden=160, inter=128))
    reference = dequantize_experts(fp8, hf_models.tiny_model(family, hidden=160, inter=128))
    fp8.set_experts_implementation("epmoe")
    calls = ExpertsCalls(fp8)
    hf_models.greedy(fp8, hf_models.prompts(0, 2, 5), NEW)
    calls.close()
    errors = calls.errors(reference)
    assert errors and max(errors) <= TOLERANCES["fp8_block"]
    _, module = experts_modules(fp8)[0]
    moe = module.__dict__["_epmoe_experts"][1]
    assert moe.cfg.quant == "fp8_block" and moe.experts.w13.data_ptr() == module.gate_up_proj.data_ptr()


def test_gpt_oss_and_other_activations_refused():
    """What epmoe cannot compute exactly is refused, naming the model and each reason."""
    gpt_oss = hf_models.tiny_model("gpt_oss")
    gpt_oss.set_experts_implementation("epmoe")
    with torch.no_grad(), pytest.raises(ValueError, match="GptOssExperts.*biases; interleaved gate/up rows; "
                                                          r"transposed weights \(\[E, D, 2F\]\); its own gating"):
        gpt_oss(hf_models.prompts(0, 1, 3))
    with pytest.raises(ValueError, match="cannot run GptOssForCausalLM"):
        epmoe.hf.expert_parallel(gpt_oss, None)
    gelu = hf_models.tiny_model("mixtral", hidden_act="gelu")
    gelu.set_experts_implementation("epmoe")
    with torch.no_grad(), pytest.raises(ValueError, match="activation GELUActivation"):
        gelu(hf_models.prompts(0, 1, 3))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_save_pretrained_round_trip(family, tmp_path):
    """A model that ran on epmoe saves exactly what transformers saves (no epmoe tensors), and loads back,
    with transformers (experts_implementation="epmoe") and with epmoe.hf.from_pretrained, to the same logits
    (Qwen3-MoE with tied embeddings: no lm_head in the checkpoint)."""
    model = hf_models.tiny_model(family, tie_word_embeddings=family == "qwen3_moe")
    ids = hf_models.prompts(0, 2, 6)
    with torch.no_grad():
        ref = model(ids).logits
        ours = _epmoe_copy(model)
        ours(ids)
    model.save_pretrained(tmp_path / "eager")
    ours.save_pretrained(tmp_path / "ours")
    assert Checkpoint(tmp_path / "ours").keys() == Checkpoint(tmp_path / "eager").keys()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", experts_implementation="epmoe")
    sliced = epmoe.hf.from_pretrained(tmp_path / "ours", device="cpu")
    with torch.no_grad():
        for m in (loaded, sliced):
            assert rel_error(m(ids).logits, ref) <= TOLERANCES["fp32"]


def test_checkpoint_formats(tmp_path):
    """Fused 3-D keys and per-expert keys (DeepSeek/Qwen and Mixtral names) give the same experts; rows are
    read by the slice."""
    mixtral = hf_models.tiny_model("mixtral")
    mixtral.save_pretrained(tmp_path / "per_expert")
    hf_models.save_fused(mixtral, str(tmp_path / "fused"))
    keys = Checkpoint(tmp_path / "per_expert").keys()
    assert "model.layers.1.block_sparse_moe.experts.11.w3.weight" in keys
    module = mixtral.model.layers[1].mlp.experts
    for folder, prefix in (("per_expert", "model.layers.1.block_sparse_moe.experts"),
                           ("fused", "model.layers.1.mlp.experts")):
        w = read_experts(Checkpoint(tmp_path / folder), ["model.layers.1.mlp.experts", prefix], 4, 8)
        assert torch.equal(w.w13_END, module.gate_up_proj[4:8]) and torch.equal(w.w2_EDF, module.down_proj[4:8])
    ids = hf_models.prompts(0, 2, 4)
    with torch.no_grad():
        ref = mixtral(ids).logits
        for folder in ("per_expert", "fused"):
            assert rel_error(epmoe.hf.from_pretrained(tmp_path / folder, device="cpu")(ids).logits, ref) <= 1e-5
    with pytest.raises(ValueError, match="no experts 0:12"):
        read_experts(Checkpoint(tmp_path / "fused"), ["model.layers.1.nope"], 0, 12)


def test_fp8_checkpoint_loads_as_is(tmp_path):
    """An fp8 checkpoint (per-expert float8_e4m3fn weights with weight_scale_inv, an fp8 dense projection):
    the experts stay fp8 on epmoe's fp8_block experts, the dense weight is dequantized; every MoE layer within
    the fp8 tolerance of the dequantized model's eager experts on the same inputs."""
    plain = hf_models.tiny_model("qwen3_moe", hidden=160, inter=128)
    hf_models.save_fp8(plain, str(tmp_path / "fp8"))
    model = epmoe.hf.from_pretrained(tmp_path / "fp8", device="cpu")
    name, module = experts_modules(model)[0]
    assert module.gate_up_proj.dtype == torch.float8_e4m3fn and module.gate_up_proj_scale_inv.shape == (12, 2, 2)
    assert model.model.layers[0].self_attn.o_proj.weight.dtype == torch.float32
    reference = epmoe.hf.loading.load_dequantized(tmp_path / "fp8", device="cpu")
    reference.set_experts_implementation("eager")
    calls = ExpertsCalls(model)
    hf_models.greedy(model, hf_models.prompts(0, 2, 5), NEW)
    calls.close()
    errors = calls.errors(reference)
    assert len(errors) == NEW * 2 and max(errors) <= TOLERANCES["fp8_block"]
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weight_block_size \(64, 64\)"):
        epmoe.hf.from_pretrained(tmp_path / "fp8", device="cpu")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_expert_parallel_one_rank(family):
    """expert_parallel with no group: the EP path on one rank (dispatcher local), the same tokens as eager
    (every family over 2 and 4 ranks: test_hf_parallel.py)."""
    model = hf_models.tiny_model(family)
    ids = hf_models.prompts(0, 2, 5)
    ref_tokens, ref_logits = hf_models.greedy(model, ids, NEW)
    epmoe.hf.expert_parallel(model, None, options=EPOptions(experts="reference"))
    tokens, logits = hf_models.greedy(model, ids, NEW, run=lambda m, x, **kw: epmoe.hf.generate(m, x, **kw))
    assert rel_error(logits, ref_logits) <= TOLERANCES["fp32"] and torch.equal(tokens, ref_tokens)
    with pytest.raises(ValueError, match="expert-parallel already"):
        epmoe.hf.expert_parallel(model, None)


@pytest.mark.parametrize("convert", ["backend", "expert_parallel"])
def test_a_dropped_model_frees_its_experts_without_the_garbage_collector(convert):
    """A model run through epmoe is freed by reference counting alone, layers and the group they hold with it:
    a reference cycle kept them to the next collection, or to interpreter exit (where a gloo group aborted)."""
    model = hf_models.tiny_model("qwen3_moe")
    if convert == "backend":
        model.set_experts_implementation("epmoe")
    else:
        epmoe.hf.expert_parallel(model, None, options=EPOptions(experts="reference"))
    with torch.no_grad():
        model(hf_models.prompts(0, 2, 5))
    freed = [weakref.ref(m) for _, m in experts_modules(model)]
    gc.disable()
    try:
        del model
        assert [r() for r in freed] == [None] * len(freed)
    finally:
        gc.enable()


def test_expert_parallel_decode_limit_and_a_model_run_through_the_backend_before():
    """A decode limit of its own gets decode layers of its own (the same dispatcher), which generate as eager
    does; a model that ran through the epmoe experts backend before keeps no layer of all E experts."""
    model = hf_models.tiny_model("qwen3_moe")
    ids = hf_models.prompts(0, 2, 5)
    ref_tokens, ref_logits = hf_models.greedy(model, ids, NEW)
    model.set_experts_implementation("epmoe")
    with torch.no_grad():
        model(ids)
    experts = model.model.layers[0].mlp.experts
    assert "_epmoe_experts" in experts.__dict__
    model.set_experts_implementation("eager")
    epmoe.hf.expert_parallel(model, None, options=EPOptions(experts="reference", max_tokens_per_rank=64,
                                                            decode_max_tokens_per_rank=8))
    assert "_epmoe_experts" not in experts.__dict__
    run = experts.forward
    assert run.decode is not run.prefill and run.decode.dispatcher.name == run.prefill.dispatcher.name
    assert (run.prefill.cfg.max_tokens_per_rank, run.decode.cfg.max_tokens_per_rank) == (64, 8)
    tokens, logits = hf_models.greedy(model, ids, NEW, run=lambda m, x, **kw: epmoe.hf.generate(m, x, **kw))
    assert rel_error(logits, ref_logits) <= TOLERANCES["fp32"] and torch.equal(tokens, ref_tokens)


def test_presets_have_the_real_shapes():
    """The presets' parameter counts at full depth are the published models' (built on the meta device)."""
    from epmoe.hf.presets import preset_config
    published = {"qwen3-30b-a3b": 30.5e9, "deepseek-v2-lite": 15.7e9, "deepseek-v3": 671.0e9, "mixtral-8x7b": 46.7e9}
    for name, count in published.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(preset_config(name))
        assert sum(p.numel() for p in model.parameters()) == pytest.approx(count, rel=0.005), name
    config = preset_config("deepseek-v3", layers=2)
    assert (config.num_hidden_layers, config.first_k_dense_replace) == (2, 1)
    with pytest.raises(ValueError, match="unknown preset 'llama'"):
        preset_config("llama")


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_backend_on_gpu(family, quant):
    """On a GPU (Triton or grouped_mm experts by "auto"; fp8: Triton fp8_block): every MoE call within its
    precision's tolerance of eager experts on the same inputs (fp32 math on the same weights, fp8 ones
    dequantized); expert_parallel on one rank with the Triton experts likewise."""
    model = hf_models.tiny_model(family, dtype=torch.bfloat16, hidden=256, inter=128).cuda()
    if quant == "fp8":
        model = quantize_experts(model)
    reference = copy.deepcopy(model).float() if quant is None else \
        dequantize_experts(model, hf_models.tiny_model(family, hidden=256, inter=128).cuda())
    reference.set_experts_implementation("eager")
    precision = "bf16" if quant is None else "fp8_block"
    for make_epmoe in (lambda m: m.set_experts_implementation("epmoe"),
                       lambda m: epmoe.hf.expert_parallel(m, None, options=EPOptions(experts="triton"))):
        ours = copy.deepcopy(model)
        make_epmoe(ours)
        calls = ExpertsCalls(ours)
        hf_models.greedy(ours, hf_models.prompts(0, 3, 9).cuda(), NEW, run=lambda m, x, **kw: m.generate(x, **kw))
        calls.close()
        with torch.no_grad():
            errors = [rel_error(out, dict(reference.named_modules())[name](x.float(), i, w.float()))
                      for name, x, i, w, out in calls.calls]
        assert len(errors) == NEW * len(experts_modules(model)) and max(errors) <= TOLERANCES[precision], errors


def test_ep_implementation_registered():
    """epmoe is in transformers' EPImplementationInterface where transformers has one (5.24+)."""
    try:
        from transformers.distributed.expert_parallel import EPImplementationInterface
    except ImportError:
        pytest.skip("this transformers has no EPImplementationInterface (before 5.24)")
    assert "epmoe" in EPImplementationInterface()
    from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    from transformers.integrations.moe import ExpertsInterface
    assert "epmoe" in ExpertsInterface() and "epmoe" in FP8ExpertsInterface()


def test_config_from_deepseek_v3():
    hf = SimpleNamespace(model_type="deepseek_v3", n_routed_experts=256, num_experts_per_tok=8, hidden_size=7168,
                         intermediate_size=18432, moe_intermediate_size=2048, scoring_func="sigmoid", n_group=8,
                         topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)
    cfg = config_from_hf(hf, max_tokens_per_rank=128)
    assert (cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size) == (256, 8, 7168, 2048)
    assert (cfg.scoring, cfg.num_groups, cfg.topk_groups, cfg.routed_scaling_factor) == ("sigmoid", 8, 4, 2.5)
    assert cfg.renormalize and cfg.max_tokens_per_rank == 128


def test_config_from_qwen3_and_mixtral():
    qwen = config_from_hf(SimpleNamespace(model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8,
                                          hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                                          norm_topk_prob=False))
    assert (qwen.num_experts, qwen.intermediate_size, qwen.scoring, qwen.renormalize) == (128, 768, "softmax", False)
    assert qwen.num_groups is None
    mixtral = config_from_hf(SimpleNamespace(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2,
                                             hidden_size=4096, intermediate_size=14336), dtype=torch.float32)
    assert (mixtral.num_experts, mixtral.top_k, mixtral.intermediate_size) == (8, 2, 14336)
    assert mixtral.renormalize and mixtral.dtype == torch.float32


def _routed_layer(family: str):
    """The last MoE block of a tiny `family` model, its correction bias (if any) made nonzero."""
    model = hf_models.tiny_model(family)
    block = model.model.layers[-1].mlp
    bias = getattr(block.gate, "e_score_correction_bias", None)
    if bias is not None:
        with torch.no_grad():
            bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    return model, block, bias


@pytest.mark.parametrize("family", [*hf_models.FAMILIES, "glm4_moe"])
def test_config_from_hf_routes_as_the_model(family):
    """FusedMoE(config_from_hf(model.config)) given the router's logits (and correction bias) computes what the
    model's own experts compute on its own routing, DeepSeek-V3's and GLM-4-MoE's configs holding no
    scoring_func included."""
    if family == "glm4_moe" and "glm4_moe" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no GLM-4-MoE")
    model, block, bias = _routed_layer(family)
    cfg = config_from_hf(model.config, dtype=torch.float32)
    assert cfg.scoring == ("sigmoid" if family in ("deepseek_v3", "glm4_moe") else "softmax")
    moe = epmoe.FusedMoE(cfg, device="cpu", experts="reference")
    moe.load_experts(block.experts.gate_up_proj.data, block.experts.down_proj.data)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    seen = {}
    hook = block.experts.register_forward_hook(lambda module, args, out: seen.update(out=out))
    with torch.no_grad():
        block(x[None])
        hook.remove()
        logits = F_.linear(x, block.gate.weight.float())
        out = moe(x, logits, correction_bias_E=bias if cfg.scoring == "sigmoid" else None)
    assert rel_error(out, seen["out"].reshape(16, 64)) < 1e-5


def test_backend_skips_the_id_transformers_expert_parallelism_gives_other_ranks_experts():
    """Under transformers' own expert parallelism a module holds L of the E experts and gets id L (weight 0)
    for a slot whose expert is on another rank: the epmoe backend skips it, and any id above L as
    transformers' own backends do (with torch.distributed
    initialized, as that parallelism has it); the reference is transformers' eager code with those slots
    on a local expert at weight 0 (transformers 5.17's eager code refuses id L itself)."""
    experts = hf_models.tiny_model("qwen3_moe").model.layers[0].mlp.experts
    E = experts.gate_up_proj.shape[0]
    L = E // 2
    local = copy.deepcopy(experts)
    local.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj[:L].clone())
    local.down_proj = torch.nn.Parameter(experts.down_proj[:L].clone())
    local.num_experts = L
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=gen)
    ids = torch.randint(0, E, (7, 2), generator=gen)
    weights = torch.rand(7, 2, generator=gen)
    elsewhere = ids >= L
    assert elsewhere.any() and not elsewhere.all()
    weights = weights.masked_fill(elsewhere, 0.0)
    with torch.no_grad():
        local.config._experts_implementation = "eager"
        ref = local(x, ids.masked_fill(elsewhere, 0), weights)
    ids = torch.where(elsewhere, L + torch.arange(ids.numel()).view(ids.shape) % 2, ids)  # (>= L: skipped)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.no_grad():
            local.config._experts_implementation = "epmoe"
            out = local(x, ids, weights)
    finally:
        dist.destroy_process_group()
    assert rel_error(out, ref) < 1e-5 and ref.norm() > 0


@pytest.mark.parametrize("method,grouped", [("greedy", False), ("group_limited_greedy", True)])
def test_config_from_deepseek_v2_groups_only_for_group_limited_greedy(method, grouped):
    """DeepSeek-V2's topk_method "greedy" (its default) takes the top-k of all experts, whatever n_group
    says; "group_limited_greedy" takes it within the best topk_group groups. epmoe.route on the config
    picks what the model's router picks."""
    model = hf_models.tiny_model("deepseek_v2", topk_method=method, n_group=4, topk_group=1)
    cfg = config_from_hf(model.config, dtype=torch.float32)
    assert (cfg.num_groups, cfg.topk_groups) == ((4, 1) if grouped else (None, None))
    router = model.model.layers[-1].mlp.gate
    with torch.no_grad():
        logits, _, ids_hf = router(torch.randn(20, 64, generator=torch.Generator().manual_seed(4)))
        _, ids = epmoe.route(logits, cfg)
    assert torch.equal(ids_hf.sort(dim=-1).values, ids.long().sort(dim=-1).values)


KNOWN_ROUTERS = sorted(SIGMOID_MODEL_TYPES | SOFTMAX_MODEL_TYPES | UNNORMALIZED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", KNOWN_ROUTERS)
def test_config_from_hf_routes_as_the_router(model_type):
    """For every model type config_from_hf knows: epmoe.route on its config (times the routed scaling factor,
    as FusedMoE applies it), given a tiny model's router logits and its score correction bias if it has one,
    picks the experts and weights that the model's MoE block hands its experts."""
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    config, logits, bias, ids_hf, weights_hf = hf_models.routed_call(model_type)
    cfg = config_from_hf(config, dtype=torch.float32)
    weights, ids = epmoe.route(logits, cfg, correction_bias_E=bias)  # (a bias with softmax scoring: refused)
    theirs, ours = ids_hf.long().sort(dim=-1), ids.long().sort(dim=-1)
    assert torch.equal(theirs.values, ours.values)
    torch.testing.assert_close(weights.gather(1, ours.indices) * cfg.routed_scaling_factor,
                               weights_hf.float().gather(1, theirs.indices), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", sorted(UNSUPPORTED_ROUTERS))
def test_config_from_hf_refuses_routers_it_cannot_compute(model_type):
    hf = SimpleNamespace(model_type=model_type, num_experts=8, num_experts_per_tok=2, hidden_size=64,
                         intermediate_size=32)
    with pytest.raises(ValueError, match=f"cannot compute a '{model_type}' model's router"):
        config_from_hf(hf, scoring="softmax")


def test_config_from_hf_takes_an_unknown_router_only_when_told():
    hf = SimpleNamespace(model_type="some_new_moe", num_experts=8, num_experts_per_tok=2, hidden_size=64,
                         intermediate_size=32, norm_topk_prob=False)
    with pytest.raises(ValueError, match="does not know how a model_type='some_new_moe' router"):
        config_from_hf(hf)
    cfg = config_from_hf(hf, scoring="sigmoid")
    assert (cfg.scoring, cfg.renormalize) == ("sigmoid", False)


def test_config_from_dense_model_is_refused():
    with pytest.raises(ValueError, match="number of experts"):
        config_from_hf(SimpleNamespace(hidden_size=64, intermediate_size=128))


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
def test_checkpoint_experts_in_fused_moe(names):
    E, K, D, F, T = 4, 2, 32, 24, 7
    prefix = "model.layers.1.mlp.experts."
    g = torch.Generator().manual_seed(0)
    sd = {}
    for e in range(E):
        for name, shape in zip(names, ((F, D), (F, D), (D, F))):
            sd[f"{prefix}{e}.{name}.weight"] = torch.randn(shape, generator=g) / 8
    cfg = epmoe.MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=F, dtype=torch.float32)
    moe = epmoe.FusedMoE(cfg, device="cpu")
    moe.load_experts(*expert_weights(sd, prefix, E))
    x = torch.randn(T, D, generator=g)
    logits = torch.randn(T, E, generator=g)
    out = moe(x, logits)
    weights, ids = epmoe.route(logits, cfg)
    gate, up, down = names
    expected = torch.zeros(T, D)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            h = F_.silu(sd[f"{prefix}{e}.{gate}.weight"] @ x[t]) * (sd[f"{prefix}{e}.{up}.weight"] @ x[t])
            expected[t] += weights[t, k] * (sd[f"{prefix}{e}.{down}.weight"] @ h)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_checkpoint_missing_expert_is_refused():
    sd = {f"experts.0.{n}.weight": torch.zeros(2, 2) for n in ("gate_proj", "up_proj", "down_proj")}
    with pytest.raises(ValueError, match="experts.1.gate_proj.weight"):
        expert_weights(sd, "experts.", 2)
    with pytest.raises(ValueError, match="no experts 0:2"):
        expert_weights(sd, "model.experts.", 2)


def test_checkpoint_reads_only_the_rows_asked_for(tmp_path):
    """Checkpoint.rows reads the bytes of the rows asked for: a truncated file fails only past them."""
    from safetensors.torch import save_file
    t = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    save_file({"t": t}, os.path.join(tmp_path, "model.safetensors"))
    ckpt = Checkpoint(tmp_path)
    assert torch.equal(ckpt.rows("t", 1, 3), t[1:3]) and torch.equal(ckpt.get("t"), t)
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "model.safetensors") - 6 * 4)
    assert torch.equal(Checkpoint(tmp_path).rows("t", 0, 3), t[:3])
    with pytest.raises(ValueError, match="truncated"):
        Checkpoint(tmp_path).rows("t", 2, 4)
