"""fastmm.errors: the warning category fastmm's fallbacks use, each text warned once per process."""
from __future__ import annotations

import warnings

import pytest

import fastmm
from fastmm import errors


def test_warn_once_warns_each_text_once_as_a_fastmm_warning(monkeypatch):
    monkeypatch.setattr(errors, "_warned", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            errors.warn_once("fastmm: one reason")
        errors.warn_once("fastmm: another reason")
    assert [str(w.message) for w in seen] == ["fastmm: one reason", "fastmm: another reason"]
    assert all(w.category is errors.FastmmWarning for w in seen)
    assert fastmm.FastmmWarning is errors.FastmmWarning and issubclass(errors.FastmmWarning, UserWarning)


def test_a_text_counts_as_given_even_where_the_warning_raised(monkeypatch):
    """Under warnings.simplefilter("error") the first call raises (after recording the text);
    a later call with the same text is silent, as for a warning shown once."""
    monkeypatch.setattr(errors, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(errors.FastmmWarning):
            errors.warn_once("fastmm: raised")
        errors.warn_once("fastmm: raised")
