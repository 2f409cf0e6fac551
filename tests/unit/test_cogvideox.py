"""CogVideoX in one process: the wrapper against diffusers' own forward and pipeline, its PipeFusion
stage methods against its whole-model call, its attention processor against diffusers', and its
model sampling against diffusers' CogVideoX scheduler and ComfyUI's discrete zero-SNR sampling."""

import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from xdit_backend.errors import UserError
from xdit_backend.models import latent_formats
from xdit_backend.models.cogvideox import CogVideoXModel, CogVideoXProcessor, CogVideoXSpec
from xdit_backend.sampling.v_prediction import ZeroSNRVSampling

BASE = dict(num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16, time_embed_dim=32,
            text_embed_dim=64, num_layers=2, sample_width=12, sample_height=8, sample_frames=5, patch_size=2,
            max_text_seq_length=8)
VARIANTS = {  # (config, latent [B, C, T, h, w] not of the training size: the positions are recomputed)
    "2b": ({**BASE, "use_rotary_positional_embeddings": False}, (1, 16, 3, 8, 8)),
    "5b": ({**BASE, "use_rotary_positional_embeddings": True}, (1, 16, 3, 8, 8)),
    "1.5": ({**BASE, "use_rotary_positional_embeddings": True, "patch_size_t": 2}, (1, 16, 4, 8, 12)),
}


def build(config) -> CogVideoXModel:
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    transformer = CogVideoXTransformer3DModel(**config)
    with torch.no_grad():  # diffusers zero-initialises nothing here, but make every weight matter
        for parameter in transformer.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    return CogVideoXModel(transformer, "test", CogVideoXSpec.from_config(config), compute_dtype=torch.float32)


def inputs(shape, text_tokens=8):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=generator)
    context = torch.randn(shape[0], text_tokens, 64, generator=generator)
    return x, torch.tensor([731.0]), {"context": context}


