"""A remote exception's type on the caller: its own, and also torch's RuntimeError."""

from __future__ import annotations

import pickle

import pytest

from rallypoint.rpc._remote_errors import catchable_as_torch


class AppError(Exception):
    pass


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", [KeyError, ZeroDivisionError, AppError, OSError])
def test_other_exceptions_are_also_runtime_errors_and_pickle_as_themselves(kind: type) -> None:
    combined = catchable_as_torch(kind)
    exc = combined("boom")
    assert isinstance(exc, kind) and isinstance(exc, RuntimeError)
    assert combined.__name__ == kind.__name__ and combined.__module__ == kind.__module__
    assert catchable_as_torch(kind) is combined  # one class per type
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is kind and again.args == ("boom",)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", [ValueError, TypeError, RuntimeError, UnicodeError, SystemExit])
def test_types_torch_keeps_and_base_exceptions_stay_as_they_are(kind: type) -> None:
    assert catchable_as_torch(kind) is kind


@pytest.mark.timeout(10)
def test_a_futures_error_text_starts_with_the_type_name_as_torchs() -> None:
    from rallypoint.rpc._remote_errors import with_type_name

    key = with_type_name(catchable_as_torch(KeyError)("On w1:\nKeyError('k')"))
    # torch: the name, then str() of the rebuilt KeyError (quoted once, not twice)
    assert str(key) == "KeyError: " + str(KeyError("On w1:\nKeyError('k')"))
    assert isinstance(key, KeyError) and isinstance(key, RuntimeError)
    assert type(pickle.loads(pickle.dumps(key))) is KeyError
    value = with_type_name(ValueError("On w1: boom"))
    assert type(value) is ValueError and str(value) == "ValueError: On w1: boom"
    app = with_type_name(catchable_as_torch(AppError)("boom"))
    assert str(app) == "AppError: boom" and isinstance(app, AppError)
