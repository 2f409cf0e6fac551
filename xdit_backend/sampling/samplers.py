"""KSampler's samplers, each the math of ComfyUI's function of the same name (comfy/k_diffusion/
sampling.py; uni_pc from comfy/extra_samplers/uni_pc.py, variant bh1), in the same float32 order.

A sampler walks ``sigmas`` from the noised latent ``x`` (``sampling.noise_scaling`` already applied,
as ComfyUI's KSAMPLER hands it over) and returns the model-space latent before
``sampling.inverse_noise_scaling(final_sigma(name, sigmas), ·)``. ``denoise_fn(x, σ[B]) -> x0`` is
the guided denoiser on this rank's batch rows; every sampler is row-wise, so a rank holding some rows
gets exactly those rows of the whole batch, provided its noise comes from ``StepNoise`` with ``rows``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .model_sampling import FlowSampling
from .stop import GenerationStopped

SAMPLERS = ("euler", "euler_ancestral", "heun", "dpmpp_2m", "dpmpp_2m_sde", "uni_pc")

Denoise = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [B, C, ...], σ [B]) -> x0 [B, C, ...]
NoiseFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (σ, σ_next) -> noise [rows, C, ...]


# ---------------------------------------------------------------------------------------------
# Per-step noise


@dataclass(frozen=True)
class StepNoise:
    """The noise the ancestral and SDE samplers add, drawn for the WHOLE batch as ComfyUI draws it
    and cut to this rank's ``rows``, so every rank adds exactly its rows of ComfyUI's draw.

    ``default()`` is ComfyUI's default_noise_sampler: a generator seeded with the sample's seed on
    the latent's device, one ``randn(whole shape)`` per call. ``device`` is where that generator
    lives: CPU and CUDA generators give different numbers for one seed, so it must be the device
    ComfyUI's latent would be on — "cpu" (default) reproduces ComfyUI run with --cpu (the tests), a
    CUDA device a ComfyUI run on a GPU (CUDA's draws can also differ between GPU models, as they do
    for ComfyUI itself). ``brownian()`` is BrownianTreeNoiseSampler as
    dpmpp_2m_sde builds it: always on the CPU (cpu=True), so it does not depend on ``device``.
    Each call of these returns a fresh sampler, as each ComfyUI sampler call builds its own.
    """

    shape: tuple[int, ...]  # the whole batch's latent shape [B, C, ...]
    seed: int
    rows: slice = field(default_factory=lambda: slice(None))  # this rank's batch rows
    device: str | torch.device = "cpu"
    dtype: torch.dtype = torch.float32

    def default(self) -> NoiseFn:
        generator = torch.Generator(device=self.device).manual_seed(self.seed)

        def draw(sigma, sigma_next):
            whole = torch.randn(self.shape, dtype=self.dtype, device=self.device, generator=generator)
            return whole[self.rows].to(sigma.device)

        return draw

    def brownian(self, sigma_min: torch.Tensor, sigma_max: torch.Tensor) -> NoiseFn:
        """Brownian-tree noise over [σ_min, σ_max]: W(σ_next) − W(σ) scaled to unit variance."""
        import torchsde

        def ordered(a, b):  # (low, high, +1) or (high, low, −1), as ComfyUI orders an interval
            return (a, b, 1) if a < b else (b, a, -1)

        lo, hi, tree_sign = ordered(torch.as_tensor(sigma_min), torch.as_tensor(sigma_max))
        w0 = torch.zeros(self.shape, dtype=self.dtype)
        tree = torchsde.BrownianTree(lo.detach().cpu(), w0, hi.detach().cpu(), entropy=self.seed)

        def draw(sigma, sigma_next):
            a, b, sign = ordered(torch.as_tensor(sigma), torch.as_tensor(sigma_next))
            with warnings.catch_warnings():  # torchsde warns when float32 ends miss its float64 ones by an ulp
                warnings.simplefilter("ignore", UserWarning)
                w = tree(a.detach().cpu().float(), b.detach().cpu().float())  # [whole shape] W(b) − W(a)
            w = w[self.rows].to(device=a.device, dtype=a.dtype) * (tree_sign * sign)  # −1: walking down in σ
            return w / (sigma_next - sigma).abs().sqrt()

        return draw


# ---------------------------------------------------------------------------------------------
# The samplers: (denoise, x [B, C, ...], sigmas [n + 1], sampling, noise, step) -> x


def _to_d(x, sigma, denoised):
    """The Karras ODE derivative (x − x0)/σ."""
    return (x - denoised) / sigma


def sample_euler(denoise, x, sigmas, sampling, noise, step):
    ones = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        d = _to_d(x, sigmas[i], denoise(x, sigmas[i] * ones))
        x = x + d * (sigmas[i + 1] - sigmas[i])
        step(i + 1)
    return x


def sample_euler_ancestral(denoise, x, sigmas, sampling, noise, step):
    """Euler down to σ_down, then noise back up by σ_up (eta 1); flow models take the RF variant."""
    if isinstance(sampling, FlowSampling):
        return sample_euler_ancestral_RF(denoise, x, sigmas, sampling, noise, step)
    draw, ones = noise.default(), x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        denoised = denoise(x, s * ones)
        sigma_up = min(s_next, (s_next ** 2 * (s ** 2 - s_next ** 2) / s ** 2) ** 0.5)
        sigma_down = (s_next ** 2 - sigma_up ** 2) ** 0.5
        if sigma_down == 0:
            x = denoised
        else:
            x = x + _to_d(x, s, denoised) * (sigma_down - s) + draw(s, s_next) * sigma_up
        step(i + 1)
    return x


def sample_euler_ancestral_RF(denoise, x, sigmas, sampling, noise, step):
    """Ancestral Euler for rectified flow (CONST): step to σ_down, rescale, re-noise (eta 1)."""
    draw, ones = noise.default(), x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        denoised = denoise(x, s * ones)
        if s_next == 0:
            x = denoised
        else:
            sigma_down = s_next * (1 + (s_next / s - 1))
            alpha_next, alpha_down = 1 - s_next, 1 - sigma_down
            renoise = (s_next ** 2 - sigma_down ** 2 * alpha_next ** 2 / alpha_down ** 2) ** 0.5
            ratio = sigma_down / s
            x = ratio * x + (1 - ratio) * denoised
            x = (alpha_next / alpha_down) * x + draw(s, s_next) * renoise
        step(i + 1)
    return x


def sample_heun(denoise, x, sigmas, sampling, noise, step):
    """Heun's second-order method; a plain Euler step onto σ = 0."""
    ones = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        d = _to_d(x, s, denoise(x, s * ones))
        dt = s_next - s
        if s_next == 0:
            x = x + d * dt
        else:
            x_2 = x + d * dt
            d_2 = _to_d(x_2, s_next, denoise(x_2, s_next * ones))
            x = x + (d + d_2) / 2 * dt
        step(i + 1)
    return x


