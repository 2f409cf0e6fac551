"""KSampler's samplers, each the math of ComfyUI's function of the same name (comfy/k_diffusion/
sampling.py; uni_pc from comfy/extra_samplers/uni_pc.py, variant bh1), in the same float32 order.

A sampler walks ``sigmas`` from the noised latent ``x`` (``sampling.noise_scaling`` already applied,
as ComfyUI's KSAMPLER hands it over) and returns the model-space latent before
``sampling.inverse_noise_scaling(final_sigma(name, sigmas), ·)``.

Each sampler is written as a generator, ``walk(name, x, sigmas, sampling, noise)``: it yields a
``Call`` (the point x and the σ at which it needs the guided denoised estimate x0, and the step
the call belongs to), is sent that x0, and returns the final latent. ``sample`` drives it with a
``denoise_fn(x, σ[B]) -> x0``: the normal path. Every update is elementwise in the latent (its
coefficients depend on σ only), so a walk over any part of the latent — a rank's batch rows, a
PipeFusion patch's band of rows — gives exactly that part of the whole walk, provided the model's
x0 for that part and its noise (noise.py: ``StepNoise.rows``, ``SharedDraws``) are the whole
one's. The sigmas stay on the host: every coefficient and every branch (``if σ_next == 0``) is
host arithmetic on 0-d CPU tensors, which PyTorch hands to the device's kernels as scalars, so
the loop never waits for the device to learn a number. Each walk keeps its own history
(dpmpp_2m's previous x0, uni_pc's last predictions), so PipeFusion keeps one walk per patch.
``ONE_CALL_PER_STEP`` names the samplers whose every step is one model call; heun's second call
evaluates the model at a point its first call produces, within the same step, which a pipeline of
patches cannot schedule (see parallel/pipefusion.py).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import NamedTuple

import torch

from .host_copy import to_device
from .model_sampling import FlowSampling
from .noise import StepNoise
from .stop import GenerationStopped

SAMPLERS = ("euler", "euler_ancestral", "heun", "dpmpp_2m", "dpmpp_2m_sde", "uni_pc")
ONE_CALL_PER_STEP = ("euler", "euler_ancestral", "dpmpp_2m", "dpmpp_2m_sde", "uni_pc")

Denoise = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [B, C, ...], σ [B]) -> x0 [B, C, ...]


class Call(NamedTuple):
    """A model evaluation a sampler asks for: the guided x0 at ``x`` [B, C, ...] and noise level
    ``sigma`` (0-d, on the host)."""

    x: torch.Tensor
    sigma: torch.Tensor
    step: int  # the step it belongs to (heun asks twice per step)


Walk = Generator[Call, torch.Tensor, torch.Tensor]  # yields calls, is sent their x0, returns the final x


# ---------------------------------------------------------------------------------------------
# The samplers: (x [B, C, ...], sigmas [n + 1], sampling, noise) -> Walk


def _to_d(x, sigma, denoised):
    """The Karras ODE derivative (x − x0)/σ."""
    return (x - denoised) / sigma


def sample_euler(x, sigmas, sampling, noise) -> Walk:
    for i in range(len(sigmas) - 1):
        d = _to_d(x, sigmas[i], (yield Call(x, sigmas[i], i)))
        x = x + d * (sigmas[i + 1] - sigmas[i])
    return x


def sample_euler_ancestral(x, sigmas, sampling, noise) -> Walk:
    """Euler down to σ_down, then noise back up by σ_up (eta 1); flow models take the RF variant."""
    if isinstance(sampling, FlowSampling):
        return (yield from sample_euler_ancestral_RF(x, sigmas, sampling, noise))
    draw = noise.default()
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        denoised = yield Call(x, s, i)
        sigma_up = min(s_next, (s_next ** 2 * (s ** 2 - s_next ** 2) / s ** 2) ** 0.5)
        sigma_down = (s_next ** 2 - sigma_up ** 2) ** 0.5
        if sigma_down == 0:
            x = denoised
        else:
            x = x + _to_d(x, s, denoised) * (sigma_down - s) + draw(s, s_next) * sigma_up
    return x


def sample_euler_ancestral_RF(x, sigmas, sampling, noise) -> Walk:
    """Ancestral Euler for rectified flow (CONST): step to σ_down, rescale, re-noise (eta 1)."""
    draw = noise.default()
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        denoised = yield Call(x, s, i)
        if s_next == 0:
            x = denoised
        else:
            sigma_down = s_next * (1 + (s_next / s - 1))
            alpha_next, alpha_down = 1 - s_next, 1 - sigma_down
            renoise = (s_next ** 2 - sigma_down ** 2 * alpha_next ** 2 / alpha_down ** 2) ** 0.5
            ratio = sigma_down / s
            x = ratio * x + (1 - ratio) * denoised
            x = (alpha_next / alpha_down) * x + draw(s, s_next) * renoise
    return x


def sample_heun(x, sigmas, sampling, noise) -> Walk:
    """Heun's second-order method; a plain Euler step onto σ = 0."""
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        d = _to_d(x, s, (yield Call(x, s, i)))
        dt = s_next - s
        if s_next == 0:
            x = x + d * dt
        else:
            x_2 = x + d * dt
            d_2 = _to_d(x_2, s_next, (yield Call(x_2, s_next, i)))
            x = x + (d + d_2) / 2 * dt
    return x