def pipeline_rope(model, shape):
    """(cos, sin) as diffusers' CogVideoX pipeline computes them for a latent of ``shape``."""
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import CogVideoXPipeline

    pipeline = SimpleNamespace(transformer=model.transformer, vae_scale_factor_spatial=8)
    return CogVideoXPipeline._prepare_rotary_positional_embeddings(pipeline, shape[-2] * 8, shape[-1] * 8, shape[2],
                                                                   torch.device("cpu"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_output_is_diffusers_forward_with_the_pipelines_positions(variant):
    config, shape = VARIANTS[variant]
    model = build(config)
    x, timestep, cond = inputs(shape)
    rope = pipeline_rope(model, shape) if config["use_rotary_positional_embeddings"] else None
    with torch.no_grad():
        theirs = model.transformer(hidden_states=x.permute(0, 2, 1, 3, 4), encoder_hidden_states=cond["context"],
                                   timestep=timestep, image_rotary_emb=rope, return_dict=False)[0]
        ours = model.output(x, timestep, cond, None)
    assert ours.shape == shape
    assert torch.equal(ours, theirs.permute(0, 2, 1, 3, 4))


def run_stages(model, x, timestep, cond, tokens):
    """PipeFusion's path for one chunk holding the whole latent: embed, the blocks, head, unpatchify."""
    inputs = model.step_inputs(tuple(x.shape), timestep, cond, None)
    positions = model.positions(tuple(x.shape))
    image, text = model.embed(x, tokens, inputs, positions), model.embed_text(inputs)
    kwargs = model.block_kwargs(inputs, positions, tokens, text.shape[1])
    for block in model.transformer.transformer_blocks:
        image, text = model.run_block(block, image, text, kwargs)
    return model.unpatchify(model.head(image, inputs, tokens), tuple(x.shape))


@pytest.mark.parametrize("variant", VARIANTS)
def test_stage_methods_compose_to_the_whole_model(variant):
    config, shape = VARIANTS[variant]
    model = build(config)
    x, timestep, cond = inputs(shape)
    tokens = torch.arange(model.spec.token_grid(shape[-1] * 8, shape[-2] * 8, (shape[2] - 1) * 4 + 1)[0])
    with torch.no_grad():
        staged, whole = run_stages(model, x, timestep, cond, tokens), model.output(x, timestep, cond, None)
    assert (staged - whole).abs().max() <= 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_band_embeds_as_its_tokens_of_the_whole(variant):
    """A patch (token rows 1-2 of every frame) gets the whole latent's positions at its tokens."""
    config, shape = VARIANTS[variant]
    model = build(config)
    x, timestep, cond = inputs(shape)
    pt = model.spec.patch_t
    grid = torch.arange(shape[2] // pt * shape[-2] // 2 * shape[-1] // 2).view(shape[2] // pt, shape[-2] // 2, -1)
    band = grid[:, 1:3].reshape(-1)  # frames × 2 rows × columns
    with torch.no_grad():
        step = model.step_inputs(shape, timestep, cond, None)
        positions = model.positions(shape)
        whole = model.embed(x, grid.reshape(-1), step, positions)
        part = model.embed(x[..., 2:6, :], band, step, positions)
        kwargs = model.block_kwargs(step, positions, band, 8)
    assert torch.allclose(part, whole[:, band], atol=1e-6)
    if model.spec.rotary:
        assert torch.equal(kwargs["image_rotary_emb"][0], positions[0][band])


@pytest.mark.parametrize("variant", ["2b", "5b"])
def test_processor_with_a_plain_core_is_diffusers_attention(variant):
    config, shape = VARIANTS[variant]
    model = build(config)
    x, timestep, cond = inputs(shape)
    seen = []

    def core(q, k, v, text_tokens):  # [B, S, H, D] → [B, S, H, D]
        seen.append(text_tokens)
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)

    with torch.no_grad():
        theirs = model.output(x, timestep, cond, None)
        model.transformer.set_attn_processor(CogVideoXProcessor(core))
        ours = model.output(x, timestep, cond, None)
    assert (ours - theirs).abs().max() <= 1e-5 and seen == [8, 8]


def test_1_5_image_to_video_is_diffusers_forward_on_the_concatenated_image_at_ofs_2():
    """CogVideoX1.5-5B-I2V as ComfyUI feeds it (model_base.CogVideoX.concat_cond, extra_conds' ofs 2.0): the start
    image's one-frame latent padded with zero frames to the video's and scaled into model space, concatenated to
    the input; diffusers' forward on that input at ofs 2.0 is ours, and PipeFusion's stage methods (given the
    concatenated input, as its driver gives it) compose to the same."""
    config, shape = VARIANTS["1.5"]
    config = {**config, "in_channels": 32, "ofs_embed_dim": config["time_embed_dim"]}
    model = build(config)
    x, timestep, cond = inputs(shape)
    image = torch.randn(1, 16, 1, *shape[-2:], generator=torch.Generator().manual_seed(2))  # the start frame
    cond = {**cond, "concat_latent_image": image}
    padded = torch.cat([image, torch.zeros(1, 16, shape[2] - 1, *shape[-2:])], dim=2)
    concatenated = torch.cat([x, model.latent_format.process_in(padded)], dim=1)  # [1, 32, T, h, w]
    with torch.no_grad():
        theirs = model.transformer(hidden_states=concatenated.permute(0, 2, 1, 3, 4),
                                   encoder_hidden_states=cond["context"], timestep=timestep, ofs=torch.tensor([2.0]),
                                   image_rotary_emb=pipeline_rope(model, shape), return_dict=False)[0]
        ours = model.output(x, timestep, cond, None)
        tokens = torch.arange(model.spec.token_grid(shape[-1] * 8, shape[-2] * 8, (shape[2] - 1) * 4 + 1)[0])
        staged = run_stages(model, model.with_concat(x, cond), timestep, cond, tokens)
        text_only = model.output(x, timestep, {"context": cond["context"]}, None)
    assert torch.equal(ours, theirs.permute(0, 2, 1, 3, 4))
    assert (staged - ours).abs().max() <= 1e-5
    assert (ours - text_only).abs().max() > 1e-2  # the image counts
    assert model.spec.concat_channels == 16 and model.spec.ofs


def test_1_5_positions_beyond_the_training_size_extend_its_table():
    """A latent larger than 1.5's sample size (the selftest's 128² on the tiny, on the GPU): diffusers' pipeline
    slices a table of the training size and fails; the table's rows are integer positions, so ours extends it and
    keeps every row the pipeline has."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    config, shape = VARIANTS["1.5"]
    model = build(config)
    rope = model.transformer.rope
    cos, sin = rope(4, 16, 24, torch.device("cpu"))  # 8 × 12 tokens a frame, past the 4 × 6 of sample size
    positions = torch.arange(2 * 8 * 12).view(2, 8, 12)  # [frames, rows, columns] → token index
    base_cos, base_sin = get_3d_rotary_pos_embed(config["attention_head_dim"], None, (4, 6), 2, grid_type="slice",
                                                 max_size=(4, 6))
    within = positions[:, :4, :6].reshape(-1)
    assert torch.equal(cos[within], base_cos) and torch.equal(sin[within], base_sin)
    x, timestep, cond = inputs((1, 16, 4, 16, 24))
    assert torch.isfinite(model.output(x, timestep, cond, None)).all()


def test_2b_takes_its_text_slots_and_the_others_any_text_length():
    two, five = (CogVideoXSpec.from_config(VARIANTS[v][0]) for v in ("2b", "5b"))
    assert two.conditioning_shapes(2, 30)["context"] == (2, 8, 64)
    assert five.conditioning_shapes(2, 30)["context"] == (2, 30, 64)
    assert two.sequence_plan.cuts_text and not any(cut.module == "rope" for cut in two.sequence_plan.cuts)
    large = CogVideoXSpec.from_config({**VARIANTS["5b"][0], "num_attention_heads": 48})
    assert (two.latent_format, five.latent_format, large.latent_format) == (
        latent_formats.COGVIDEOX_2B, latent_formats.COGVIDEOX_2B, latent_formats.COGVIDEOX_5B)  # by heads, as ComfyUI


def test_1_5_refuses_an_odd_number_of_latent_frames():
    spec = CogVideoXSpec.from_config(VARIANTS["1.5"][0])
    spec.check_size(64, 64, 13)  # 4 latent frames
    with pytest.raises(UserError, match="frames 9 make 3 latent frames") as refused:
        spec.check_size(64, 64, 9)
    assert "use frames 5 or 13" in refused.value.hint
    with pytest.raises(UserError, match="frames 1 make 1 latent frames") as refused:
        spec.check_size(64, 64, 1)
    assert refused.value.hint == "use frames 5"
    assert spec.token_grid(64, 96, 13) == (2 * 6 * 4, 6)  # (4 latent frames / 2) × 6 rows × 4 columns; 6 rows


# -- model sampling ---------------------------------------------------------------------------------

def test_sigmas_are_diffusers_cogvideox_schedule():
    """σ = √((1 − ᾱ)/ᾱ) of diffusers' CogVideoXDDIMScheduler with the 5B's settings (SNR shift 1), up to
    the last step, where diffusers' ᾱ is 0 and ComfyUI's is pinned (σ finite)."""
    from diffusers import CogVideoXDDIMScheduler

    scheduler = CogVideoXDDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       prediction_type="v_prediction", rescale_betas_zero_snr=True,
                                       snr_shift_scale=1.0, timestep_spacing="trailing")
    alphas = scheduler.alphas_cumprod.double()
    theirs = ((1 - alphas[:-1]) / alphas[:-1]).sqrt()
    ours = ZeroSNRVSampling(0.00085, 0.012).table()
    assert torch.allclose(ours[:-1].double(), theirs, rtol=1e-5)
    last = 4.8973451890853435e-08
    assert alphas[-1] == 0 and math.isclose(ours[-1].item(), math.sqrt((1 - last) / last), rel_tol=1e-6)


def test_v_prediction_ddpm_gives_the_model_x_and_takes_x0_from_v():
    """ComfyUI's V_PREDICTION_DDPM (comfy/model_sampling.py): input x unscaled; x0 = (x − v·σ) / √(σ² + 1)."""
    sampling = ZeroSNRVSampling(0.00085, 0.012)
    x, v = (torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(i)) for i in range(2))
    sigma = torch.tensor([4.0, 0.5])
    assert torch.equal(sampling.calculate_input(sigma, x), x)
    expected = (x - v * sigma.view(2, 1, 1, 1, 1)) / (sigma.view(2, 1, 1, 1, 1) ** 2 + 1) ** 0.5
    assert torch.allclose(sampling.calculate_denoised(sigma, v, x), expected, rtol=1e-6, atol=1e-6)


needs_comfyui = pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                                   reason="needs a ComfyUI checkout: set COMFYUI_DIR to compare with ComfyUI's own math")