def sample_dpmpp_2m(denoise, x, sigmas, sampling, noise, step):
    """DPM-Solver++(2M) in t = −log σ."""
    ones, old_denoised = x.new_ones([x.shape[0]]), None
    for i in range(len(sigmas) - 1):
        denoised = denoise(x, sigmas[i] * ones)
        t, t_next = sigmas[i].log().neg(), sigmas[i + 1].log().neg()
        h = t_next - t
        scale = t_next.neg().exp() / t.neg().exp()  # σ_next/σ, as exp(−t) ratios
        if old_denoised is None or sigmas[i + 1] == 0:
            x = scale * x - (-h).expm1() * denoised
        else:
            r = (t - sigmas[i - 1].log().neg()) / h
            x = scale * x - (-h).expm1() * ((1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * old_denoised)
        old_denoised = denoised
        step(i + 1)
    return x


def sample_dpmpp_2m_sde(denoise, x, sigmas, sampling, noise, step):
    """DPM-Solver++(2M) SDE, midpoint, eta 1, with Brownian-tree noise; in half-logSNR λ."""
    if len(sigmas) <= 1:
        return x
    flow = isinstance(sampling, FlowSampling)
    draw = noise.brownian(sigmas[sigmas > 0].min(), sigmas.max())
    if flow and sigmas[0] >= 1:  # λ(1) = −∞: start just below σ = 1
        sigmas = sigmas.clone()
        sigmas[0] = sampling.percent_to_sigma(1e-4)
    lam = (lambda s: s.logit().neg()) if flow else (lambda s: s.log().neg())  # λ = log(α/σ)
    ones, old_denoised, h, h_last = x.new_ones([x.shape[0]]), None, None, None
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        denoised = denoise(x, s * ones)
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
        step(i + 1)
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


def _rows(v, x):
    """[B] → [B, 1, ...] against x."""
    return v[(...,) + (None,) * (x.dim() - 1)]


def _unipc_x0(denoise, x, t):
    """The data prediction at VP time t [B]: the model's ε from its x0 in σ space, then back."""
    sigma = _rows(t, x)
    x_in = x * ((sigma ** 2 + 1.0) ** 0.5)
    eps = (x_in - denoise(x_in, t)) / sigma
    return (x - _rows(_std(t), x) * eps) / _rows(_alpha(t), x)


def _unipc_bh1_update(denoise, x, x0s, ts, t, order, use_corrector):
    """One UniPC step (B(h) = h) from ts[-1] to t [B], with ``order`` past predictions x0s (oldest
    first); returns (x at t, the prediction at the predictor's x, or None without corrector)."""
    lam_prev, lam_t, x0_prev = _lambda(ts[-1]), _lambda(t), x0s[-1]
    alpha_t = torch.exp(_log_alpha(t))
    h = lam_t - lam_prev  # [B]
    rks, diffs = [], []
    for k in range(1, order):
        rk = ((_lambda(ts[-(k + 1)]) - lam_prev) / h)[0]
        rks.append(rk)
        diffs.append((x0s[-(k + 1)] - x0_prev) / rk)
    rks = torch.tensor([*rks, 1.], device=x.device)
    hh = -h[0]
    h_phi_1 = torch.expm1(hh)
    h_phi_k, factorial, R, b = h_phi_1 / hh - 1, 1, [], []
    for k in range(1, order + 1):
        R.append(torch.pow(rks, k - 1))
        b.append(h_phi_k * factorial / hh)
        factorial *= k + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    R, b = torch.stack(R), torch.tensor(b, device=x.device)
    D1s = torch.stack(diffs, dim=1) if diffs else None  # [B, order − 1, C, ...]

    x_base = _rows(_std(t) / _std(ts[-1]), x) * x - _rows(alpha_t * h_phi_1, x) * x0_prev
    step = _rows(alpha_t * hh, x)
    x_t = x_base
    if D1s is not None:
        rhos_p = torch.tensor([0.5], device=x.device) if order == 2 else torch.linalg.solve(R[:-1, :-1], b[:-1])
        x_t = x_base - step * torch.tensordot(D1s, rhos_p, dims=([1], [0]))
    if not use_corrector:
        return x_t, None
    rhos_c = torch.tensor([0.5], device=x.device) if order == 1 else torch.linalg.solve(R, b)
    x0_t = _unipc_x0(denoise, x_t, t)
    correction = rhos_c[-1] * (x0_t - x0_prev)
    if D1s is not None:
        correction = torch.tensordot(D1s, rhos_c[:-1], dims=([1], [0])) + correction
    return x_base - step * correction, x0_t


def sample_unipc(denoise, x, sigmas, sampling, noise, step):
    """UniPC (bh1, multistep, data prediction, lower orders at the start and the end) with
    VP time t = σ; a final σ = 0 becomes t = 0.001, and the result is divided by α(t_last)."""
    ts = sigmas.clone()
    if ts[-1] == 0:
        ts[-1] = 0.001
    steps = len(ts) - 1
    order = min(3, steps - 1)

    def vec(i):  # t_i for every row [B]
        return ts[i].expand(x.shape[0])

    x = x / torch.sqrt(1.0 + ts[0] ** 2.0)
    x0s, times = [_unipc_x0(denoise, x, vec(0))], [vec(0)]
    step(1)
    for i in range(1, steps):
        if i < order:  # warm-up: order i from the i predictions so far
            x, x0 = _unipc_bh1_update(denoise, x, x0s, times, vec(i), i, True)
            x0s.append(x0)
            times.append(vec(i))
        else:  # the last step also takes the final one, without corrector
            for j in range(i, i + 2 if i == steps - 1 else i + 1):
                x, x0 = _unipc_bh1_update(denoise, x, x0s, times, vec(j), min(order, steps + 1 - j), j != steps)
                if j < steps:
                    x0s, times = x0s[1:] + [x0], times[1:] + [vec(j)]
        step(i + 1)
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


def sample(name: str, denoise_fn: Denoise, x: torch.Tensor, sigmas: torch.Tensor, sampling,
           noise: StepNoise | None, after_step: Callable[[int, int], bool] | None = None) -> torch.Tensor:
    """Run sampler ``name`` over ``sigmas`` [n + 1] from the noised latent x [B, C, ...] (this rank's
    rows); ``after_step(done, n)`` returning False raises GenerationStopped. ``noise`` is needed by
    euler_ancestral and dpmpp_2m_sde only. Fewer than two σ: no step, x comes back as it is."""
    if name not in _SAMPLE:
        raise ValueError(f"unknown sampler {name!r}; valid: {', '.join(SAMPLERS)}")
    if noise is None and name in ("euler_ancestral", "dpmpp_2m_sde"):
        raise ValueError(f"{name} adds noise: pass a StepNoise")
    total = len(sigmas) - 1
    if total < 1:
        return x

    def step(done: int) -> None:
        if after_step is not None and not after_step(done, total):
            raise GenerationStopped()

    return _SAMPLE[name](denoise_fn, x, sigmas, sampling, noise, step)
