"""The command line, run in-process through ``main``."""

import pytest
import torch

from pyro_implicit.__main__ import SMOKE_CAPS, _parse, main
from pyro_implicit.diagnostics.compare import METHODS


def test_smoke_prints_table(capsys):
    dtype = torch.get_default_dtype()
    assert main(["compare", "--smoke", "--quiet", "--nuts-chains", "1"]) == 0
    out = capsys.readouterr().out
    assert "eight_schools" in out
    assert "SMOKE RUN" in out
    table = out[out.index("method"):]
    for name in list(METHODS) + ["nuts"]:
        assert any(line.startswith(name + " ") for line in table.splitlines()), name
    assert "NUTS: 1 chain(s) x 20 draws" in out
    assert torch.get_default_dtype() == dtype  # main restores it


def test_markdown_and_options_without_subcommand(capsys):
    argv = ["--smoke", "--quiet", "--model", "banana", "--methods", "autonormal",
            "--nuts-chains", "1", "--markdown"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| method | mean err |" in out
    assert "| autonormal |" in out and "| implicit |" not in out
    assert "banana" in out


def test_smoke_caps_counts():
    args = _parse(["compare", "--smoke", "--steps", "5000", "--nuts-samples", "7"])
    assert args.steps == SMOKE_CAPS["steps"]
    assert args.nuts_samples == 7
    assert args.samples == SMOKE_CAPS["samples"]
    assert args.methods == list(METHODS)


def test_no_arguments_is_the_default_job():
    args = _parse([])
    assert args.model == "eight_schools" and args.methods == list(METHODS)
    assert args.threads == 1 and not args.smoke


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare", "--methods", "implicit,nope"], "unknown method(s) 'nope'; choose from: "
                                                    + ", ".join(METHODS)),
        (["compare", "--model", "nope"], "invalid choice: 'nope'"),
        (["compare", "--steps", "0"], "expected a positive integer"),
    ],
)
def test_bad_input_exits_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    if "--model" in argv:
        assert "eight_schools" in err and "banana" in err
