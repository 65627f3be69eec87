"""The guide x loss grid of the README, as data: one list that the README's table and the
conformance tests (``tests/test_conformance.py``) both come from.

Each loss states the guide capability it needs and refuses a guide without it, naming the
loss that fits; :data:`GRID` records, for each guide of the README's table and each of the
four entropy estimators, whether the pair trains (``True``) or is refused (``False``),
with the words the README prints in that cell. :func:`grid_table` renders the table, and
names in a cell the method of the registry (:mod:`pyro_implicit.diagnostics.methods`)
that trains that pair, as ``compare()`` and the command line call it; the registry in
turn refuses a pair that this grid says does not train.
"""

__all__ = ["GRID", "GUIDES", "LOSSES", "grid_table"]

#: the table's columns: (loss class name, column heading)
LOSSES = (
    ("KernelRatioELBO", "`KernelRatioELBO` (KIVI)"),
    ("SIVI_ELBO", "`SIVI_ELBO` (SIVI)"),
    ("LIVI_ELBO", "`LIVI_ELBO` (LIVI)"),
    ("SteinScoreELBO", "`SteinScoreELBO` (Stein score)"),
)

#: the table's rows: (guide class name, row heading)
GUIDES = (
    ("ImplicitGuide", "`ImplicitGuide`: `u = g(eps)`, MLP or KIVI's matrix generator"),
    ("SemiImplicitGuide", "`SemiImplicitGuide`: `psi = T(eps)`, `u ~ N(mu(psi), Sigma(psi))`"),
    ("LinearizedGuide", "`LinearizedGuide`: `u = g(z) + sigma xi`"),
    ("AutoNormal", "Pyro's `AutoNormal` and other reparameterised guides"),
)

#: ``(guide, loss, trains, cell text)`` for every cell of the table
GRID = (
    ("ImplicitGuide", "KernelRatioELBO", True, "yes"),
    ("ImplicitGuide", "SIVI_ELBO", False, "no (no density)"),
    ("ImplicitGuide", "LIVI_ELBO", False, "no"),
    ("SemiImplicitGuide", "KernelRatioELBO", True, "yes"),
    ("SemiImplicitGuide", "SIVI_ELBO", True, "yes"),
    ("SemiImplicitGuide", "LIVI_ELBO", False, "no"),
    ("LinearizedGuide", "KernelRatioELBO", True, "yes"),
    # at the default sigma = 1e-3 the mixture estimate collapses q: refused below 0.1
    ("LinearizedGuide", "SIVI_ELBO", False, "with `sigma` >= 0.1 only"),
    ("LinearizedGuide", "LIVI_ELBO", True, "yes"),
    # exact_sites="auto": a guide's density is used, never estimated
    ("AutoNormal", "KernelRatioELBO", True, "yes (= `Trace_ELBO`)"),
    ("AutoNormal", "SIVI_ELBO", True, "yes (= `Trace_ELBO`)"),
    # a guide with a density has nothing for LIVI to linearise: the ordinary ELBO
    ("AutoNormal", "LIVI_ELBO", True, "yes (= `Trace_ELBO`)"),
    # the Stein score estimate needs only draws: every guide samples
    ("ImplicitGuide", "SteinScoreELBO", True, "yes"),
    ("SemiImplicitGuide", "SteinScoreELBO", True, "yes"),
    ("LinearizedGuide", "SteinScoreELBO", True, "yes"),
    ("AutoNormal", "SteinScoreELBO", True, "yes (= `Trace_ELBO`)"),
)


def grid_table():
    """The README's guide x loss table (Markdown) rendered from :data:`GRID`, with the
    registry's method name in the cells of the pairs it runs (e.g. ``yes (`kivi`)``)."""
    # read when rendered: the registry imports this module to check itself against GRID
    from ..diagnostics.methods import grid_method

    cells = {}
    for guide, loss, _, text in GRID:
        name = grid_method(guide, loss)
        cells[(guide, loss)] = text if name is None else f"{text} (`{name}`)"
    lines = [
        "| guide (how `u` is drawn) | " + " | ".join(head for _, head in LOSSES) + " |",
        "|" + "---|" * (len(LOSSES) + 1),
    ]
    for guide, head in GUIDES:
        row = [cells[(guide, loss)] for loss, _ in LOSSES]
        lines.append(f"| {head} | " + " | ".join(row) + " |")
    return "\n".join(lines)
