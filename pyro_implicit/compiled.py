r"""The log-density of a model's latent space as a traced graph: Pyro's tracing, done
once, taken off the hot path.

Every evaluation of :meth:`~pyro_implicit.latent.LatentSpace.log_density` runs the model's
Python code through Pyro's effect handlers; on small models that overhead, not the
arithmetic, is most of the time. :class:`CompiledLogDensity` runs the model once more under
``torch.fx``'s ``make_fx``, which records the aten operations the run performs, the
gradient's included (``torch.func.grad_and_value``), and replays that graph afterwards:
a pure function of ``u``. Random operations (a plate's subsample indices) are recorded as
operations, so each call still draws fresh minibatches, as the eager path does; the full
data of a subsampled model runs through one minibatch's graph, the indices its input. The
graph is then simplified (:func:`_simplify`: what the trace recorded but the replay does
not need, the same values to the bit). With ``backend="inductor"`` it is compiled further
by ``torch.compile``.

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
import contextlib
import logging
import math
import time
import warnings

import pyro
import pyro.poutine as poutine
import torch
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["BACKENDS", "CompiledLogDensity"]

logger = logging.getLogger(__name__)

#: what the graph is replayed with
BACKENDS = ("fx", "inductor")


#: draws x minibatches one replay of a subsampled model's full-data graph holds: at half
#: this many draws or fewer, minibatches are stacked and the graph vmapped over them, since a
#: replay's cost on small models is its nodes' Python calls, not their arithmetic (the
#: Boston BNN's six minibatches, a MAP step at one draw: 3.9 ms one after another, 1.2 ms
#: stacked; at 8 draws 5.3 -> 2.5 ms, at 16 in two stacks of three 6.6 -> 6.5 ms, larger
#: stacks slower than the loop). A pass holds fewer rows than the search's curvature
#: probes (64 draws of one minibatch) already do.
STACKED_MINIBATCH_DRAWS = 48


def _stacked(batches, per_call):
    """``[(inputs, valid)]``: ``batches`` (tuples of a minibatch's graph inputs) stacked
    ``per_call`` at a time, each input ``(per_call, ...)``, the last stack padded with
    copies of its first minibatch (``valid`` counts the real ones)."""
    stacks = []
    for start in range(0, len(batches), per_call):
        part = batches[start : start + per_call]
        valid = len(part)
        part = part + [part[0]] * (per_call - valid)
        stacks.append((tuple(torch.stack(column) for column in zip(*part, strict=True)), valid))
    return stacks


def _over_minibatches(graph, batches, per_call=1):
    """The full-data ``(score, log_density)`` from a minibatch's ``graph(u, *inputs)``:
    the mean over ``batches`` (tuples of each minibatch's inputs;
    :meth:`~pyro_implicit.latent.LatentSpace.log_density`). With ``per_call > 1`` the
    graph is vmapped over ``per_call`` stacked minibatches, its outputs with a leading
    minibatch dimension."""
    stacks = _stacked(batches, per_call) if per_call > 1 else [(b, None) for b in batches]

    def full(u):
        grad = value = 0.0
        for inputs, valid in stacks:
            more_grad, more_value = graph(u, *inputs)
            if valid is not None:
                more_grad, more_value = more_grad[:valid].sum(0), more_value[:valid].sum(0)
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


#: ops that return their first argument's values unchanged when the second is this constant
_IDENTITY_SCALARS = {
    torch.ops.aten.mul.Tensor: 1,
    torch.ops.aten.mul.Scalar: 1,
    torch.ops.aten.div.Tensor: 1,
    torch.ops.aten.div.Scalar: 1,
    torch.ops.aten.add.Tensor: 0,
    torch.ops.aten.add.Scalar: 0,
    torch.ops.aten.sub.Tensor: 0,
    torch.ops.aten.sub.Scalar: 0,
    torch.ops.aten.pow.Tensor_Scalar: 1,
}
#: views that return their argument unchanged when the shape asked for is its own
_SAME_SHAPE_VIEWS = (
    torch.ops.aten.expand.default,
    torch.ops.aten.view.default,
    torch.ops.aten.alias.default,
    torch.ops.aten._unsafe_view.default,
)


def _is_op(node):
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)


def _same_tensor_type(node, source):
    """Whether the values recorded for two nodes have one shape, dtype and device."""
    a, b = node.meta.get("val"), source.meta.get("val")
    return (
        torch.is_tensor(a)
        and torch.is_tensor(b)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _identity_source(node):
    """The node whose value ``node`` repeats (``x * 1``, ``x + 0``, ``x ** 1``, a view
    of ``x`` in its own shape, a fresh copy of a constant), or ``None``."""
    aten = torch.ops.aten
    if not _is_op(node) or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    source, target, args = node.args[0], node.target, node.args
    if target is aten.lift_fresh_copy.default:
        return source
    if target in _IDENTITY_SCALARS:
        identity = _IDENTITY_SCALARS[target]
        if node.kwargs or len(args) != 2 or type(args[1]) not in (int, float):
            return None
        if args[1] != identity:
            return None
    elif target not in _SAME_SHAPE_VIEWS:
        return None
    return source if _same_tensor_type(node, source) else None


def _impure(node):
    """Whether removing or merging ``node`` could change what the graph does: it writes a
    tensor in place, draws random numbers (a subsample's indices: the stream must advance
    as the eager run's does), or is not a plain aten operation."""
    if not _is_op(node):
        return True
    target = node.target
    return target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags


#: operations that may return their argument's storage without saying so in their schema
_UNDECLARED_ALIASES = (torch.ops.aten._unsafe_view.default, torch.ops.aten._reshape_alias.default)


def _aliases(node):
    """Whether ``node``'s value may share its first argument's storage."""
    return _is_op(node) and (node.target.is_view or node.target in _UNDECLARED_ALIASES)


def _written_storages(graph):
    """Every node whose value shares storage with a tensor that an in-place operation
    writes (the written tensor's views' bases, and all views of those): nodes the rewrites
    must leave alone, since a copy of such a value and the value itself part ways after
    the write."""
    roots = []
    for node in graph.nodes:
        if not (_is_op(node) and node.target._schema.is_mutable):
            continue
        stack = [arg for arg in node.args if isinstance(arg, torch.fx.Node)]
        while stack:  # back through views to the tensors that own the storage
            current = stack.pop()
            if _aliases(current) and current.args:
                stack.extend(a for a in current.args[:1] if isinstance(a, torch.fx.Node))
            else:
                roots.append(current)
    written, stack = set(), roots
    while stack:  # forward to every view of them
        current = stack.pop()
        if current in written:
            continue
        written.add(current)
        stack.extend(user for user in current.users if _aliases(user))
    return written


def _drop_identities(graph, written):
    """Replace each node that repeats its input by that input; returns how many."""
    removed = 0
    for node in list(graph.nodes):
        source = _identity_source(node)
        if source is None or node in written or source in written:
            continue
        if any(user.op == "output" for user in node.users):
            continue  # a returned constant or input would be handed out to be changed
        node.replace_all_uses_with(source)
        graph.erase_node(node)
        removed += 1
    return removed


def _node_inputs(node):
    inputs = []
    torch.fx.node.map_arg((node.args, node.kwargs), inputs.append)
    return inputs


def _merge_repeats(graph, written):
    """Replace each operation computed again on the same inputs by its first result;
    returns how many."""
    removed, seen = 0, {}
    for node in list(graph.nodes):
        if _impure(node) or node in written or any(a in written for a in _node_inputs(node)):
            continue
        key = (node.target, repr((node.args, node.kwargs)))  # nodes repr by unique name
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
            removed += 1
        else:
            seen[key] = node
    return removed


#: operations whose result depends on their tensor argument's shape, dtype and device
#: only, which a graph's signature fixes
_SHAPE_ONLY = (
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.ones_like.default,
    torch.ops.aten.full_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_ones.default,
    torch.ops.aten.new_full.default,
)
#: the most storage one folded value may hold: a prior's scale expanded over 100 particles
#: of a network's weights is kept, a tensor of the data's size times the particles is not
_FOLD_MAX_BYTES = 1 << 20
#: the most storage all of a graph's folded values may hold together (a model of thousands
#: of sites folds each site's part; past this, the rest is computed on every call)
_FOLD_MAX_TOTAL_BYTES = 1 << 26


def _constant_or_stand_in(node, values):
    """``node``'s folded value, or an uninitialised tensor of its recorded shape, strides,
    dtype and device (the argument of an operation that reads only those)."""
    if node in values:
        return values[node]
    fake = node.meta["val"]
    return torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype, device=fake.device)


def _fold_constants(graph_module, written):
    """Compute once what does not depend on the graph's inputs (a prior's parameters
    broadcast, their logarithms and squares; zeros of a fixed shape) and keep the result
    as a buffer of the graph; returns how many nodes became buffers."""
    graph = graph_module.graph
    values = {}  # node -> its value, for every node that is a constant
    for node in graph.nodes:
        if node in written:
            continue
        if node.op == "get_attr":
            values[node] = getattr(graph_module, node.target)
            continue
        if _impure(node):
            continue
        shape_of = node.args[0] if node.target in _SHAPE_ONLY else None
        if not all(a in values or a is shape_of for a in _node_inputs(node)):
            continue
        try:
            args, kwargs = torch.fx.node.map_arg(
                (node.args, node.kwargs), lambda arg: _constant_or_stand_in(arg, values)
            )
            value = node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - what cannot be computed here stays in the graph
            continue
        if torch.is_tensor(value) and value.untyped_storage().nbytes() <= _FOLD_MAX_BYTES:
            values[node] = value
    folded, kept = 0, {}  # kept: storage -> bytes, of the values made buffers
    for node in list(graph.nodes):
        if node.op != "call_function" or node not in values:
            continue
        if all(user in values for user in node.users):
            continue  # inside a folded part: its users are folded, or it is unused
        if any(user.op == "output" for user in node.users):
            continue  # a buffer handed out could be changed by the caller
        storage = values[node].untyped_storage()
        if storage.data_ptr() not in kept:
            if sum(kept.values()) + storage.nbytes() > _FOLD_MAX_TOTAL_BYTES:
                continue  # computed on every call, as traced
            kept[storage.data_ptr()] = storage.nbytes()
        name = f"_folded_constant{folded}"
        graph_module.register_buffer(name, values[node], persistent=False)
        with graph.inserting_before(node):
            buffer = graph.get_attr(name)
        buffer.meta = dict(node.meta)
        node.replace_all_uses_with(buffer)
        folded += 1
    return folded


def _drop_unused(graph):
    """Erase the nodes whose results are never used (but random draws and writes); returns
    how many."""
    removed = 0
    for node in reversed(list(graph.nodes)):
        if node.users or node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and _impure(node):
            continue
        graph.erase_node(node)
        removed += 1
    return removed


def _simplify(graph_module):
    r"""Remove what a trace of a Pyro model records but does not need: operations that
    repeat their input (``x * 1``, ``x + 0``, ``x ** 1``, views and expansions to the
    shape the tensor already has, fresh copies of constants: a data matrix copied on every
    call), operations computed twice on the same inputs, operations that do not depend on
    the inputs (computed once, kept as buffers: a prior's parameters broadcast over the
    draws, their logarithms), and operations whose results are never used (the per-site
    sums of a trace's ``log_prob_sum``). Each replay of the graph runs every node at a few
    microseconds' overhead on small tensors, so on small models these are a third to a half
    of the time (``benchmarks/graph_simplify.py``). The values are the same to the bit (but
    for the sign of a zero, which ``x + 0`` makes positive): every remaining operation
    runs on the same values in the same order, and in-place writes, random draws (which
    must advance the stream as the eager run does) and whatever shares storage with a
    written tensor stay as traced. Returns the number of call nodes removed."""
    graph = graph_module.graph
    before = sum(node.op == "call_function" for node in graph.nodes)
    written = _written_storages(graph)
    changed = _drop_identities(graph, written) + _merge_repeats(graph, written)
    changed += _fold_constants(graph_module, written)
    changed += _drop_unused(graph)
    if changed:
        graph.lint()
        graph_module.recompile()
    return before - sum(node.op == "call_function" for node in graph.nodes)


@contextlib.contextmanager
def _one_fake_mode():
    """One fake-tensor mode for the shapes a trace of real tensors records on its nodes:
    without one in context, ``make_fx`` builds a mode for each node (torch 2.13's
    ``proxy_tensor.extract_val``), a third of a small model's trace. The graph is the same."""
    try:
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:  # private names: without them the trace is slower, not different
        yield
        return
    with tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
        yield


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

    #: whether traced graphs are simplified (:func:`_simplify`; the same values to the bit);
    #: a class attribute so that a benchmark can time the graphs as traced
    simplify = True

    def __init__(self, space, backend="fx", max_signatures=8):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.space = space
        self.backend = backend
        self.max_signatures = int(max_signatures)
        self._graphs = collections.OrderedDict()
        #: why the space went back to eager (``None`` while it is compiled)
        self.fallback_reason = None
        #: ``{"traces", "stacked_traces", "calls", "trace_seconds", "compile_seconds",
        #: "rewritten_nodes", "removed_nodes"}`` (traces vmapped over stacked minibatches,
        #: :data:`STACKED_MINIBATCH_DRAWS`; gathers made ``index_select`` / ``index_add``;
        #: nodes :func:`_simplify` removed)
        self.stats = {
            "traces": 0,
            "stacked_traces": 0,
            "calls": 0,
            "trace_seconds": 0.0,
            "compile_seconds": 0.0,
            "rewritten_nodes": 0,
            "removed_nodes": 0,
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
        try:
            grad, value = graph[0](u.detach())
        except RuntimeError as e:
            # a minibatch whose data give the graph other shapes than the traced one's (a
            # boolean mask of the data) that the replay check's minibatch did not show
            self._give_up(f"the traced graph failed on a later call ({str(e).splitlines()[0]})")
            return None
        self.stats["calls"] += 1
        return value, grad

    def _trace(self, u, args, kwargs, full_data):
        space = self.space
        covering = space.covering_minibatches(u.device) if full_data else []
        minibatch = len(covering) > 1
        # a minibatch's graph inputs: its plates' indices, then the masks of wrapped rows
        names, keep_names = (list(covering[0][0]), list(covering[0][1])) if minibatch else ([], [])
        batches = [(*indices.values(), *keep.values()) for indices, keep in covering]

        def log_density_sum(v, *inputs):
            if not minibatch:
                lp = space._eager_log_density(v, args, kwargs, full_data)
            else:  # one minibatch, its indices (and masks) inputs of the graph
                indices = dict(zip(names, inputs[: len(names)], strict=True))
                keep = dict(zip(keep_names, inputs[len(names) :], strict=True))
                lp = space.minibatch_log_density(v, args, kwargs, indices, keep)
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
            expected = space._eager_log_density(u.detach(), args, kwargs, full_data)
        after = pyro.util.get_rng_state()
        pyro.util.set_rng_state(rng)
        # the full data of a subsampled model runs one minibatch after another through one
        # minibatch's graph: unrolled, the graph grew with the data (a trace of 200
        # minibatches took 18 s), and so would its compilation
        inputs = (u.detach(), *batches[0]) if minibatch else (u.detach(),)
        per_call = 1
        if minibatch and STACKED_MINIBATCH_DRAWS // len(u) > 1:
            # as many replays as the bound asks for, the minibatches spread evenly over them
            # (padding a stack costs as much as a minibatch)
            replays = math.ceil(len(batches) / (STACKED_MINIBATCH_DRAWS // len(u)))
            per_call = math.ceil(len(batches) / replays)
        graph = None
        if per_call > 1:
            stacked = _stacked(batches, per_call)[0][0]
            graph = self._trace_stacked(grad_and_value, u, stacked)
            pyro.util.set_rng_state(rng)
            if graph is not None:
                self.stats["stacked_traces"] += 1
                inputs = (u.detach(), *stacked)
        if graph is None:
            per_call = 1
            with pyro.validation_enabled(False), _one_fake_mode():
                graph = make_fx(grad_and_value)(*inputs)
        pyro.util.set_rng_state(rng)
        self.stats["rewritten_nodes"] += _select_along_one_dim(graph)
        if self.simplify:
            self.stats["removed_nodes"] += _simplify(graph)
        self.stats["traces"] += 1
        self.stats["trace_seconds"] += time.perf_counter() - start
        if self.backend == "inductor":
            start = time.perf_counter()
            graph = torch.compile(graph, dynamic=False)
            rng = pyro.util.get_rng_state()
            graph(*inputs)  # compile now, so that its time is counted here
            pyro.util.set_rng_state(rng)
            self.stats["compile_seconds"] += time.perf_counter() - start
        graph = _over_minibatches(graph, batches, per_call) if minibatch else graph
        try:
            self._check_replay(graph, u, args, kwargs, full_data, expected, after)
        finally:  # the first replay, or the eager run that replaces it, draws from here
            pyro.util.set_rng_state(rng)
        return graph

    def _check_replay(self, graph, u, args, kwargs, full_data, expected, after):
        """Raise :class:`_Uncompilable` where the graph does not reproduce the eager model
        on other data than it was traced on: a number or a shape the model computes from
        a minibatch's data (``len(y[idx].nonzero())``, a boolean mask) is frozen in the
        graph at the traced minibatch's value. The full data replays every minibatch
        against the eager full-data value; a minibatch graph replays another minibatch
        (the random streams at ``after``) against an eager run on the same one."""
        if not full_data:
            pyro.util.set_rng_state(after)
            with torch.no_grad():
                expected = self.space._eager_log_density(u.detach(), args, kwargs, False)
            pyro.util.set_rng_state(after)
        try:
            _, value = graph(u.detach())
        except RuntimeError as e:
            raise _Uncompilable(
                "the traced graph failed on another minibatch (a shape the model computes "
                f"from the data?): {str(e).splitlines()[0]}"
            ) from e
        tol = torch.finfo(expected.dtype).eps ** 0.5
        atol = tol * (1 + expected.nan_to_num(0.0, 0.0, 0.0).abs().max())
        if not torch.allclose(value, expected, rtol=tol, atol=atol, equal_nan=True):
            raise _Uncompilable(
                "the traced graph gives another log-density than the model on other "
                "minibatches than the one it was traced on (a number or a shape the model "
                "computes from the data, frozen in the graph)"
            )

    @staticmethod
    def _trace_stacked(grad_and_value, u, stacked_indices):
        """``grad_and_value`` vmapped over stacked minibatch indices, traced; ``None`` where
        the model cannot run so (an op without a batching rule, which torch would run in
        a loop with a warning, or an error): the caller then traces one minibatch."""
        vmapped = torch.func.vmap(grad_and_value, in_dims=(None,) + (0,) * len(stacked_indices))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with pyro.validation_enabled(False), _one_fake_mode():
                    return make_fx(vmapped)(u.detach(), *stacked_indices)
        except Exception:  # noqa: BLE001 - any failure means: one minibatch per replay
            return None