def sample_dpmpp_2m(x, sigmas, sampling, noise) -> Walk:
    """DPM-Solver++(2M) in t = −log σ."""
    old_denoised = None
    for i in range(len(sigmas) - 1):
        denoised = yield Call(x, sigmas[i], i)
        t, t_next = sigmas[i].log().neg(), sigmas[i + 1].log().neg()
        h = t_next - t
        scale = t_next.neg().exp() / t.neg().exp()  # σ_next/σ, as exp(−t) ratios
        if old_denoised is None or sigmas[i + 1] == 0:
            x = scale * x - (-h).expm1() * denoised
        else:
            r = (t - sigmas[i - 1].log().neg()) / h
            x = scale * x - (-h).expm1() * ((1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * old_denoised)
        old_denoised = denoised
    return x


def sample_dpmpp_2m_sde(x, sigmas, sampling, noise) -> Walk:
    """DPM-Solver++(2M) SDE, midpoint, eta 1, with Brownian-tree noise; in half-logSNR λ."""
    if len(sigmas) <= 1:
        return x
    flow = isinstance(sampling, FlowSampling)
    draw = noise.brownian(sigmas[sigmas > 0].min(), sigmas.max())
    if flow and sigmas[0] >= 1:  # λ(1) = −∞: start just below σ = 1
        sigmas = sigmas.clone()
        sigmas[0] = sampling.percent_to_sigma(1e-4)
    lam = (lambda s: s.logit().neg()) if flow else (lambda s: s.log().neg())  # λ = log(α/σ)
    old_denoised, h, h_last = None, None, None
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        denoised = yield Call(x, s, i)
        if s_next == 0:
            x = denoised
        else:
            lam_t = lam(s_next)
            h = lam_t - lam(s)
            alpha_t = s_next * lam_t.exp()
            x = s_next / s * (-h).exp() * x + alpha_t * (-h * 2.0).expm1().neg() * denoised
            if old_denoised is not None:
                x = x + 0.5 * alpha_t * (-h * 2.0).expm1().neg() * (1 / (h_last / h)) * (denoised - old_denoised)
            x = x + draw(s, s_next) * s_next * (-2 * h).expm1().neg().sqrt()
        old_denoised, h_last = denoised, h
    return x


# uni_pc works in ComfyUI's "SigmaConvert" VP view of σ: log α = ½·log(1/(σ² + 1)).

def _log_alpha(t):
    return 0.5 * torch.log(1 / ((t * t) + 1))


def _alpha(t):
    return torch.exp(_log_alpha(t))


def _std(t):
    return torch.sqrt(1. - torch.exp(2. * _log_alpha(t)))


def _lambda(t):
    log_alpha = _log_alpha(t)
    return log_alpha - 0.5 * torch.log(1. - torch.exp(2. * log_alpha))


def _unipc_x0(x, t, step: int):
    """The data prediction at VP time t (0-d, on the host): the model's ε from its x0 in σ space, then back."""
    x_in = x * ((t ** 2 + 1.0) ** 0.5)
    eps = (x_in - (yield Call(x_in, t, step))) / t
    return (x - _std(t) * eps) / _alpha(t)


def _unipc_bh1_update(x, x0s, ts, t, order, use_corrector, step: int):
    """One UniPC step (B(h) = h) from ts[-1] to t, with ``order`` past predictions x0s (oldest
    first); returns (x at t, the prediction at the predictor's x, or None without corrector). The
    times and every coefficient are host values; the solved ρ vectors reach the device asynchronously."""
    lam_prev, lam_t, x0_prev = _lambda(ts[-1]), _lambda(t), x0s[-1]
    alpha_t = torch.exp(_log_alpha(t))
    h = lam_t - lam_prev
    rks, diffs = [], []
    for k in range(1, order):
        rk = (_lambda(ts[-(k + 1)]) - lam_prev) / h
        rks.append(rk)
        diffs.append((x0s[-(k + 1)] - x0_prev) / rk)
    rks = torch.tensor([*rks, 1.])
    hh = -h
    h_phi_1 = torch.expm1(hh)
    h_phi_k, factorial, R, b = h_phi_1 / hh - 1, 1, [], []
    for k in range(1, order + 1):
        R.append(torch.pow(rks, k - 1))
        b.append(h_phi_k * factorial / hh)
        factorial *= k + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    R, b = torch.stack(R), torch.tensor(b)
    D1s = torch.stack(diffs, dim=1) if diffs else None  # [B, order − 1, C, ...]

    x_base = (_std(t) / _std(ts[-1])) * x - (alpha_t * h_phi_1) * x0_prev
    step_size = alpha_t * hh
    x_t = x_base
    if D1s is not None:
        rhos_p = torch.tensor([0.5]) if order == 2 else torch.linalg.solve(R[:-1, :-1], b[:-1])
        x_t = x_base - step_size * torch.tensordot(D1s, to_device(rhos_p, x.device), dims=([1], [0]))
    if not use_corrector:
        return x_t, None
    rhos_c = torch.tensor([0.5]) if order == 1 else torch.linalg.solve(R, b)
    x0_t = yield from _unipc_x0(x_t, t, step)
    correction = rhos_c[-1] * (x0_t - x0_prev)
    if D1s is not None:
        correction = torch.tensordot(D1s, to_device(rhos_c[:-1], x.device), dims=([1], [0])) + correction
    return x_base - step_size * correction, x0_t


def sample_unipc(x, sigmas, sampling, noise) -> Walk:
    """UniPC (bh1, multistep, data prediction, lower orders at the start and the end) with
    VP time t = σ; a final σ = 0 becomes t = 0.001, and the result is divided by α(t_last)."""
    ts = sigmas.clone()
    if ts[-1] == 0:
        ts[-1] = 0.001
    steps = len(ts) - 1
    order = min(3, steps - 1)

    x = x / torch.sqrt(1.0 + ts[0] ** 2.0)
    x0s, times = [(yield from _unipc_x0(x, ts[0], 0))], [ts[0]]
    for i in range(1, steps):
        if i < order:  # warm-up: order i from the i predictions so far
            x, x0 = yield from _unipc_bh1_update(x, x0s, times, ts[i], i, True, i)
            x0s.append(x0)
            times.append(ts[i])
        else:  # the last step also takes the final one, without corrector
            for j in range(i, i + 2 if i == steps - 1 else i + 1):
                x, x0 = yield from _unipc_bh1_update(x, x0s, times, ts[j], min(order, steps + 1 - j), j != steps, i)
                if j < steps:
                    x0s, times = x0s[1:] + [x0], times[1:] + [ts[j]]
    return x / _alpha(ts[-1])


_SAMPLE = {"euler": sample_euler, "euler_ancestral": sample_euler_ancestral, "heun": sample_heun,
           "dpmpp_2m": sample_dpmpp_2m, "dpmpp_2m_sde": sample_dpmpp_2m_sde, "uni_pc": sample_unipc}


def final_sigma(name: str, sigmas: torch.Tensor) -> torch.Tensor:
    """The σ ComfyUI's KSAMPLER gives ``inverse_noise_scaling`` after this sampler: sigmas[-1], except
    that uni_pc overwrites a final 0 with 0.001 in the caller's tensor (so a flow model's latent ends
    divided by 0.999)."""
    if name == "uni_pc" and sigmas[-1] == 0:
        return torch.full_like(sigmas[-1], 0.001)
    return sigmas[-1]


def walk(name: str, x: torch.Tensor, sigmas: torch.Tensor, sampling, noise) -> Walk:
    """Sampler ``name`` over ``sigmas`` [n + 1] from x [B, C, ...], as a generator of model calls.
    ``noise`` (StepNoise, or a patch's PatchNoise) is needed by euler_ancestral and dpmpp_2m_sde only."""
    if name not in _SAMPLE:
        raise ValueError(f"unknown sampler {name!r}; valid: {', '.join(SAMPLERS)}")
    if noise is None and name in ("euler_ancestral", "dpmpp_2m_sde"):
        raise ValueError(f"{name} adds noise: pass a StepNoise")
    return _SAMPLE[name](x, sigmas.cpu(), sampling, noise)  # σ on the host (a no-op for the CPU sigmas callers pass)


def sample(name: str, denoise_fn: Denoise, x: torch.Tensor, sigmas: torch.Tensor, sampling,
           noise: StepNoise | None, after_step: Callable[[int, int], bool] | None = None) -> torch.Tensor:
    """Run sampler ``name`` over ``sigmas`` [n + 1] from the noised latent x [B, C, ...] (this rank's
    rows); ``after_step(done, n)`` returning False raises GenerationStopped. ``noise`` is needed by
    euler_ancestral and dpmpp_2m_sde only. Fewer than two σ: no step, x comes back as it is."""
    steps = walk(name, x, sigmas, sampling, noise)
    total = len(sigmas) - 1
    if total < 1:
        return x

    def step(done: int) -> None:
        if after_step is not None and not after_step(done, total):
            raise GenerationStopped()

    ones = x.new_ones([x.shape[0]])
    call = next(steps)
    while True:
        denoised = denoise_fn(call.x, call.sigma * ones)  # σ [B] on the device: the host σ goes as a kernel scalar
        try:
            following = steps.send(denoised)
        except StopIteration as end:
            step(total)
            return end.value
        if following.step != call.step:
            step(call.step + 1)
        call = following
