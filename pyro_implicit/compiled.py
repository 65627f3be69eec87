r"""The log-density of a model's latent space as a traced graph: Pyro's tracing, done
once, taken off the hot path.

Every evaluation of :meth:`~pyro_implicit.latent.LatentSpace.log_density` runs the model's
Python code through Pyro's effect handlers; on small models that overhead, not the
arithmetic, is most of the time. :class:`CompiledLogDensity` runs the model once more under
``torch.fx``'s ``make_fx``, which records the aten operations the run performs, the
gradient's included (``torch.func.grad_and_value``), and replays that graph afterwards:
a pure function of ``u``. Random operations (a plate's subsample indices) are recorded as
operations, so each call still draws fresh minibatches, as the eager path does; the full
data of a subsampled model runs through one minibatch's graph, the indices its input. With
``backend="inductor"`` the graph is compiled further by ``torch.compile``.

What a graph cannot follow, it does not pretend to:

* **model parameters** (``pyro.param`` in the model) would be frozen into the graph: such a
  model stays eager;
* **data-dependent Python control flow** is frozen at the traced values (as with
  ``torch.jit.trace``); a model whose structure changes with the values of its latents
  must not be compiled (``compile=False``);
* **new arguments** (other tensors, or the same ones resized) are traced anew, up to
  ``max_signatures`` of them; beyond that the space goes back to eager;
* **validation** (``pyro.enable_validation``) runs on the eager evaluation that precedes
  each trace, not in the graph.

Every fallback is logged (logger ``pyro_implicit.compiled``, level INFO) with its reason
and recorded in :attr:`CompiledLogDensity.fallback_reason`.
"""

import collections
import logging
import time

import pyro
import pyro.poutine as poutine
import torch
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["BACKENDS", "CompiledLogDensity"]

logger = logging.getLogger(__name__)

#: what the graph is replayed with
BACKENDS = ("fx", "inductor")


def _over_minibatches(graph, batches):
    """The full-data ``(score, log_density)`` from a minibatch's ``graph(u, *indices)``:
    the mean over ``batches`` (:meth:`~pyro_implicit.latent.LatentSpace.log_density`)."""

    def full(u):
        grad, value = graph(u, *batches[0].values())
        for indices in batches[1:]:
            more_grad, more_value = graph(u, *indices.values())
            grad, value = grad + more_grad, value + more_value
        return grad / len(batches), value / len(batches)

    return full


_INDEX_DTYPES = (torch.int64, torch.int32)


def _constant_dim_index(graph_module, indices):
    """``(dim, index node)`` where ``indices`` (an ``aten.index`` list) index one dimension
    only, by a constant 1-D integer tensor with no negative entries (those would wrap in
    ``aten.index`` and fail in ``index_select``); ``None`` otherwise."""
    used = [(dim, node) for dim, node in enumerate(indices) if node is not None]
    if len(used) != 1:
        return None
    dim, node = used[0]
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value = getattr(graph_module, node.target, None)
    if not torch.is_tensor(value) or value.dim() != 1 or value.dtype not in _INDEX_DTYPES:
        return None
    if value.numel() and int(value.min()) < 0:
        return None
    return dim, node


