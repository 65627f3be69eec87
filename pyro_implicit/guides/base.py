"""The implicit-guide base: a Pyro autoguide whose packed latent comes from a sampler.

Every guide in this library draws the packed unconstrained latent ``u`` (all continuous
latent sites of the model, each mapped through ``biject_to`` and flattened, size D) from a
*sampler* instead of a density. :class:`ImplicitAutoGuide` reuses Pyro's
:class:`~pyro.infer.autoguide.AutoContinuous` for everything else: the prototype trace,
packing, plates, Jacobians of the constraint transforms, ``Predictive`` and
``AutoGuideList`` compatibility. A subclass only says how noise becomes ``u``.

Trace layout (what a loss sees):

* ``_<name>_noise``: the sampler's standard-normal noise, a masked auxiliary site, so outer
  plates (an ELBO's particle plate, ``Predictive``'s sample plate) broadcast it;
* ``_<name>_latent``: ``u`` as an auxiliary :class:`ImplicitDelta`, flagged with
  ``infer["pyro_implicit"]``; its ``log_prob`` raises, because q(u) has no density and a
  density-based loss such as ``Trace_ELBO`` would silently drop the entropy and collapse
  the posterior to a point;
* one Jacobian-carrying ``Delta`` per model site, exactly as ``AutoContinuous`` emits.
"""

import collections
import contextlib
import contextvars
import math

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoContinuous
from pyro.infer.autoguide.initialization import init_to_median
from pyro.params.param_store import param_with_module_name
from pyro.poutine.runtime import get_plates
from torch.distributions import biject_to

from ..contract import IMPLICIT_FLAG, implicit_site_info
from ..errors import UnsupportedModelError, VectorizationError, check_count
from ..latent import (
    DENSE_LIMIT,
    LatentSpace,
    Preconditioner,
    check_fixed_supports,
    check_no_point_mass_latents,
    check_no_subsampled_local_latents,
    check_precondition,
    completed_model,
    is_network,
    prototype_errors_named,
    resolve_precondition,
)

__all__ = ["ImplicitAutoGuide", "ImplicitDelta", "implicit_site_info", "IMPLICIT_FLAG"]

#: the ``parametrization`` values of the guides (see :class:`ImplicitAutoGuide`)
PARAMETRIZATIONS = ("auto", "standard", "scaled", "ntk")

#: a built guide's layers, as :class:`~pyro_implicit.guides.networks.MLPGenerator`'s
#: ``scaled`` and as the code saved with its parameters (see ``_store_layers``)
_LAYERS = {"standard": (False, 0.0), "scaled": (True, 1.0), "ntk": ("ntk", 2.0)}

#: what the loss now running a guide asks of a guide built during its step (see
#: :func:`requested_by_loss`)
_GuideRequest = collections.namedtuple("_GuideRequest", "parametrization vi_estimator")
#: a guide first called outside any loss: its own layers (see
#: :meth:`ImplicitAutoGuide._take_loss_request`), and the Gaussian fit's estimate that five
#: of the six losses ask for
_NO_REQUEST = _GuideRequest(None, "stl")
_REQUEST = contextvars.ContextVar("guide_request", default=_NO_REQUEST)


@contextlib.contextmanager
def requested_by_loss(parametrization=None, vi_estimator="entropy"):
    """Within the block, a guide of this library that builds its sampler (its first call)
    takes what the loss running it asks for: with ``parametrization="auto"`` and a
    preconditioner, the layers ``parametrization`` (``"standard"``, ``"scaled"``,
    ``"ntk"`` or ``None``: the guide's own default); with ``precondition=True``, the
    automatic preconditioner's Gaussian fit by ``vi_estimator``
    (:func:`~pyro_implicit.latent.find_preconditioner`). The losses run their steps inside
    it with their :attr:`~pyro_implicit.elbo.base.ImplicitELBO.guide_parametrization` and
    :attr:`~pyro_implicit.elbo.base.ImplicitELBO.preconditioner_vi_estimator`."""
    token = _REQUEST.set(_GuideRequest(parametrization, vi_estimator))
    try:
        yield
    finally:
        _REQUEST.reset(token)


_LOSSES_HINT = (
    "Train implicit guides with a loss from pyro_implicit.elbo that estimates the entropy: "
    "SteinScoreELBO and KernelRatioELBO work with every guide"
)


