"""A pytest plugin: the test suite run as if a family variant were fastmm's default, so that one
GPU call lists every test the change would break before the default is changed (NOTES run 59: a
GPU run with wgmma's staged turns as the H100's default had failures that ran out of device time
before they could be listed):

    PYTHONPATH=.:benchmarks/probes python -m pytest tests -m cuda -rf -p default_variant \\
        --default-variant wgmma_tf32:pingpong_tma_store=True

``--default-variant NAME:FIELD=VALUE,...`` (benchmarks/models.py's ``--variant`` syntax; repeatable)
changes both places a default lives: the registry's family (``fastmm.families.FAMILIES``: the
planner's own plans) and the family class's field defaults (the variants tests build, e.g.
``WgmmaTf32(force_bn=128)``, get the field unless they name it: a test that names the field keeps
its value, as do ``dataclasses.replace`` copies). Subclasses of the family class keep their own
defaults. The run's header says what was changed. Applied when pytest is configured, before any
product is planned (plans are cached by problem).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

_MODELS_PY = Path(__file__).resolve().parents[1] / "models.py"
_applied: list[str] = []


def pytest_addoption(parser):
    parser.addoption("--default-variant", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                     help="run the tests with family NAME's defaults changed to these fields (repeatable)")


def _family_variant(text: str):
    """benchmarks/models.py's parser (one syntax for both), loaded from its file: benchmarks/ is
    not a package."""
    spec = importlib.util.spec_from_file_location("fastmm_bench_models", _MODELS_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.family_variant(text)


def _with_defaults(cls, fields: dict) -> None:
    """Make ``fields`` the defaults of ``cls``'s constructor for keyword arguments left out."""
    init = cls.__init__
    positional = [f.name for f in dataclasses.fields(cls) if f.init and not f.kw_only]

    def __init__(self, *args, **kwargs):
        named = set(positional[:len(args)]) | set(kwargs)
        init(self, *args, **kwargs, **{k: v for k, v in fields.items() if k not in named})

    __init__.__wrapped__ = init
    cls.__init__ = __init__


def pytest_configure(config):
    from fastmm.families import FAMILIES

    for text in config.getoption("--default-variant"):
        _, _, fields_text = text.partition(":")
        try:
            family = _family_variant(text)  # (refuses a family or field that does not exist)
        except Exception as exc:
            raise pytest.UsageError(f"--default-variant {text}: {exc}") from exc
        fields = {f: getattr(family, f) for f in (item.partition("=")[0] for item in fields_text.split(",") if item)}
        FAMILIES[family.name] = dataclasses.replace(FAMILIES[family.name], **fields)
        _with_defaults(type(family), fields)
        _applied.append(f"{family.name}: {fields}")


def pytest_report_header(config):
    return [f"default variant: {line}" for line in _applied] or None
