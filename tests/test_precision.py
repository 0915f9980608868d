"""fastmm.precision: what ``precision=None`` means (PyTorch's float32 matmul setting, read so that
torch 2.13's mixed-API state does not break it), names checked, torch.matmul run at the
precision asked for and the user's setting restored, and when autocast owns a matmul."""
from __future__ import annotations

import pytest
import torch

from fastmm.precision import autocast_half_active, autocast_half_active_on, resolve_precision, torch_allows_tf32, torch_precision


@pytest.fixture(autouse=True)
def restore_float32_precision():
    old = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(old)


@pytest.mark.parametrize("bad", ["bogus", "IEEE", "fp32", "highest", ""])
def test_an_unknown_precision_raises_listing_the_allowed_values(bad):
    with pytest.raises(ValueError) as exc:
        resolve_precision(bad)
    for allowed in ("'ieee'", "'tf32'", "'tf32x3'", "None"):
        assert allowed in str(exc.value)
    assert repr(bad) in str(exc.value)


@pytest.mark.parametrize("setting,expected", [("highest", "ieee"), ("high", "tf32"), ("medium", "tf32")])
def test_precision_none_follows_torch_float32_matmul_setting(setting, expected):
    torch.set_float32_matmul_precision(setting)
    assert resolve_precision(None) == expected
    assert torch_allows_tf32() is (expected == "tf32")


def test_precision_none_follows_the_cuda_tf32_flag():
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = True
    assert resolve_precision(None) == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = False
    assert resolve_precision(None) == "ieee"


def test_precision_none_survives_mixed_torch_precision_apis():
    # set_float32_matmul_precision then allow_tf32: torch 2.13's own getter raises here
    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.matmul.allow_tf32 = False
    assert resolve_precision(None) == "ieee"
    torch.backends.cuda.matmul.allow_tf32 = True
    assert resolve_precision(None) == "tf32"


@pytest.mark.skipif(not hasattr(torch.backends, "fp32_precision"), reason="torch < 2.9 has no fp32_precision API")
def test_precision_none_follows_the_new_fp32_precision_api_and_its_inheritance():
    matmul = torch.backends.cuda.matmul
    old_matmul, old_generic = matmul.fp32_precision, torch.backends.fp32_precision
    try:
        for generic in ("ieee", "tf32"):
            torch.backends.fp32_precision = generic
            matmul.fp32_precision = "tf32"
            assert resolve_precision(None) == "tf32"
            matmul.fp32_precision = "ieee"
            assert resolve_precision(None) == "ieee"
            matmul.fp32_precision = "none"  # inherits the generic setting
            assert resolve_precision(None) == generic
    finally:
        torch.backends.fp32_precision = old_generic
        matmul.fp32_precision = old_matmul


@pytest.mark.parametrize("precision", ["ieee", "tf32", "tf32x3"])
def test_explicit_precision_is_kept_whatever_torchs_setting(precision):
    for setting in ("highest", "high"):
        torch.set_float32_matmul_precision(setting)
        assert resolve_precision(precision) == precision


@pytest.mark.parametrize("setting", ["highest", "high", "medium"])
@pytest.mark.parametrize("precision,tf32", [("ieee", False), ("tf32", True), ("tf32x3", False)])
def test_torch_precision_applies_the_asked_precision_then_restores_the_users_setting(setting, precision, tf32):
    torch.set_float32_matmul_precision(setting)
    with torch_precision(precision):
        assert torch.backends.cuda.matmul.allow_tf32 is tf32
    assert torch.get_float32_matmul_precision() == setting  # the user's setting, still readable
    with pytest.raises(KeyError):
        with torch_precision(precision):
            raise KeyError("restored on errors too")
    assert torch.get_float32_matmul_precision() == setting


def test_torch_precision_none_or_already_so_leaves_the_setting_alone(monkeypatch):
    """None (CPU operands), or a precision torch already runs at: no toggling at all (toggling
    can leave torch's two precision APIs mixed)."""
    torch.set_float32_matmul_precision("high")

    def refuse(value):
        raise AssertionError(f"the setting was changed to {value!r}")

    monkeypatch.setattr(torch, "set_float32_matmul_precision", refuse)
    for precision in (None, "tf32"):
        with torch_precision(precision):
            assert torch.backends.cuda.matmul.allow_tf32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_owns_a_matmul_only_with_a_half_dtype_on_the_operands_device_type(dtype):
    assert not autocast_half_active("cpu")
    with torch.autocast("cpu", dtype=dtype):
        assert autocast_half_active("cpu")
        assert not autocast_half_active("cuda")  # another device type's autocast is not on
        assert not autocast_half_active("meta")  # a device type autocast does not know
    with torch.autocast("cpu", dtype=dtype, enabled=False):
        assert not autocast_half_active("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_tensor_form_of_the_autocast_test_agrees_with_the_device_type_form(dtype):
    """autocast_half_active_on(t) skips reading t.device while no autocast is on anywhere; it must
    answer as autocast_half_active(t.device.type) does, off, on for t's device type, and on for
    another device type only."""
    t = torch.ones(2)
    assert autocast_half_active_on(t) is False
    with torch.autocast("cpu", dtype=dtype):
        assert autocast_half_active_on(t) is True is autocast_half_active("cpu")
        assert autocast_half_active_on(torch.ones(2, device="meta")) is False
    with torch.autocast("cpu", dtype=dtype, enabled=False):
        assert autocast_half_active_on(t) is False
