"""Refusals are one line with a fix; the stack only with ``model-factory --debug``."""

from __future__ import annotations

import click
from click.testing import CliRunner

from model_factory.cli.common import user_errors
from model_factory.cli.main import main
from model_factory.errors import FactoryError
from model_factory.serving.refusals import load_error_line, one_line

TRITON_ERROR = ("load failed for model 'enc': version 1 is at UNAVAILABLE state: Internal: WarmupError: enc fails "
                "its warm-up on onnxruntime: idx=1 must be within [-1,0]. Fix: declare the ranges, then rebuild\n\n"
                "At:\n  /repo/enc/1/mf_backend/samples.py(80): warm_up\n  /repo/enc/1/mf_backend/model.py(40): "
                "initialize\n;\n")


def test_a_triton_load_error_becomes_one_line_without_the_stack() -> None:
    line = load_error_line(TRITON_ERROR)
    assert line == ("WarmupError: enc fails its warm-up on onnxruntime: idx=1 must be within [-1,0]. Fix: declare "
                    "the ranges, then rebuild")
    other = load_error_line("load failed for model 'x': version 1 is at UNAVAILABLE state: Internal: "
                            "InvalidProtobuf: bad\nfile\n\nAt:\n  f.py(1): g\n")
    assert "\n" not in other and other.startswith("InvalidProtobuf: bad file. Fix: run model-factory accept")


def test_one_line_names_the_type_and_adds_a_fix_only_when_missing() -> None:
    assert one_line(ValueError("a\n  b")) == ("ValueError: a b. Fix: rebuild the model (model-factory build), or "
                                              "serve it where its engine loads")
    assert one_line(FactoryError("x is wrong. Fix: do y")) == "x is wrong. Fix: do y"


@click.command("explode")
@click.option("--user", is_flag=True)
@user_errors
def _explode(user: bool) -> None:
    if user:
        raise FactoryError("the input is wrong. Fix: give another")
    raise KeyError("internal\nthing")


def test_errors_are_one_line_and_the_stack_needs_debug() -> None:
    main.add_command(_explode)
    try:
        runner = CliRunner()
        out = runner.invoke(main, ["explode"])
        assert out.exit_code == 1 and "Traceback" not in out.output
        assert out.output.strip().splitlines() == [
            "Error: KeyError: 'internal\\nthing'. Fix: rerun as model-factory --debug explode ... to see where it "
            "failed, and report it if the cause is not yours"]
        out = runner.invoke(main, ["explode", "--user"])
        assert out.output.strip() == "Error: the input is wrong. Fix: give another"
        debug = runner.invoke(main, ["--debug", "explode"])
        assert isinstance(debug.exception, KeyError)  # raised with its stack, not turned into a line
        debug = runner.invoke(main, ["--debug", "explode", "--user"])
        assert isinstance(debug.exception, FactoryError)
    finally:
        main.commands.pop("explode", None)