class ImplicitDelta(dist.Delta):
    """A point mass at a draw of an implicit distribution.

    Used for the packed latent of an implicit guide. Sampling returns the stored value;
    :meth:`log_prob` raises, because the density of the distribution the value came from is
    unknown. This turns the silent failure of pairing an implicit guide with a
    density-based loss (``Trace_ELBO`` would score it as 0 and the posterior would collapse)
    into an error that names the right loss.
    """

    def __init__(self, v, event_dim=1, hint=_LOSSES_HINT, validate_args=None):
        self.hint = hint
        super().__init__(v, event_dim=event_dim, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(ImplicitDelta, _instance)
        new.hint = self.hint
        return super().expand(batch_shape, _instance=new)

    def log_prob(self, x):
        raise NotImplementedError(
            "This guide has no tractable density q(u) (it is an implicit sampler), so it "
            "cannot be trained or scored with a loss that evaluates guide log-densities, "
            f"such as Trace_ELBO. {self.hint}."
        )


class ImplicitAutoGuide(AutoContinuous):
    r"""Base class for guides whose packed unconstrained latent ``u`` is drawn by a sampler.

    Subclasses implement :meth:`_build_sampler` (called once the latent size D is known)
    and :meth:`_latent_from_noise`, and set :attr:`noise_dim`. The base class provides:

    * a valid Pyro guide over any model with continuous latent sites (constrained supports
      through ``biject_to``, plates, ``subsample_size`` likelihood scaling);
    * vectorised sampling (:meth:`sample_unconstrained`, :meth:`sample_posterior`): S draws
      are one call of the sampler;
    * sample-based :meth:`median` and :meth:`quantiles` (inside every support);
    * an affine preconditioner :math:`u = m + L z` (:mod:`pyro_implicit.latent`), found
      automatically before training (MAP by L-BFGS, then the Laplace approximation, or a
      short Gaussian variational fit where the posterior is not Gaussian at its mode):
      the sampler draws the whitened :math:`z`, starts at the Gaussian fit (:math:`z \sim
      N(0, I)`) and learns only what a Gaussian cannot express. Kernel bandwidths, the
      initial spread and the learning rate then act where the posterior has unit scale
      in every direction, so raw-unit covariates and strong correlations cost nothing;
    * the refusal of models it cannot handle: discrete latents (via Pyro's helpful support
      errors) and local latent sites inside a subsampled plate, which a packed guide cannot
      size (it would silently reuse ``subsample_size`` slots for different data points).

    **Saving and loading.** As with Pyro's autoguides, the sampler's parameters live in
    Pyro's param store under the guide's name (the store holds the very tensors the sampler
    uses, and a store loaded later is read back on the next call), and the preconditioner is
    stored beside them as constants (``<name>.preconditioner.*``, never optimised). So
    ``pyro.get_param_store().save(path)``, then in a fresh process ``load(path)`` and a new
    guide of the same class on the same model, gives the same seeded draws, with the saved
    preconditioner instead of a new search. ``state_dict()`` holds the same (the
    preconditioner as buffers); ``load_state_dict`` may be called before the guide's first
    call, which then builds the sampler around the saved preconditioner. Two guides of one
    class in one store share their parameters, as two ``AutoNormal`` do: call
    ``pyro.clear_param_store()`` between fits, or name them apart in an ``AutoGuideList``.

    :param callable model: a Pyro model.
    :param callable init_loc_fn: per-site initialisation (Pyro's ``init_to_*``): the
        start of the preconditioner's MAP search, or, without preconditioner, the centre
        of the sampler's output at the start of training.
    :param float init_scale: initial spread of the sampler's output per coordinate: in
        units of the preconditioner's scale (default 1: start at its Gaussian), or in raw
        unconstrained units without one (default 0.1, the papers' choice).
    :param precondition: ``True`` (default): find the preconditioner automatically
        (:func:`~pyro_implicit.latent.find_preconditioner`; dense up to 2000 latent
        coordinates, diagonal beyond; its Gaussian fit, where one runs, by the gradient
        estimate the loss that first runs the guide asks for,
        :attr:`~pyro_implicit.elbo.base.ImplicitELBO.preconditioner_vi_estimator`);
        ``False``: none, the papers' raw unconstrained coordinates; or a
        :class:`~pyro_implicit.latent.Preconditioner` of one's own.
    :param int num_quantile_samples: number of draws behind :meth:`median` and
        :meth:`quantiles`.
    :param str parametrization: how the default MLP stores its weights: ``"standard"``
        (PyTorch's ``nn.Linear``), ``"scaled"`` (each weight a fixed multiple of an
        order-one parameter, :class:`~pyro_implicit.guides.networks.ScaledLinear`, so
        that one Adam step cannot move q by a layer width's worth of learning rates),
        ``"ntk"`` (the same, but the output's multiplier 1/sqrt(fan-in) instead of
        1/fan-in: a step moves q by up to sqrt(width) learning rates) or ``"auto"``
        (default): what the loss that first runs the guide asks for
        (:attr:`~pyro_implicit.elbo.base.ImplicitELBO.guide_parametrization`:
        ``KernelRatioELBO`` asks for scaled layers, ``LIVI_ELBO`` and ``GPVI_ELBO`` for
        ntk ones, the other losses for standard ones),
        with a preconditioner; standard without one (the papers' raw-space generators).
    """

    #: what a loss may ask of this guide; see :mod:`pyro_implicit.elbo`.
    capabilities = frozenset({"sample"})

    def __init__(
        self,
        model,
        *,
        init_loc_fn=init_to_median,
        init_scale=None,
        num_quantile_samples=1000,
        precondition=True,
        parametrization="auto",
    ):
        if init_scale is not None and not init_scale > 0:
            raise ValueError(f"init_scale must be positive, got {init_scale}")
        if parametrization not in PARAMETRIZATIONS:
            raise ValueError(
                f"parametrization must be one of {PARAMETRIZATIONS}, got {parametrization!r}"
            )
        self._parametrization_arg = parametrization
        check_precondition(precondition)
        self._init_scale_arg = init_scale
        # in a tuple: a Preconditioner given here is not a submodule (the one in use is)
        self._precondition_arg = (precondition,)
        self.num_quantile_samples = check_count("num_quantile_samples", num_quantile_samples)
        # the model as the losses run it: its flat priors drawable (the prototype's
        # starting point), its obs_mask sites proper
        super().__init__(completed_model(model), init_loc_fn=init_loc_fn)

    # ------------------------------------------------------------------ set-up
    def _setup_prototype(self, *args, **kwargs):
        try:
            with prototype_errors_named(self, type(self).__name__):
                super()._setup_prototype(*args, **kwargs)
        except NotImplementedError as e:
            if "sequential" not in str(e):
                raise
            raise UnsupportedModelError(
                f"{e}: {type(self).__name__} needs vectorized plates; write "
                "`with pyro.plate(name, size):` instead of `for i in pyro.plate(...)`."
            ) from e
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            for frame in site["cond_indep_stack"]:
                if not frame.vectorized:
                    raise UnsupportedModelError(
                        f"Site '{name}' is inside the sequential plate '{frame.name}'. "
                        f"{type(self).__name__} needs vectorized plates: write "
                        f"`with pyro.plate('{frame.name}', size):` instead of "
                        f"`for i in pyro.plate(...)`."
                    )
        check_no_subsampled_local_latents(self.prototype_trace, type(self).__name__)
        check_no_point_mass_latents(self.prototype_trace, type(self).__name__)
        check_fixed_supports(self.model, self.prototype_trace, args, kwargs, type(self).__name__)
        self._max_plate_nesting = max(
            [-f.dim for fs in self._cond_indep_stacks.values() for f in fs] + [0]
        )
        init_loc = self._init_loc()
        # dtype and device of the sampler's noise; a buffer follows .to() and .cuda()
        self.register_buffer("_noise_reference", init_loc.new_zeros(()), persistent=False)
        pending = self.__dict__.pop("_pending_state", None)
        if pending is not None:
            # load_state_dict before the first call: the saved preconditioner, no search
            self.preconditioner = _preconditioner_from_state(pending[0], init_loc)
        else:
            self.preconditioner = self._find_preconditioner(init_loc, args, kwargs)
        saved_code = self._saved_layer_code(pending)
        self._layers = self._resolve_layers(pending, saved_code)
        self._check_saved_layers(saved_code)
        # saved with the parameters: scaled and ntk layers store the same names
        self.register_buffer("layer_code", init_loc.new_tensor(_LAYERS[self._layers][1]))
        if pending is not None:
            pending[0].setdefault("layer_code", self.layer_code.clone())
        # a restored guide rebuilds the generator it was saved with, whatever the default
        # for its (restored) preconditioner would be now
        self._saved_noise = self._saved_noise_size(pending)
        self._build_around_preconditioner(init_loc)
        self.register_buffer("noise_size", init_loc.new_tensor(float(self._noise_size_now())))
        if pending is not None:
            pending[0].setdefault("noise_size", self.noise_size.clone())
        if pending is None:
            self._check_stored_weights_fit(init_loc)
        if pending is not None:
            super().load_state_dict(*pending)
        # the sampler's parameters live in Pyro's param store, as an autoguide's do: a
        # store loaded from a file restores them (and a loaded state_dict fills the store)
        self._sync_param_store(pull=pending is None)
        self._store_preconditioner()
        self._store_layers()
        # built outside any loss: the first loss to run it may still build it as it
        # would have (_take_loss_request), until anything changes its weights
        restored = pending is not None or saved_code is not None
        self._untrained_versions = (
            None
            if restored or _REQUEST.get() is not _NO_REQUEST
            else {name: p._version for name, p in self._param_store_names().items()}
        )

    def _check_stored_weights_fit(self, init_loc):
        """Refuse weights in the param store (a loaded file, another fit of this name)
        that were trained around another preconditioner than this guide's own (built
        with ``precondition=False`` or a :class:`~pyro_implicit.latent.Preconditioner`):
        they act in their preconditioner's coordinates, and would draw wrong values."""
        if self._precondition_arg[0] is True:
            return  # it takes the stored preconditioner itself
        stored = self._stored_preconditioner(init_loc)
        store = pyro.get_param_store()
        if stored is None or not any(n in store for n in self._param_store_names()):
            return
        if _same_preconditioner(stored, self.preconditioner):
            return
        cls = type(self).__name__
        raise ValueError(
            f"Pyro's param store holds {cls} weights under this guide's names, trained "
            f"around a {stored.kind} preconditioner, but this guide was built with "
            f"precondition={self._precondition_arg[0]!r} ({self.preconditioner.kind}): the "
            "weights act in their own preconditioner's coordinates and would draw wrong "
            f"values. To restore the saved fit build {cls}(model) with precondition=True "
            "(the default: the saved preconditioner comes back, with no search); to fit "
            "anew call pyro.clear_param_store() first"
        )

    def _build_around_preconditioner(self, init_loc):
        """Build the sampler around :attr:`preconditioner` (``init_loc``: the packed
        starting point, used where there is none)."""
        self._uses_layers = False  # set by _scaled_keyword, which every layered build reads
        if self.preconditioner.is_identity:
            self._init_scale = 0.1 if self._init_scale_arg is None else self._init_scale_arg
            self._build_sampler(init_loc)
        else:
            # the sampler draws whitened z: it starts at the preconditioner's Gaussian
            self._init_scale = 1.0 if self._init_scale_arg is None else self._init_scale_arg
            self._build_sampler(torch.zeros_like(init_loc))

    @property
    def whitened(self):
        """Whether the sampler draws whitened coordinates ``z`` (``u = m + L z``)."""
        return not self.preconditioner.is_identity

    def _default_noise_dim(self, latent_dim):
        """The noise of ``latent_dim`` coordinates: the size the guide was saved with where
        it is being restored (param store or ``state_dict``), else :func:`default_noise_dim`
        for this model (a network's weights, marked
        :data:`~pyro_implicit.latent.NETWORK_WEIGHTS`, or not) and this guide's
        preconditioner."""
        saved = getattr(self, "_saved_noise", None)
        if saved is not None and latent_dim == self.latent_dim:
            return saved
        sizes = {name: math.prod(shape) for name, shape in self._unconstrained_shapes.items()}
        return default_noise_dim(
            latent_dim,
            dense=self.preconditioner.kind == "dense",
            network=is_network(self.prototype_trace, sizes),
        )

    def _noise_size_now(self):
        """The built sampler's noise size (0 where it has none of one size)."""
        try:
            size = self.noise_dim
        except (NotImplementedError, AttributeError):
            return 0
        return size if isinstance(size, int) else 0

    def _saved_noise_size(self, pending=None):
        """The noise size of a state being restored: ``pending``'s, or the param store's
        where the guide took its preconditioner from there; ``None`` where there is none
        (saved before it was stored, or nothing restored)."""
        restoring = pending is not None or self.preconditioner.source == "param_store"
        code = self._saved_entry("noise_size", pending) if restoring else None
        return int(code.item()) if code is not None and code.item() > 0 else None

    @property
    def scaled_layers(self):
        """Whether the default MLP's layers are
        :class:`~pyro_implicit.guides.networks.ScaledLinear` (``parametrization``
        ``"scaled"`` or ``"ntk"``, decided when the sampler is built)."""
        return self._layers != "standard"

    @property
    def layers(self):
        """The default MLP's parametrization, ``"standard"``, ``"scaled"`` or ``"ntk"``
        (decided when the sampler is built)."""
        return self._layers

    def _scaled_keyword(self):
        """:class:`~pyro_implicit.guides.networks.MLPGenerator`'s ``scaled`` for these
        layers (a sampler built without reading it has no layers to choose)."""
        self._uses_layers = True
        return _LAYERS[self._layers][0]

    def _saved_entry(self, key, pending=None):
        """``key`` (``"layer_code"``, ``"noise_size"``) of a state being restored
        (``pending``) or of the param store; ``None`` if neither holds one."""
        if pending is not None:
            return pending[0].get(key)
        name = self._store_name(key)
        store = pyro.get_param_store()
        return store[name] if name in store else None

    def _saved_layer_code(self, pending=None):
        return self._saved_entry("layer_code", pending)

    def _resolve_layers(self, pending=None, saved_code=None):
        if self._parametrization_arg != "auto":
            return self._parametrization_arg
        # a trained guide being restored keeps the layers it was trained with
        if saved_code is not None:
            return _layers_of(saved_code)
        if pending is not None:
            names = list(pending[0])
        else:
            prefix = self._store_name("")
            names = [k for k in pyro.get_param_store().keys() if k.startswith(prefix)]
        weights = [k for k in names if "preconditioner" not in k]
        if weights:  # saved before the code was: raw weights mean scaled layers
            return "scaled" if any(k.endswith("raw_weight") for k in weights) else "standard"
        return self._resolve_layers_for(_REQUEST.get())

    def _resolve_layers_for(self, request):
        # auto: what the loss building the guide asks for, in whitened coordinates only
        # (the papers' raw-space generators stay as published)
        requested = request.parametrization
        return requested if self.whitened and requested in ("scaled", "ntk") else "standard"

    def _check_saved_layers(self, code):
        """Refuse saved weights of other layers (same names, other multipliers)."""
        if code is None:
            return
        saved = _layers_of(code)
        if saved != self._layers:
            raise ValueError(
                f"this state was saved from a {type(self).__name__} with {saved!r} layers, "
                f"but this guide has {self._layers!r} ones: build it with "
                f"parametrization={saved!r} (or 'auto')"
            )

    def latent_space(self, *args, **kwargs):
        """The model's packed latent space (:class:`~pyro_implicit.latent.LatentSpace`),
        built from this guide's prototype trace and the model's arguments."""
        self._check_ready()
        return LatentSpace.from_guide(self, args, kwargs)

    def _dense_preconditioner(self):
        """Whether the automatic preconditioner may be dense (``None``: decide by size)."""
        return None

    def _find_preconditioner(self, init_loc, args, kwargs):
        dense = self._dense_preconditioner()
        stored = None
        if self._precondition_arg[0] is False or self._precondition_arg[0] is None:
            return Preconditioner.identity()
        if self._precondition_arg[0] is True:
            # a preconditioner saved with the param store (a trained guide of this name)
            # comes back as it was instead of being searched again
            stored = self._stored_preconditioner(init_loc)
        if stored is not None:
            found = stored
        else:
            # the search runs the model: keep it off the caller's trace and param store
            space = LatentSpace.from_guide(self, args, kwargs)
            # under a particle plate (a loss's, Predictive's) the check's own plate would
            # collide with it, and the losses check once their first step is traced
            if self._precondition_arg[0] is True and not get_plates():
                self._check_search_vectorized(space, args, kwargs, init_loc.detach())
            with poutine.block():
                try:
                    found = resolve_precondition(
                        self._precondition_arg[0],
                        space,
                        init_loc.detach(),
                        args,
                        kwargs,
                        dense=dense,
                        vi_estimator=_REQUEST.get().vi_estimator,
                    )
                except (RuntimeError, IndexError) as e:
                    # the search scores batches of draws; the model ran on one draw (its
                    # prototype), so a failure here is one of vectorisation (nn.Linear on
                    # sampled weights), which raised torch's shape error before any loss's
                    # check could name the fix
                    lines = str(e).strip().splitlines()
                    raise VectorizationError(
                        f"{type(self).__name__}'s preconditioner search scores the model at a "
                        "batch of draws (a leading dim on every latent), and the model fails "
                        f"there ({type(e).__name__}: {lines[0] if lines else ''}) though it "
                        "runs on one draw: it is not written for vectorised draws, which "
                        "every loss of this library evaluates too. Write it so that latent "
                        "values may carry extra leading batch dims: e.g. `(x * beta).sum(-1)` "
                        "instead of `beta @ x.T` or `torch.dot`, no `nn.Linear` on sampled "
                        "weights, `.sum(-1)` instead of `.sum()`, no `.squeeze()`, "
                        "`torch.where` instead of a Python `if` on a latent; or build "
                        "BNNs with pyro_implicit.bnn"
                    ) from e
        return found.diagonal() if dense is False else found

    def _check_search_vectorized(self, space, args, kwargs, init_loc):
        """The losses' vectorisation check before the search, which scores batches of draws:
        a model that mixes them gives no error there, only a wrong preconditioner (each
        draw's log-likelihood summed over every draw's predictions), and a guide called
        outside a loss meets no other check. Its shapes alone: a guide of one part of a
        guide list sees a model whose other sites draw afresh on every run, so one draw's
        log-density alone and together differs there; the loss compares them with the
        whole list."""
        from ..elbo.checks import check_space_vectorized  # the losses import this module

        try:
            check_space_vectorized(space, args, kwargs, init_loc, compare_values=False)
        except VectorizationError as e:
            raise VectorizationError(
                f"{e} {type(self).__name__}'s preconditioner search scores such batches "
                "too, before any loss: precondition=False (or a Preconditioner of your "
                "own) leaves it out."
            ) from None

    # ------------------------------------------------------------------ persistence
    def _store_name(self, name):
        return self._pyro_get_fullname(name)

    def _param_store_names(self):
        """``{Pyro param store name: parameter}`` of every learned tensor of the guide,
        named as ``pyro.module`` names a plain ``nn.Module``'s parameters."""
        names = {}
        for name, param in self.named_parameters():
            if name.endswith("_unconstrained"):  # a PyroParam: PyroModule syncs it itself
                continue
            head, _, rest = name.partition(".")
            if rest:
                names[param_with_module_name(self._store_name(head), rest)] = param
            else:
                names[self._store_name(name)] = param
        return names

    def _sync_param_store(self, pull=True, names=None):
        """Make the param store hold this guide's parameters (the very tensors, so that
        ``SVI``'s optimiser steps what the sampler uses). With ``pull``, values already in
        the store under the same names (e.g. after ``pyro.get_param_store().load(path)``)
        are copied into the guide first, as a ``PyroParam`` reads the store."""
        store = pyro.get_param_store()
        names = self._param_store_names() if names is None else names
        for fullname, param in names.items():
            stored = store._params.get(fullname) if fullname in store else None
            if stored is param:
                continue
            if stored is not None and pull:
                if stored.shape != param.shape:
                    raise ValueError(
                        f"Pyro's param store holds '{fullname}' with shape "
                        f"{tuple(stored.shape)}, but this {type(self).__name__} needs "
                        f"{tuple(param.shape)} (a guide of the same name for another model "
                        "or with other sizes): to restore it, build the guide with the sizes "
                        "it was saved with (noise_dim, hidden_dims: a guide saved before its "
                        "noise size was stored gets today's default, which beyond 256 latents "
                        "has changed); to fit anew call pyro.clear_param_store() before "
                        "building it, or give it another name through AutoGuideList"
                    )
                with torch.no_grad():
                    param.copy_(stored.detach().to(dtype=param.dtype, device=param.device))
            # the store's unconstrained tensor becomes the guide's parameter itself
            store[fullname] = param

    def _stored_preconditioner(self, init_loc):
        store = pyro.get_param_store()
        kind_name = self._store_name("preconditioner.kind")
        if kind_name not in store:
            return None
        kind = int(store[kind_name].item())
        if kind == 0:
            return Preconditioner.identity()
        dim = init_loc.numel()
        loc = store[self._store_name("preconditioner.loc")].detach().to(init_loc)
        if loc.shape != (dim,):
            raise ValueError(
                f"Pyro's param store holds a preconditioner of size {loc.numel()} for "
                f"'{self._pyro_name}', but the model's packed latent has D={dim}: call "
                "pyro.clear_param_store() before building a guide for another model"
            )
        if kind == 2:
            tril = store[self._store_name("preconditioner.scale_tril")].detach().to(init_loc)
            found = Preconditioner(loc, scale_tril=tril, source="param_store")
        else:
            scale = store[self._store_name("preconditioner.scale")].detach().to(init_loc)
            found = Preconditioner(loc, scale=scale, source="param_store")
        found.diagnostics = {"source": "param_store"}
        return found

    def _store_preconditioner(self):
        """Save the preconditioner with the param store (copies, never optimised: no
        ``pyro.param`` statement reads them), so that ``save`` / ``load`` restore it."""
        store = pyro.get_param_store()
        pre = self.preconditioner
        kind = {"identity": 0, "diagonal": 1, "dense": 2}[pre.kind]
        store[self._store_name("preconditioner.kind")] = torch.tensor(float(kind))
        for key in ("loc", "scale_tril", "scale"):
            name = self._store_name(f"preconditioner.{key}")
            value = getattr(pre, key, None)
            if torch.is_tensor(value):
                store[name] = value.detach().clone()
            elif name in store:
                del store[name]

    def _store_layers(self):
        """Save the layers' code and the noise size with the param store (never
        optimised), so that ``load`` restores the generator's shape and layers, not only
        their stored parameters."""
        store = pyro.get_param_store()
        store[self._store_name("layer_code")] = self.layer_code.detach().clone()
        store[self._store_name("noise_size")] = self.noise_size.detach().clone()

    def forward(self, *args, **kwargs):
        if self.prototype_trace is None:
            # the first call builds the guide: its search and its parameters need autograd
            # and ordinary tensors whatever mode the caller draws under (torch.no_grad,
            # torch.inference_mode, whose tensors no optimiser could train later)
            with torch.inference_mode(False), torch.enable_grad():
                self._setup_prototype(*args, **kwargs)
        else:
            self._take_loss_request(args, kwargs)
            # a store loaded into a live guide replaces the tensors: read them, as a
            # PyroParam does on every access, with the preconditioner and layers saved
            # beside them
            names = self._param_store_names()
            self._adopt_stored_state(names)
            self._sync_param_store(names=names)
        return super().forward(*args, **kwargs)

    def _take_loss_request(self, args, kwargs):
        """Build a guide first called outside any loss (to look at it, by ``Predictive``,
        by :meth:`median`) again as the first loss that runs it would have built it: with
        the layers it asks for, and, where the automatic search ran a Gaussian fit, the
        preconditioner its estimate finds. Its fit then does not depend on the look.

        Only an untrained guide is rebuilt: one not restored from a saved state, whose
        weights nothing has changed in place since they were built (an optimiser's step,
        a load, an edit). Its q starts at the preconditioner's Gaussian either way (the
        residual starts near zero in every layer kind), and its parameters stay the same
        tensors (new values), so an optimiser built on ``guide.parameters()`` after the
        look still trains it. Without this, ``KernelRatioELBO`` called first on the
        conjugate Normal ended 0.22 sds off with sd ratio 1.26
        (``benchmarks/results/called_first.md``)."""
        versions = self.__dict__.get("_untrained_versions")
        request = _REQUEST.get()
        if versions is None or request is _NO_REQUEST:
            return
        self._untrained_versions = None  # a loss runs it: from now on it stays as it is
        names = self._param_store_names()
        store = pyro.get_param_store()
        untouched = names.keys() == versions.keys() and all(
            store._params.get(n) is p and p._version == versions[n] for n, p in names.items()
        )
        found = getattr(self.preconditioner, "diagnostics", None) or {}
        estimator = found.get("gaussian_vi_estimator")
        research = self._precondition_arg[0] is True and estimator not in (
            None,
            request.vi_estimator,
        )
        relayer = (
            self._parametrization_arg == "auto"
            and self._uses_layers
            and self._resolve_layers_for(request) != self._layers
        )
        if not untouched or not (research or relayer):
            return
        for name in names:
            del store[name]
        init_loc = self._init_loc()
        if research:
            prefix = self._store_name("preconditioner.")
            for name in [n for n in store.keys() if n.startswith(prefix)]:
                del store[name]
            self.preconditioner = self._find_preconditioner(init_loc, args, kwargs)
        if self._parametrization_arg == "auto":
            self._layers = self._resolve_layers_for(request)
            self.layer_code.fill_(_LAYERS[self._layers][1])
        self._build_around_preconditioner(init_loc)
        self.noise_size.fill_(float(self._noise_size_now()))
        self._keep_parameter_tensors(list(names.values()))
        self._sync_param_store(pull=False)
        self._store_preconditioner()
        self._store_layers()

    @torch.no_grad()
    def _keep_parameter_tensors(self, old):
        """Give the rebuilt sampler's parameters the tensors ``old`` held (in order, shape
        for shape), with the new values: what holds them (an optimiser) holds the guide's
        parameters still. A sampler of another structure keeps its new tensors."""
        new = [
            (name, param)
            for name, param in self.named_parameters()
            if not name.endswith("_unconstrained")
        ]
        if [p.shape for _, p in new] != [p.shape for p in old]:
            return
        for (name, param), tensor in zip(new, old, strict=True):
            tensor.copy_(param)
            owner, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(owner) if owner else self, leaf, tensor)

    def _adopt_stored_state(self, names):
        """Read the param store's state when its tensors are no longer this guide's.

        Two events cause it: a store loaded from a file, or another guide of the same
        name (the same class: Pyro names an autoguide after its class) fitted since.
        Pyro's own autoguides then read the other parameters, and so does this guide.
        Its weights act in its preconditioner's coordinates, so it takes the stored
        preconditioner with them, not other weights in its own coordinates. Stored
        weights of other layers are refused (the same names, other multipliers). After
        ``pyro.clear_param_store()`` the guide stores its own state again."""
        store = pyro.get_param_store()
        if all(store._params.get(n) is p for n, p in names.items()):
            return
        kind_name = self._store_name("preconditioner.kind")
        if not any(n in store for n in names) and kind_name not in store:
            # a cleared store: this guide's state goes back in (_sync_param_store does
            # the parameters)
            self._store_preconditioner()
            self._store_layers()
            return
        try:
            self._check_saved_layers(self._saved_layer_code())
        except ValueError as e:
            cls = type(self).__name__
            raise ValueError(
                f"Pyro's param store holds another {cls}'s state under this guide's names (a "
                f"loaded file, or another {cls} fitted since: guides of one class share the "
                f"store's names, as Pyro's autoguides do), and {e}. To draw from this guide's "
                "own fit, draw before fitting the next guide, or call "
                "pyro.clear_param_store() first (this guide then stores its own state again)"
            ) from e
        like = self._noise_reference.new_zeros(self.latent_dim)
        stored = self._stored_preconditioner(like)
        if stored is not None and not _same_preconditioner(stored, self.preconditioner):
            self.preconditioner = stored

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Restore :meth:`state_dict`, preconditioner included.

        Before the guide's first call (it is built lazily) the state is kept and applied
        when the first call builds the sampler, with the saved preconditioner instead of a
        new search; after it, a preconditioner of another kind or size is replaced by the
        saved one. The param store then holds the loaded values."""
        if assign:
            raise NotImplementedError(f"{type(self).__name__}.load_state_dict(assign=True)")
        if self.prototype_trace is None:
            self._pending_state = (dict(state_dict), strict)
            return torch.nn.modules.module._IncompatibleKeys([], [])
        self._check_saved_layers(state_dict.get("layer_code"))
        for key in ("layer_code", "noise_size"):  # saved before the guide stored it
            if key not in state_dict:
                state_dict = {**state_dict, key: getattr(self, key).clone()}
        ref = self._noise_reference
        saved = _preconditioner_from_state(state_dict, ref)
        current = self.preconditioner
        same = saved.kind == current.kind and (
            saved.is_identity or saved.loc.shape == current.loc.shape
        )
        if not same:
            self.preconditioner = saved
        result = super().load_state_dict(state_dict, strict=strict)
        self._sync_param_store(pull=False)
        self._store_preconditioner()
        self._store_layers()
        return result

    def _build_sampler(self, init_loc):
        """Create the sampler's parameters. ``init_loc`` is the packed ``(D,)`` initial
        location given by ``init_loc_fn``."""
        raise NotImplementedError

    @property
    def noise_dim(self):
        """Size of the standard-normal noise vector the sampler consumes."""
        raise NotImplementedError

    def _latent_from_noise(self, noise):
        """Map noise ``(..., noise_dim)`` to the sampler's output ``(..., D)``: the whitened
        ``z`` (``u = m + L z``) when :attr:`whitened`, else ``u`` itself."""
        raise NotImplementedError

    def _implicit_info(self):
        """The record stored in ``infer["pyro_implicit"]`` of the latent site."""
        return {"guide": self, "capabilities": self.capabilities}

    # ------------------------------------------------------------------ pyro guide
    def get_posterior(self, *args, **kwargs):
        raise NotImplementedError(
            f"{type(self).__name__} is an implicit distribution: it can be sampled "
            "(sample_unconstrained, sample_posterior, Predictive) but has no density."
        )

    def _loc_scale(self, *args, **kwargs):
        raise NotImplementedError(
            f"{type(self).__name__} has no location-scale form; median() and quantiles() "
            "are computed from samples."
        )

    #: what :class:`ImplicitDelta`'s error says to train this guide with
    _pairing_hint_text = _LOSSES_HINT

    def _draw_noise(self):
        """The draw's standard-normal noise, as auxiliary sample sites (hook: one site of
        :attr:`noise_dim` values here)."""
        zero = self._noise_reference
        return pyro.sample(
            f"_{self._pyro_name}_noise",
            dist.Normal(zero, 1.0).expand([self.noise_dim]).to_event(1).mask(False),
            infer={"is_auxiliary": True},
        )

    def _sampler_output(self, noise):
        """The sampler's output for :meth:`_draw_noise`'s noise (hook: where a guide also
        records what its loss reads, e.g. SIVI's mixing draw); whitened when
        :attr:`whitened`."""
        return self._latent_from_noise(noise)

    def sample_latent(self, *args, **kwargs):
        """Draw the packed latent ``u`` as an auxiliary site (see the module docstring):
        the noise (:meth:`_draw_noise`), the sampler (:meth:`_sampler_output`), then
        :math:`u = m + L z` and the site that marks it implicit."""
        latent = self.preconditioner.unwhiten(self._sampler_output(self._draw_noise()))
        return pyro.sample(
            f"_{self._pyro_name}_latent",
            ImplicitDelta(latent, event_dim=1, hint=self._pairing_hint_text),
            infer={"is_auxiliary": True, IMPLICIT_FLAG: self._implicit_info()},
        )

    # ------------------------------------------------------------------ sampling
    def _check_ready(self):
        if self.prototype_trace is None:
            raise RuntimeError(
                f"{type(self).__name__} is built lazily from the model's first call: call "
                "guide(*args) (or run one SVI step) before sampling from it; a guide made "
                "anew after pyro.get_param_store().load(...) reads the loaded state on that "
                "call."
            )

    def standard_normal(self, *shape):
        """Standard normal noise of ``shape`` in the guide's dtype and on its device."""
        ref = self._noise_reference
        return torch.randn(*shape, dtype=ref.dtype, device=ref.device)

    @contextlib.contextmanager
    def drawing_directly(self):
        """Draw from the guide outside a Pyro call (a loss's traced path) as a call would:
        the param store read (a loaded store replaces the tensors) and the guide's
        parameters registered with it (its Pyro context)."""
        self._sync_param_store()
        with self._pyro_context:
            yield

    def sample_unconstrained(self, num_samples):
        """Draw ``(num_samples, D)`` packed unconstrained latents in one vectorised call.

        Keeps the autograd graph to the sampler's parameters.
        """
        self._check_ready()
        check_count("num_samples", num_samples, least=0)
        return self.preconditioner.unwhiten(self.sample_whitened(num_samples))

    def sample_whitened(self, num_samples):
        """:meth:`sample_unconstrained`'s draws before the preconditioner, ``z`` with
        ``u = m + L z`` (``u`` itself without one), for losses that work in whitened
        coordinates: the same random stream, without the ``D x D`` product."""
        self._check_ready()
        noise = self.standard_normal(num_samples, self.noise_dim)
        return self._latent_from_noise(noise)

    def unpack(self, latent):
        """Split packed latents ``(S, D)`` into constrained site values.

        :return: ``{name: tensor of shape (S,) + site shape}`` (no plate padding).
        :rtype: dict
        """
        self._check_ready()
        num = latent.shape[0]
        padded = latent.reshape((num,) + (1,) * self._max_plate_nesting + latent.shape[-1:])
        result = {}
        for site, u in self._unpack_latent(padded):
            value = biject_to(site["fn"].support)(u)
            result[site["name"]] = value.reshape((num,) + site["value"].shape)
        return result

    def sample_posterior(self, num_samples):
        """Draw ``num_samples`` joint posterior samples of every latent site.

        :return: ``{name: tensor of shape (num_samples,) + site shape}``, detached.
        :rtype: dict
        """
        with torch.no_grad():
            return self.unpack(self.sample_unconstrained(num_samples))

    def _fixed_seed_draws(self, num_samples=None):
        """``num_samples`` (default :attr:`num_quantile_samples`) unconstrained draws, the
        same at every call: :meth:`median`'s and :meth:`quantiles`', and the losses' check
        that a fit has not run away."""
        # The same draws at every call (a fixed seed, inside a fork of the streams the
        # guide draws from: the user's streams neither advance nor move the result), so
        # that median() and quantiles() agree and repeat whatever ran before them.
        device = self._noise_reference.device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.random.default_generator.manual_seed(_FIXED_DRAWS_SEED)
            if devices:
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(_FIXED_DRAWS_SEED)
            return self.sample_unconstrained(num_samples or self.num_quantile_samples)

    @torch.no_grad()
    def quantiles(self, quantiles, *args, **kwargs):
        """Posterior quantiles of every latent site, from samples.

        As Pyro's autoguides do, quantiles are taken per coordinate of the packed
        *unconstrained* draws and mapped through each site's ``biject_to`` transform, so
        every result lies inside the site's support. For real, positive and interval
        supports (elementwise, monotone transforms) this is the ordinary per-coordinate
        quantile of the site. For a simplex (``Dirichlet``) or a Cholesky factor of a
        correlation matrix (``LKJCholesky``) it is the point whose unconstrained
        coordinates sit at that level: a valid simplex or Cholesky factor, but not the
        quantile of each constrained coordinate (those cannot, in general, sum to 1 or
        form a correlation matrix together).

        :param quantiles: quantile levels in [0, 1].
        :return: ``{name: tensor of shape (len(quantiles),) + site shape}``.
        :rtype: dict
        """
        if self.prototype_trace is None:
            if not args and not kwargs:
                self._check_ready()
            # the set-up a first call does (inside the guide's Pyro context), recording
            # nothing: the quantiles are then those of the guide's starting point
            with poutine.block():
                self(*args, **kwargs)
        draws = self._fixed_seed_draws()
        q = torch.as_tensor(quantiles, dtype=draws.dtype, device=draws.device)
        if q.dim() != 1 or (q < 0).any() or (q > 1).any():
            raise ValueError(f"quantiles must be a list of levels in [0, 1], got {quantiles}")
        return self.unpack(torch.quantile(draws, q, dim=0))

    @torch.no_grad()
    def median(self, *args, **kwargs):
        """Posterior median of every latent site: the per-coordinate median of the
        unconstrained draws mapped into each support (see :meth:`quantiles`).

        :return: ``{name: tensor shaped like the site}``.
        :rtype: dict
        """
        return {k: v[0] for k, v in self.quantiles([0.5], *args, **kwargs).items()}


#: the seed of :meth:`ImplicitAutoGuide._fixed_seed_draws` (median, quantiles, the runaway check)
_FIXED_DRAWS_SEED = 0

#: up to this many latent coordinates a generator's default noise is as large as the
#: latent: its draws fill every direction, so q can start at the preconditioner's dense
#: Gaussian and hold a posterior that is not low-rank
FULL_RANK_NOISE_LIMIT = 256


def default_noise_dim(latent_dim, dense=False, network=False):
    """Noise size scaled to D: D up to :data:`FULL_RANK_NOISE_LIMIT`; beyond it a
    network's (:func:`network_noise_dim`) for a network's weights (``network``: sites
    marked :data:`~pyro_implicit.latent.NETWORK_WEIGHTS` hold most coordinates, as in
    :mod:`pyro_implicit.bnn`), D for any other model up to
    :data:`~pyro_implicit.latent.DENSE_LIMIT` coordinates and at any D where ``dense``
    (the guide's preconditioner has a dense factor), and a network's beyond.

    With less noise than D a generator's draws lie on a d-dimensional surface. A network's
    predictions do not need more: around the Gaussian fit of the ``energy`` BNN a
    network's noise and noise of D gave ``kivi`` the same test log-likelihood within a
    seed's spread (-1.500 and -1.511, ``audit_probes_s61.md`` section 5), and
    ``LinearizedGuide`` with ``LIVI_ELBO(num_particles=32)`` took 99 ms a step and -1.328
    with 87 values against 1037 ms and -1.497 with 502
    (``benchmarks/results/preconditioner_start_likelihood.md``). Any other posterior
    does: on the non-centred hierarchical logistic regression with 296 groups (D = 300)
    ``SteinScoreELBO``'s draws with a network's 81 values had marginal sds a median 0.18
    of NUTS's, with 300 values 0.65 around the search's one-round Gaussian fit and 0.99
    around its fit in rounds
    (``benchmarks/results/preconditioner_decisive_likelihood.md`` sections 4 and 7); on
    a 150-coefficient regression with an exact Gaussian posterior (``wide_blr`` of
    :mod:`pyro_implicit.targets.conjugate`, ``benchmarks/results/wide_blr_defaults.md``)
    73 values left ``KernelRatioELBO``'s fit with correlation errors of 0.6 after 2000
    steps, where 150 end at the exact posterior.

    :param bool dense: whether the guide's preconditioner has a dense factor.
    :param bool network: whether the latent is mostly a network's weights."""
    if latent_dim <= FULL_RANK_NOISE_LIMIT:
        return max(latent_dim, 2)
    if network or (latent_dim > DENSE_LIMIT and not dense):
        return network_noise_dim(latent_dim)
    return latent_dim


def network_noise_dim(latent_dim):
    """Noise size of a network's weights: D up to 64, then growing slowly (KIVI's BNN
    generators use 20-100; LIVI's 60-85 on its toy problems): the size every D had before
    :data:`FULL_RANK_NOISE_LIMIT`, and GPVI's active dimension k."""
    if latent_dim <= 64:
        return max(latent_dim, 2)
    return int(min(128, 64 + 8 * math.log2(latent_dim / 64)))


def _layers_of(code):
    """The layers a saved ``layer_code`` stands for."""
    return next(k for k, (_, c) in _LAYERS.items() if c == float(torch.as_tensor(code).detach()))


def _same_preconditioner(a, b):
    """Whether two preconditioners are the same map (kind, and every value)."""
    if a.kind != b.kind:
        return False
    if a.is_identity:
        return True
    return all(
        torch.equal(getattr(a, key), getattr(b, key).to(getattr(a, key)))
        for key in ("loc", "scale_tril", "scale")
        if torch.is_tensor(getattr(a, key, None))
    )


def _preconditioner_from_state(state_dict, like):
    """The :class:`Preconditioner` saved in a guide's ``state_dict`` (its buffers)."""
    loc = state_dict.get("preconditioner.loc")
    if loc is None:
        return Preconditioner.identity()
    loc = loc.to(dtype=like.dtype, device=like.device)
    tril = state_dict.get("preconditioner.scale_tril")
    if tril is not None:
        found = Preconditioner(loc, scale_tril=tril.to(loc), source="state_dict")
    else:
        found = Preconditioner(
            loc, scale=state_dict["preconditioner.scale"].to(loc), source="state_dict"
        )
    found.diagnostics = {"source": "state_dict"}
    return found