def _select_along_one_dim(graph_module):
    """Rewrite a gather along one dimension by a constant index (``beta[..., group, :]``,
    the commonest indexing of a hierarchical model) from ``aten.index`` to
    ``index_select``, and its gradient from ``index_put(..., accumulate=True)`` into zeros
    to ``index_add``: the same values (each sums the same terms), in a third to a half of
    the time on the CPU (the hierarchical logistic regression of
    ``benchmarks/compiled_score.py``, 200 draws: 0.70 -> 0.21 ms and 0.90 -> 0.36 ms). Every
    other indexing is left as traced. Returns the number of nodes rewritten."""
    aten = torch.ops.aten
    graph = graph_module.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.index.Tensor:
            source, indices = node.args
            found = _constant_dim_index(graph_module, indices)
            if found is None:
                continue
            dim, index = found
            with graph.inserting_before(node):
                new = graph.call_function(aten.index_select.default, (source, dim, index))
        elif node.target is aten.index_put.default and len(node.args) == 4 and node.args[3]:
            target, indices, values, _ = node.args
            found = _constant_dim_index(graph_module, indices)
            if found is None:
                continue
            dim, index = found
            # index_add takes exactly the selected shape, not a broadcastable one
            if not (isinstance(target, torch.fx.Node) and isinstance(values, torch.fx.Node)):
                continue
            target_val, values_val = target.meta.get("val"), values.meta.get("val")
            if target_val is None or values_val is None:
                continue
            expected = list(target_val.shape)
            expected[dim] = getattr(graph_module, index.target).numel()
            if list(values_val.shape) != expected:
                continue
            with graph.inserting_before(node):
                new = graph.call_function(aten.index_add.default, (target, dim, index, values))
        else:
            continue
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        graph.lint()
        graph_module.recompile()
    return rewritten


class _Uncompilable(Exception):
    """A reason to stay eager."""


def _signature(value):
    """A hashable description of an argument: tensors by identity, shape, dtype, device
    and version (an in-place change retraces), plain values by value."""
    if torch.is_tensor(value):
        return (
            "tensor",
            id(value),
            tuple(value.shape),
            value.dtype,
            str(value.device),
            value._version,
        )
    if isinstance(value, (int, float, bool, str, type(None))):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__,) + tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return ("dict",) + tuple((k, _signature(v)) for k, v in sorted(value.items()))
    if isinstance(value, torch.nn.Module):
        # a module's parameters enter the graph as constants: only frozen ones are safe
        if any(p.requires_grad for p in value.parameters()):
            raise _Uncompilable(
                f"the model takes a module ({type(value).__name__}) with trainable parameters"
            )
        return ("module", id(value))
    raise _Uncompilable(f"an argument of type {type(value).__name__} cannot be keyed")


