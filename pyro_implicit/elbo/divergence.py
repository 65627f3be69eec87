"""What a loss (or particle method) says when a fit diverges: the advice, and the
summaries of the draws that name the sites (:class:`~pyro_implicit.errors.DivergenceError`
carries them)."""

import math

import torch

from ..guides.base import implicit_site_info

__all__ = ["DIVERGENCE_ADVICE"]


#: what to try when a fit diverges (shared by the losses and the particle methods)
DIVERGENCE_ADVICE = (
    "Try a lower learning rate (e.g. pyro.optim.Adam({'lr': 1e-3}), or ClippedAdam), the "
    "preconditioner (precondition=True, the default of this library's guides and of "
    "WeightSpaceSVGD), float64 (torch.set_default_dtype(torch.float64) before building "
    "the data and the guide) or more particles; check that the model's priors are proper "
    "and its data on a sensible scale."
)


def _site_slices(guide_trace):
    """``[(site name, slice of the packed latent, packed value)]`` of the implicit
    guides in a trace."""
    out = []
    for site in guide_trace.nodes.values():
        if site["type"] != "sample":
            continue
        info = implicit_site_info(site)
        if info is None:
            continue
        shapes = getattr(info["guide"], "_unconstrained_shapes", None) or {}
        start = 0
        for name, shape in shapes.items():
            size = math.prod(shape)
            out.append((name, slice(start, start + size), site["value"]))
            start += size
    return out


def _nonfinite_sites(trace):
    """Names of the sample sites of ``trace`` holding NaN or infinite values."""
    bad = []
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or site["is_observed"]:
            continue
        value = site["value"]
        if torch.is_tensor(value) and value.is_floating_point():
            if not torch.isfinite(value).all():
                bad.append(name)
    return bad


def _exploded_sites(guide_trace, limit):
    """``{model site: largest |u|}`` of the implicit guides' draws beyond ``limit`` (or
    not finite)."""
    if limit is None or guide_trace is None:
        return {}
    found = {}
    for name, sl, value in _site_slices(guide_trace):
        part = value.detach()[..., sl]
        if part.numel() == 0:
            continue
        top = part.abs().max().item()
        if not top <= limit:
            found[name] = top
    return found


def _draws_summary(trace):
    """One sentence on the largest draws per site (unconstrained for implicit guides)."""
    if trace is None:
        return ""
    parts = []
    slices = _site_slices(trace)
    if slices:
        for name, sl, value in slices:
            part = value.detach()[..., sl]
            if part.numel():
                finite = bool(torch.isfinite(part).all())
                top = part.abs().max().item()
                parts.append(f"'{name}' {top:.3g}" + ("" if finite else " (not finite)"))
        label = "largest |draw| per site, unconstrained: "
    else:
        for name, site in trace.nodes.items():
            value = site.get("value")
            if site["type"] != "sample" or site["is_observed"] or not torch.is_tensor(value):
                continue
            if value.is_floating_point() and value.numel():
                finite = bool(torch.isfinite(value).all())
                parts.append(
                    f"'{name}' {value.detach().abs().max().item():.3g}"
                    + ("" if finite else " (not finite)")
                )
        label = "largest |draw| per site: "
    return ("The guide's " + label + ", ".join(parts) + ".") if parts else ""


def built_implicit_guides(guide):
    """The implicit guides inside ``guide`` (itself or the parts of an ``AutoGuideList``)
    that have been set up (their first call made)."""
    from ..guides.base import ImplicitAutoGuide

    modules = guide.modules() if isinstance(guide, torch.nn.Module) else []
    return [
        m for m in modules if isinstance(m, ImplicitAutoGuide) and m.prototype_trace is not None
    ]


def _sampler_summary(guide, num=8):
    """The largest |draw| per site of the implicit guides inside ``guide`` (itself or the
    parts of an ``AutoGuideList``), from a few fresh draws; "" if it has none."""
    parts = []
    for module in built_implicit_guides(guide):
        with torch.no_grad():
            u = module.sample_unconstrained(num)
        start = 0
        for name, shape in module._unconstrained_shapes.items():
            part = u[:, start : start + math.prod(shape)]
            start += math.prod(shape)
            finite = bool(torch.isfinite(part).all())
            top = part.abs().max().item() if finite else float("nan")
            parts.append(f"'{name}' {top:.3g}" + ("" if finite else " (not finite)"))
    if not parts:
        return ""
    return "The guide's largest |draw| per site, unconstrained: " + ", ".join(parts) + "."


def _first_nonfinite_log_prob(model_trace):
    for name, site in model_trace.nodes.items():
        if site["type"] != "sample" or "log_prob" not in site:
            continue
        lp = site["log_prob"]
        if torch.is_tensor(lp) and not torch.isfinite(lp).all():
            return name
    return None
