"""The report folder of ``pyro-implicit compare --report DIR``: the comparison as
``table.md`` and ``comparison.json`` (every number), LOO tables (``loo.csv``), loss curves,
pair plots over NUTS and, for a BNN regression, predictive bands.

Kept apart from the command line's parsing (:mod:`pyro_implicit.__main__`): it only reads
a :class:`~pyro_implicit.diagnostics.results.ComparisonResult` and writes files.
"""

import json
import math
import os
import warnings

import torch

__all__ = ["LOO_NOTE", "write_report"]


#: what loo.csv is and is not (written beside it)
LOO_NOTE = (
    "loo.csv (az.compare of the ArviZ exports) treats each approximation as if it were the "
    "posterior: it ranks predictive fit on these data, not fidelity to NUTS. A fit can "
    "score well there and still be far from the posterior; the table above measures that."
)


def _loo_tables(result, spec, mpn, seed):
    """``az.compare`` of the ArviZ exports of every row, one table per observed site
    (LOO needs one pointwise log-likelihood), or ``None`` with the reason.

    :return: ``({site: table}, None)`` or ``(None, reason)``.
    """
    from .diagnostics.arviz import _arviz, comparison_to_inference_data

    az = _arviz()
    idatas = comparison_to_inference_data(
        result, spec.model, spec.args, spec.kwargs, max_plate_nesting=mpn, seed=seed
    )
    if not all("log_likelihood" in idata for idata in idatas.values()):  # 0.x and 1.x
        return None, "the model has no observed site"
    sites = list(next(iter(idatas.values()))["log_likelihood"].data_vars)
    with warnings.catch_warnings():
        # Pareto-k warnings (and the Pareto fit's divisions by zero on collapsed particle
        # sets) are expected for VI draws and tiny runs: the table has a warning column.
        # arviz 0.23 also trips a pandas deprecation of sort_values.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.filterwarnings("ignore", message=".*inplace keyword", category=DeprecationWarning)
        return {site: az.compare(idatas, var_name=site) for site in sites}, None


def write_report(folder, result, spec, mpn, args, header, total):
    """Write the report folder of ``--report``.

    :return: the paths written.
    :rtype: list[str]
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    from .diagnostics.plots import loss_curves, pair_plot, regression_predictive_plot

    os.makedirs(folder, exist_ok=True)
    written = []

    def save(fig, name):
        path = os.path.join(folder, name)
        fig.savefig(path, dpi=110)
        written.append(path)

    data = result.to_dict()
    data["model"] = {"name": spec.name, "description": spec.description}
    data["command"] = {k: v for k, v in vars(args).items()}
    data["header"] = header
    data["total_seconds"] = total
    try:
        loo, why = _loo_tables(result, spec, mpn, args.seed)
    except Exception as e:  # the report should not die on a LOO failure
        loo, why = None, f"{type(e).__name__}: {e}"
    if loo is not None:
        for site, table in loo.items():
            name = "loo.csv" if len(loo) == 1 else f"loo_{site}.csv"
            path = os.path.join(folder, name)
            table.to_csv(path)
            written.append(path)
        tables = {site: json.loads(t.to_json(orient="index")) for site, t in loo.items()}
        data["loo"] = next(iter(tables.values())) if len(tables) == 1 else tables
    else:
        data["loo"] = {"skipped": why}
    data["loo_note"] = LOO_NOTE
    path = os.path.join(folder, "table.md")
    with open(path, "w") as f:
        f.write(
            "```text\n"
            + header
            + "\n```\n\n"
            + result.to_markdown()
            + "\n\n"
            + result.to_markdown(per_site=True)
            + "\n"
        )
        if loo is not None:
            f.write("\n" + LOO_NOTE + "\n")
    written.append(path)
    path = os.path.join(folder, "comparison.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=_json_default)
    written.append(path)
    coords = args.plot_sites.split(",") if args.plot_sites else None
    for name, r in result.methods.items():
        if result.has_reference and r.failure is None:  # pair plots overlay NUTS
            save(
                pair_plot(
                    r.samples, result.nuts.samples, coords=coords, label=name, seed=args.seed
                ),
                f"pairs_{name}.png",
            )
    if any(r.losses for r in result.methods.values()):
        save(loss_curves(result), "losses.png")
    from .bnn import BNNRegression

    bnn = (spec.extras or {}).get("bnn")
    failed = [n for n, r in result.methods.items() if r.failure]
    if isinstance(bnn, BNNRegression) and "x_test" in spec.extras and result.has_reference:
        draws = {n: r.samples for n, r in result.methods.items() if n not in failed}
        save(
            regression_predictive_plot(
                bnn,
                spec.extras["x_test"],
                draws,
                result.nuts.samples,
                y=spec.extras.get("y_test"),
                max_plate_nesting=mpn,
                seed=args.seed,
            ),
            "predictive.png",
        )

    return written


def _json_default(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return repr(x)