@needs_comfyui
@pytest.mark.parametrize("steps", [1, 20, 50])
def test_schedule_is_comfyuis_discrete_zero_snr(steps):
    """ComfyUI's ModelSamplingDiscrete over "linear" betas 0.00085 … 0.012 with zsnr (CogVideoX_T2V's
    settings), step by step: σ table, simple schedule, timesteps and noise scaling exactly. (The
    snapshot predates V_PREDICTION_DDPM; its input and x0 are checked above from its definition.)"""
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.model_sampling
    import comfy.samplers

    class Config:
        sampling_settings = {"beta_schedule": "linear", "linear_start": 0.00085, "linear_end": 0.012, "zsnr": True}

    class Theirs(comfy.model_sampling.ModelSamplingDiscrete, comfy.model_sampling.EPS):
        pass

    theirs, ours = Theirs(Config()), ZeroSNRVSampling(0.00085, 0.012)
    assert torch.equal(ours.table(), theirs.sigmas)
    sigmas = ours.sigmas(steps)
    assert torch.equal(sigmas, comfy.samplers.simple_scheduler(theirs, steps))
    noise, latent = (torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(i)) for i in range(2))
    for sigma in sigmas[:-1]:
        assert torch.equal(ours.timestep(sigma.view(1)), theirs.timestep(sigma.view(1)).float())
    assert torch.equal(ours.noise_scaling(sigmas[0], noise, latent),
                       theirs.noise_scaling(sigmas[0], noise.clone(), latent, max_denoise=True))