class CompiledLogDensity:
    """Traced ``(log_density, score)`` graphs of a :class:`~pyro_implicit.latent.LatentSpace`,
    one per input signature (batch shape, dtype, device, the model's arguments, full data or
    one minibatch).

    :param space: the :class:`~pyro_implicit.latent.LatentSpace`.
    :param str backend: ``"fx"`` (replay the traced graph: cheap to build, the score about
        2-3x faster than eager on small models) or ``"inductor"`` (``torch.compile`` the
        graph: seconds to build, an order of magnitude faster again per call).
    :param int max_signatures: distinct input signatures traced before giving up (the
        arguments change on every call).
    """

    def __init__(self, space, backend="fx", max_signatures=8):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.space = space
        self.backend = backend
        self.max_signatures = int(max_signatures)
        self._graphs = collections.OrderedDict()
        #: why the space went back to eager (``None`` while it is compiled)
        self.fallback_reason = None
        #: ``{"traces", "calls", "trace_seconds", "compile_seconds", "rewritten_nodes"}``
        #: (the last: gathers made ``index_select`` / ``index_add``)
        self.stats = {
            "traces": 0,
            "calls": 0,
            "trace_seconds": 0.0,
            "compile_seconds": 0.0,
            "rewritten_nodes": 0,
        }

    @property
    def active(self):
        """Whether calls are still served by graphs."""
        return self.fallback_reason is None

    def _give_up(self, reason):
        self.fallback_reason = reason
        self._graphs.clear()
        logger.info(
            "pyro_implicit: log-density of %s runs eagerly: %s",
            getattr(self.space.model, "__name__", type(self.space.model).__name__),
            reason,
        )

    def _check_model(self, args, kwargs):
        with torch.no_grad(), poutine.block():
            trace = poutine.trace(self.space.model).get_trace(*args, **kwargs)
        params = [name for name, site in trace.nodes.items() if site["type"] == "param"]
        if params:
            raise _Uncompilable(
                f"the model has parameters {params} (pyro.param), which a graph would freeze"
            )

    def score(self, u, args=(), kwargs=None, full_data=True):
        """``(log_density, score)`` of the rows of ``u`` from the graph of their signature,
        or ``None`` when the space runs eagerly (the caller then evaluates it itself).

        :param torch.Tensor u: ``(N, D)``; no gradient flows back to it.
        """
        if not self.active:
            return None
        kwargs = kwargs or {}
        try:
            key = (
                bool(full_data),
                tuple(u.shape),
                u.dtype,
                str(u.device),
                _signature(tuple(args)),
                _signature(dict(kwargs)),
            )
        except _Uncompilable as e:
            self._give_up(str(e))
            return None
        graph = self._graphs.get(key)
        if graph is None:
            if not bool(torch.isfinite(u).all()):
                return None  # not a reason to give up: trace at the next finite batch
            if len(self._graphs) >= self.max_signatures:
                self._give_up(
                    f"more than {self.max_signatures} argument signatures (new data on "
                    "every call?): tracing each costs more than it saves"
                )
                return None
            try:
                graph = self._trace(u, args, kwargs, full_data)
            except _Uncompilable as e:
                self._give_up(str(e))
                return None
            except Exception as e:  # noqa: BLE001 - any tracing failure means: stay eager
                self._give_up(f"tracing failed ({type(e).__name__}: {str(e).splitlines()[0]})")
                return None
            # keep the arguments alive: the graph holds them as constants, and their ids key
            # the cache
            self._graphs[key] = graph = (graph, args, kwargs)
        self._graphs.move_to_end(key)
        self.stats["calls"] += 1
        grad, value = graph[0](u.detach())
        return value, grad

    def _trace(self, u, args, kwargs, full_data):
        space = self.space
        batches = space.covering_minibatches(u.device) if full_data else []
        minibatch = len(batches) > 1

        def log_density_sum(v, *indices):
            if not minibatch:
                lp = space._eager_log_density(v, args, kwargs, full_data)
            else:  # one minibatch, its indices an input of the graph
                batch = dict(zip(batches[0], indices, strict=True))
                lp = space.minibatch_log_density(v, args, kwargs, batch)
            return lp.sum(), lp

        def grad_and_value(v, *indices):
            grad, (_, lp) = torch.func.grad_and_value(log_density_sum, has_aux=True)(v, *indices)
            return grad, lp

        start = time.perf_counter()
        # an eager run first: it validates the model (the graph will not); the random
        # streams are restored after it and after the trace, so that the first replay
        # draws what one eager call would
        rng = pyro.util.get_rng_state()
        if not self.stats["traces"]:
            self._check_model(args, kwargs)
            pyro.util.set_rng_state(rng)
        with torch.no_grad():
            space._eager_log_density(u.detach(), args, kwargs, full_data)
        pyro.util.set_rng_state(rng)
        # the full data of a subsampled model runs one minibatch after another through one
        # minibatch's graph: unrolled, the graph grew with the data (a trace of 200
        # minibatches took 18 s), and so would its compilation
        inputs = (u.detach(), *batches[0].values()) if minibatch else (u.detach(),)
        with pyro.validation_enabled(False):
            graph = make_fx(grad_and_value)(*inputs)
        pyro.util.set_rng_state(rng)
        self.stats["rewritten_nodes"] += _select_along_one_dim(graph)
        self.stats["traces"] += 1
        self.stats["trace_seconds"] += time.perf_counter() - start
        if self.backend == "inductor":
            start = time.perf_counter()
            graph = torch.compile(graph, dynamic=False)
            rng = pyro.util.get_rng_state()
            graph(*inputs)  # compile now, so that its time is counted here
            pyro.util.set_rng_state(rng)
            self.stats["compile_seconds"] += time.perf_counter() - start
        return _over_minibatches(graph, batches) if minibatch else graph
